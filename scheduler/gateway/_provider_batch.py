"""Provider batch APIs, the shared parts: rows in flight, their batches, and retrying a batch control call.

A provider batch is paid for when it is submitted, so everything here is built around never losing track of
one: a submitted batch is recorded in a :class:`BatchStore` (the run's ledger) before it is polled, and a row
that fails becomes a :class:`BatchRowError` for its own caller only. The round logic (collecting, flushing,
polling, re-attaching) lives in ``_collect``; the policy, the limits and what adapters return are the
contract's (``_contract``, ``_policies``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from interlens.store import redacting_logger

from ._contract import BatchClient, BatchRowError
from ._policies import Failure, RetryPolicy

__all__ = ["Batch", "Row", "classify", "describe_error", "retrying"]

log = redacting_logger("interlens.gateway")  # a key echoed in an error is redacted


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
