"""The values a hosted-model call is judged and paced by: how a failure reads, how it is retried, how a
provider batch is rounded and polled, and a provider's ``retry-after``.

Plain values and pure functions (no event loop, no I/O): a participant builds its policies and a provider
adapter reads its SDK's errors with these, without loading the gateway's machinery (``_core``, ``_collect``).
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["BatchPolicy", "Failure", "RetryPolicy", "retry_after_seconds"]


@dataclass(frozen=True, slots=True)
class Failure:
    """How a failed call should be treated, as the provider adapter reads the error.

    ``retryable``: another attempt may succeed (408/409/429/5xx, a dropped connection, a timeout).
    ``rate_limited``: the provider asked us to slow down (429, overloaded): the limiter backs off.
    ``retry_after``: seconds the provider asked us to wait, when it said so.
    """

    retryable: bool
    rate_limited: bool = False
    retry_after: float | None = None


def _check_number(name: str, value: object, *, minimum: float, strict: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value < minimum if not strict else value <= minimum):  # type: ignore[operator]
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed provider call is retried.

    ``max_attempts`` counts the first try. Waits grow ``initial_s * multiplier**(n-1)`` up to ``max_s``, each
    shortened by up to ``jitter`` (a fraction) so that a crowd of callers rejected together does not come
    back together. A ``retry-after`` from the provider is used as given; one longer than
    ``max_retry_after_s`` means "not soon": the call fails instead of stalling its conversation for that long.
    """

    max_attempts: int = 6
    initial_s: float = 0.5
    max_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.25
    max_retry_after_s: float = 120.0

    def __post_init__(self) -> None:
        if (
            not isinstance(self.max_attempts, int)
            or isinstance(self.max_attempts, bool)
            or self.max_attempts < 1
        ):
            raise ValueError(
                f"RetryPolicy.max_attempts must be an int >= 1 (1 = no retry), got {self.max_attempts!r}"
            )
        _check_number("RetryPolicy.initial_s", self.initial_s, minimum=0)
        _check_number("RetryPolicy.max_s", self.max_s, minimum=0)
        _check_number("RetryPolicy.multiplier", self.multiplier, minimum=1)
        _check_number("RetryPolicy.max_retry_after_s", self.max_retry_after_s, minimum=0)
        if not 0 <= _check_number("RetryPolicy.jitter", self.jitter, minimum=0) <= 1:
            raise ValueError(f"RetryPolicy.jitter must be a fraction in [0, 1], got {self.jitter!r}")

    def should_retry(self, attempt: int, failure: Failure) -> bool:
        """Whether failed attempt number ``attempt`` (1-based) deserves another one."""
        if not failure.retryable or attempt >= self.max_attempts:
            return False
        return failure.retry_after is None or failure.retry_after <= self.max_retry_after_s

    def delay(
        self, attempt: int, retry_after: float | None = None, *, rand: Callable[[], float] = random.random
    ) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based) before the next one."""
        if retry_after is not None and retry_after > 0:
            return min(retry_after, self.max_retry_after_s)
        base = min(self.initial_s * self.multiplier ** (attempt - 1), self.max_s)
        return base * (1 - self.jitter * rand())


def retry_after_seconds(headers: Mapping[str, str] | None, *, now: float | None = None) -> float | None:
    """The wait a response asks for: ``retry-after-ms`` wins over ``retry-after`` (seconds or HTTP-date).

    Returns None when neither header holds a usable positive value (the caller then backs off on its own).
    """
    if not headers:
        return None
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            ms = float(raw_ms)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms > 0:
            return ms / 1000
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return seconds if math.isfinite(seconds) and seconds > 0 else None


@dataclass(frozen=True)
class BatchPolicy:
    """When a round of batched requests is flushed, and how its batch is polled.

    ``idle_s``: the default quiescence probe (no new request for that long) when the scheduler supplies none.
    ``max_wait_s``: the latest a request waits for company. ``max_rows``: flush at this many requests (None:
    the provider's own limit). Polls start ``poll_initial_s`` after submission and back off by
    ``poll_multiplier`` up to ``poll_max_s``: provider batches take minutes to hours, and polls cost requests.
    """

    max_rows: int | None = None
    max_wait_s: float = 60.0
    idle_s: float = 2.0
    poll_initial_s: float = 5.0
    poll_max_s: float = 60.0
    poll_multiplier: float = 1.5

    def __post_init__(self) -> None:
        if self.max_rows is not None and (
            not isinstance(self.max_rows, int) or isinstance(self.max_rows, bool) or self.max_rows < 1
        ):
            raise ValueError(f"BatchPolicy.max_rows must be None or an int >= 1, got {self.max_rows!r}")
        _check_number("BatchPolicy.max_wait_s", self.max_wait_s, minimum=0)
        _check_number("BatchPolicy.idle_s", self.idle_s, minimum=0)
        _check_number("BatchPolicy.poll_initial_s", self.poll_initial_s, minimum=0)
        _check_number("BatchPolicy.poll_max_s", self.poll_max_s, minimum=0)
        _check_number("BatchPolicy.poll_multiplier", self.poll_multiplier, minimum=1)
