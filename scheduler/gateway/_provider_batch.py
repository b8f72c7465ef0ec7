"""Provider batch APIs, the shared parts: policies, limits, what adapters return, and rows in flight.

A provider batch is paid for when it is submitted, so everything here is built around never losing track of
one: a submitted batch is recorded in a :class:`BatchStore` (the run's ledger) before it is polled, and a row
that fails becomes a :class:`BatchRowError` for its own caller only. The round logic (collecting, flushing,
polling, re-attaching) lives in ``_collect``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from interlens.store import redacting_logger

from ._limits import Failure, RetryPolicy, _check_number

__all__ = [
    "BatchLimits",
    "BatchPolicy",
    "BatchRowError",
    "BatchStatus",
    "BatchStore",
    "SubmittedBatch",
]

log = redacting_logger("interlens.gateway")  # a key echoed in an error is redacted


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


@dataclass(frozen=True)
class BatchLimits:
    """A provider's ceiling for one batch: requests, and bytes of the serialized requests."""

    max_requests: int
    max_bytes: int


@dataclass(frozen=True)
class SubmittedBatch:
    """What an adapter returns for a batch the provider accepted. ``meta`` is JSON, never a credential."""

    batch_id: str
    state: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchStatus:
    """One poll: the provider's state name, and whether results can be fetched now."""

    state: str
    done: bool


class BatchRowError(Exception):
    """One row of a provider batch failed, or the whole batch did: raised to that row's caller only.

    ``retryable`` rows (expired, rate limited, a server error) go into a later batch, per the retry policy.
    """

    def __init__(self, message: str, retryable: bool = False, rate_limited: bool = False) -> None:
        super().__init__(message, retryable, rate_limited)  # all in args: pickles across a worker pipe

    @property
    def failure(self) -> Failure:
        return Failure(retryable=bool(self.args[1]), rate_limited=bool(self.args[2]))

    def __str__(self) -> str:
        return str(self.args[0])


class BatchStore(Protocol):
    """Where batches are recorded: ``interlens.store.Ledger`` (its batch methods) satisfies this."""

    async def record_batch(self, batch: Any) -> None: ...

    async def update_batch(
        self, provider: str, batch_id: str, *, state: str, meta: Mapping[str, Any] | None = None
    ) -> None: ...

    async def open_batches(self) -> list[Any]: ...


class BatchClient(Protocol):
    """The batch half of a provider adapter (see ``ProviderClient`` in ``_core``)."""

    provider: str
    batch_limits: BatchLimits

    def classify(self, exc: BaseException) -> Failure: ...

    def row_size(self, request: Any) -> int: ...

    def request_hash(self, request: Any) -> str: ...

    async def submit_batch(self, rows: Sequence[tuple[str, Any]]) -> SubmittedBatch: ...

    async def poll_batch(self, batch_id: str, meta: Mapping[str, Any]) -> BatchStatus: ...

    async def batch_results(
        self, batch_id: str, meta: Mapping[str, Any]
    ) -> Mapping[str, Any | BaseException]: ...


def classify(client: BatchClient, exc: BaseException) -> Failure:
    """Our own row errors say how to treat them; anything else is the adapter's to read."""
    return exc.failure if isinstance(exc, BatchRowError) else client.classify(exc)


async def retrying(
    client: BatchClient, policy: RetryPolicy, what: str, fn: Callable[[], Awaitable[Any]]
) -> Any:
    """``await fn()`` under the retry policy (for batch control calls, outside the in-flight limit)."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn()
        except Exception as exc:
            failure = classify(client, exc)
            if not policy.should_retry(attempt, failure):
                raise
            delay = policy.delay(attempt, failure.retry_after)
            log.info(
                "%s %s failed (%s); retry %d in %.2f s",
                client.provider,
                what,
                type(exc).__name__,
                attempt,
                delay,
            )
        await anyio.sleep(delay)


def describe_error(exc: BaseException) -> str:
    """One line for an error message or a log: status, type, the first line of the message and, when the SDK
    left it out, the server's own reason (an OpenAI-compatible server such as ``transformers serve`` answers
    ``{"detail": "..."}``, which the SDK's message reduces to "Error code: 400")."""
    status = getattr(exc, "status_code", None)
    text = str(exc).splitlines()[0] if str(exc) else ""
    reason = _server_reason(getattr(exc, "body", None))
    if reason and reason not in text:
        text = f"{text}: {reason}" if text else reason
    return f"{f'HTTP {status} ' if status is not None else ''}{type(exc).__name__}: {text[:300]}"


def _server_reason(body: Any) -> str | None:
    """The first line of a JSON error body's reason: ``error.message``, ``detail`` or ``message``."""
    if not isinstance(body, dict):
        return None
    for key in ("error", "detail", "message"):
        value = body.get(key)
        if isinstance(value, dict):
            value = value.get("message")
        if isinstance(value, str) and value.strip():
            return value.strip().splitlines()[0]
    return None


class Row:
    """One request in a round: who asked (job, turn), its batch once flushed, and its outcome."""

    __slots__ = (
        "batch",
        "custom_id",
        "done",
        "error",
        "on_done",
        "owner",
        "request",
        "result",
        "size",
        "turn",
        "wake",
    )

    def __init__(self, request: Any, owner: str | None, turn: int | None, size: int) -> None:
        self.request = request
        self.owner = owner
        self.turn = turn
        self.size = size
        self.wake: anyio.Event | None = None
        self.batch: Batch | None = None
        self.custom_id = ""
        self.done = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.on_done: Callable[[], None] | None = None  # its caller stops counting as blocked (once)

    def resolve(self, outcome: Any) -> None:
        if self.done.is_set():
            return
        if isinstance(outcome, BaseException):
            self.error = outcome
        else:
            self.result = outcome
        self.done.set()
        self.release()

    def release(self) -> None:
        """The caller is no longer blocked on this row: its outcome is delivered, or it left (cancelled).

        At delivery, not when the caller's task next runs: the callers of a finished batch resume one by
        one, and one of them may already ask for its next turn while the others still look blocked.
        """
        callback, self.on_done = self.on_done, None
        if callback is not None:
            callback()

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class Batch:
    """A submitted (or re-attached) provider batch and the rows waiting on it."""

    def __init__(
        self, provider: str, rows: dict[str, Row | None], *, batch_id: str = "", state: str = ""
    ) -> None:
        self.provider = provider
        self.rows = rows
        self.batch_id = batch_id
        self.state = state
        self.meta: dict[str, Any] = {}
        self.submitted = anyio.Event()
        self.poll_lock = anyio.Lock()
        self.interval: float | None = None  # seconds to wait before the next poll; None: poll now
        self.results: Mapping[str, Any] | None = None

    def finish(self, results: Mapping[str, Any]) -> None:
        self.results = results
        for custom_id, row in self.rows.items():
            if row is not None:
                row.resolve(self.result_for(custom_id))

    def result_for(self, custom_id: str) -> Any:
        assert self.results is not None
        if custom_id in self.results:
            return self.results[custom_id]
        if "*" in self.results:  # the adapter's answer for every row without its own (a failed batch)
            return self.results["*"]
        return BatchRowError(
            f"{self.provider} batch {self.batch_id} ended ({self.state}) with no result for row {custom_id}",
            True,
        )

    def fail(self, exc: BaseException) -> None:
        self.results = {"*": exc}  # rows re-attached later get the same answer
        for row in self.rows.values():
            if row is not None:
                row.resolve(exc)
