"""Bounded, adaptive concurrency and retries for calls to hosted model providers.

Why our own retry loop instead of the SDKs': retries hidden inside an SDK never reach the limiter that should
slow down when a provider says "too many requests". Provider clients are therefore built with the SDK's
retries off, and every failure comes back here: the limiter sees each rate-limit signal, and the wait before
the next attempt honours the provider's ``retry-after``.

Nothing here knows a provider: an adapter turns its SDK's exceptions into a :class:`Failure`.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import anyio

__all__ = ["AdaptiveLimiter", "Failure", "RetryPolicy", "retry_after_seconds"]

Outcome = Literal["ok", "rate_limited", "error"] | None


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


class _Waiter:
    __slots__ = ("epoch", "event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False
        self.epoch = 0


class AdaptiveLimiter:
    """At most ``limit`` calls in flight, FIFO; the limit adapts to rate limiting (AIMD).

    A rate-limited call halves the limit (``decrease``), but only once per *epoch*: calls already in flight
    when the limit dropped carry the old epoch, so a burst of 429s answering one wave of requests counts as
    one signal, not sixteen. Each successful call adds ``1/limit``, i.e. about one slot per window of
    successes, so the limit climbs back to ``max_in_flight`` once the provider stops objecting.
    """

    def __init__(self, max_in_flight: int, *, min_in_flight: int = 1, decrease: float = 0.5) -> None:
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if not isinstance(min_in_flight, int) or not 1 <= min_in_flight <= max_in_flight:
            raise ValueError(f"min_in_flight must be an int in [1, max_in_flight], got {min_in_flight!r}")
        if not 0 < decrease < 1:
            raise ValueError(f"decrease must be a factor in (0, 1), got {decrease!r}")
        self._max = max_in_flight
        self._min = min_in_flight
        self._decrease = decrease
        self._limit = float(max_in_flight)
        self._epoch = 0
        self._in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self.peak = 0
        """The most calls ever in flight at once."""
        self.lowest = max_in_flight
        """The lowest the limit has been."""
        self.rate_limited = 0
        """Calls that ended rate-limited."""

    @property
    def max_in_flight(self) -> int:
        return self._max

    @property
    def limit(self) -> int:
        """Calls allowed in flight right now."""
        return max(self._min, int(self._limit))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> int:
        """Wait for a slot; returns the epoch token to hand back to :meth:`release`."""
        if self._in_flight < self.limit and not self._waiters:
            self._take()
            return self._epoch
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:  # the slot was handed over just as we were cancelled: give it back
                self._in_flight -= 1
                self._grant()
            else:
                self._waiters.remove(waiter)
            raise
        return waiter.epoch  # the epoch when the slot was granted, i.e. when the call goes out

    def release(self, token: int, outcome: Outcome = None) -> None:
        """Free a slot. ``outcome`` "ok" grows the limit, "rate_limited" may shrink it, others neither."""
        self._in_flight -= 1
        if outcome == "ok":
            if self._limit < self._max:
                self._limit = min(float(self._max), self._limit + 1 / self._limit)
        elif outcome == "rate_limited":
            self.rate_limited += 1
            if token == self._epoch:
                self._limit = max(float(self._min), self._limit * self._decrease)
                self._epoch += 1
                self.lowest = min(self.lowest, self.limit)
        self._grant()

    def _take(self) -> None:
        self._in_flight += 1
        if self._in_flight > self.peak:
            self.peak = self._in_flight

    def _grant(self) -> None:
        while self._waiters and self._in_flight < self.limit:
            waiter = self._waiters.popleft()
            waiter.granted = True
            waiter.epoch = self._epoch
            self._take()
            waiter.event.set()

    def __repr__(self) -> str:
        return (
            f"AdaptiveLimiter(limit={self.limit}/{self._max}, in_flight={self._in_flight}, "
            f"waiting={len(self._waiters)})"
        )
