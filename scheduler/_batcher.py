"""The coalescing batcher of one device: concurrent turns for one model become ONE batched generate.

Requests queue per engine. One batch runs at a time on the device (the dispatcher is a single loop, which
is the device lock); when the device is free the dispatcher serves the engine with the most queued
requests, as soon as one of these holds:

- QUIESCENCE: every live job of the worker is blocked on a generation or on a provider batch (nothing else
  can add to the queue soon, so waiting longer cannot make the batch bigger);
- a queue holds a full batch (``max_batch_size``);
- ``max_wait`` seconds have passed since the oldest queued request arrived (for jobs awaiting something the
  scheduler cannot see, such as a file or an un-instrumented API call).

DETERMINISTIC mode batches the same way and hands the mode to ``generate_batch``: whether its rows may share
a forward pass is the engine's to know (a local engine co-steps them only where its batch-invariance
self-test passed, and runs them alone otherwise), so the batcher never decides what a row's tokens are.

How many rows a batch takes is also bounded by the engine's :class:`~._batch_budget.BatchBudget` (rows × the
longest row's prompt + max_new tokens, counted by the engine's optional ``request_tokens(payload)``): it
shrinks when a batch runs out of memory and grows back slowly, so later rounds stop paying for failed
prefills, and a size that failed is not tried again. A queue whose next request would exceed the budget
counts as holding a full batch.

A batch that runs out of memory is split in halves and retried, down to single requests; only a request
that fails alone gets the error. Before a retry the failed attempt's tensors are released (its traceback's
frames cleared) and the engine may return its allocator cache (``release_memory``). Any other exception from
``generate_batch`` fails every caller of that batch. An Exception instance returned in place of a result is
raised to its caller only.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from ._batch_budget import BatchBudget
from ._errors import BatchResultError
from ._protocols import BatchCancelled, Engine, ExecutionMode
from ._signals import Notifier
from ._threads import run_in_thread

__all__ = ["Batcher", "Waiter", "is_out_of_memory"]

#: cuBLAS and cuDNN report a failed allocation of their own (a handle, a workspace) as a CUDA error
#: ("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"): under memory pressure that is an
#: out-of-memory like any other, which a smaller batch cures, not a poisoned context.
_OOM_PHRASES = (
    "out of memory",
    "can't allocate memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
)

log = logging.getLogger("interlens.scheduler")


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (recognised by name, so torch is never imported here) or its kin."""
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in _OOM_PHRASES)


class Waiter(Protocol):
    """Whoever awaits a generation (a job's context): counts its undelivered requests."""

    outstanding: int


class _Request:
    __slots__ = ("done", "enqueued_at", "error", "in_flight", "owner", "payload", "result", "tokens")

    def __init__(self, owner: Waiter, payload: Any, now: float, tokens: int) -> None:
        self.owner = owner
        self.payload = payload
        self.tokens = tokens  # what this row costs in a batch (see ``_request_tokens``)
        self.enqueued_at = now
        self.done = anyio.Event()
        self.in_flight = False
        self.result: Any = None
        self.error: BaseException | None = None


class _Queue:
    __slots__ = ("budget", "engine", "requests")

    def __init__(self, engine: Engine, budget: BatchBudget) -> None:
        self.engine = engine
        self.budget = budget
        self.requests: deque[_Request] = deque()

    def fitting(self, most: int) -> int:
        """How many queued requests (oldest first, at most ``most``) the next batch takes under the budget."""
        n = longest = 0
        for req in self.requests:
            if n == most:
                break
            wider = max(longest, req.tokens)
            if n and not self.budget.allows((n + 1) * wider):
                break
            n, longest = n + 1, wider
        return n


class Batcher:
    """Queues and dispatches the generations of one device. Run :meth:`serve` in the worker's task group."""

    def __init__(
        self,
        *,
        mode: ExecutionMode,
        max_batch_size: int,
        max_wait: float,
        quiescent: Callable[[], bool],
        changed: Notifier,
        grow_after: int = 4,
    ) -> None:
        self._mode = mode
        self._grow_after = grow_after
        self._max = max_batch_size
        self._max_wait = max_wait
        self._quiescent = quiescent
        self._changed = changed  # shared with the worker: job starts/ends and blocking also wake us
        self._queues: dict[Hashable, _Queue] = {}
        self._queued = 0
        self._blocked = 0
        # Our own thread token, not one of anyio's shared 40: jobs that block threads of their own (a sync
        # analyzer waiting on a generation) must never be able to starve the batch they wait for.
        self._limiter = anyio.CapacityLimiter(1)

    @property
    def blocked(self) -> int:
        """How many waiters have a request queued or in flight whose result is not delivered yet.

        A waiter stops counting the moment its result is delivered, not when its task next runs: otherwise
        the jobs of the batch that just ended would still look blocked, and the next batch would leave
        before they could join it.
        """
        return self._blocked

    async def submit(self, key: Hashable, engine: Engine, payload: Any, *, owner: Waiter) -> Any:
        """Queue one request for ``engine`` and wait for its result (or its own error)."""
        queue = self._queues.get(key)
        if queue is None:
            budget = BatchBudget(grow_after=self._grow_after, limit=_first_budget(engine))
            queue = self._queues[key] = _Queue(engine, budget)
        req = _Request(owner, payload, anyio.current_time(), _request_tokens(engine, payload))
        queue.requests.append(req)
        self._queued += 1
        owner.outstanding += 1
        if owner.outstanding == 1:
            self._blocked += 1
        self._changed.notify()
        try:
            await req.done.wait()
        except BaseException:
            if not req.in_flight and not req.done.is_set():  # cancelled while queued: withdraw it
                queue.requests.remove(req)
                self._queued -= 1
                self._release(owner)
            raise
        if req.error is not None:
            raise req.error
        return req.result

    def block(self, owner: Waiter) -> None:
        """Count ``owner`` as blocked on something that takes a while and ends outside the batcher (a job
        waiting on a provider batch in the API gateway): it cannot add to the queue meanwhile, so quiescence
        must not wait for it. Paired with :meth:`unblock`; a job blocked here and on a generation counts once.
        """
        owner.outstanding += 1
        if owner.outstanding == 1:
            self._blocked += 1
        self._changed.notify()

    def unblock(self, owner: Waiter) -> None:
        """Undo one :meth:`block`: call it when the awaited result is delivered, not when the job resumes."""
        self._release(owner)

    def _release(self, owner: Waiter) -> None:
        owner.outstanding -= 1
        if owner.outstanding == 0:
            self._blocked -= 1
        self._changed.notify()

    async def serve(self) -> None:
        """Dispatch batches forever (until the worker's task group is cancelled)."""
        while True:
            queue, batch = await self._next_batch()
            results = await self._generate(queue, [r.payload for r in batch], [r.tokens for r in batch])
            for req, res in zip(batch, results, strict=True):
                if isinstance(res, Exception):
                    req.error = res
                else:
                    req.result = res
                req.done.set()
                self._release(req.owner)

    def _ready(self) -> bool:
        if self._quiescent():
            return True
        # full: as many rows as a batch takes, or the budget stops the batch before the queue's end
        for q in self._queues.values():
            n = q.fitting(self._max)
            if n == self._max or n < len(q.requests):
                return True
        return False

    async def _next_batch(self) -> tuple[_Queue, list[_Request]]:
        while True:
            event = self._changed.event()
            if self._queued == 0:
                await event.wait()
                continue
            oldest = min(q.requests[0].enqueued_at for q in self._queues.values() if q.requests)
            remaining = oldest + self._max_wait - anyio.current_time()
            if remaining <= 0 or self._ready():
                return self._take()
            with anyio.move_on_after(remaining):
                await event.wait()

    def _take(self) -> tuple[_Queue, list[_Request]]:
        queue = max(
            (q for q in self._queues.values() if q.requests),
            key=lambda q: (len(q.requests), -q.requests[0].enqueued_at),  # most queued, then oldest
        )
        batch = [queue.requests.popleft() for _ in range(queue.fitting(self._max))]
        for req in batch:
            req.in_flight = True
        self._queued -= len(batch)
        return queue, batch

    async def _generate(self, queue: _Queue, payloads: Sequence[Any], tokens: Sequence[int]) -> list[Any]:
        """One result (or Exception) per payload; halves an out-of-memory batch down to single rows.

        Every attempt tells the queue's budget how it went (its cost: rows × the widest row's tokens).

        The halves run AFTER the ``except`` block, with the failed attempt's frames cleared: a live
        traceback keeps every local of the failed ``generate_batch`` (its KV cache, its logits) reachable,
        and the retry would meet the same memory pressure. The engine's optional ``release_memory()`` then
        hands the freed blocks back to the device (see ``Engine``).
        """
        engine = queue.engine
        cost = len(payloads) * max(tokens)
        if len(payloads) > 1 and not queue.budget.allows(cost):  # e.g. the twin of a half that just failed
            mid = len(payloads) // 2
            first = await self._generate(queue, payloads[:mid], tokens[:mid])
            return first + await self._generate(queue, payloads[mid:], tokens[mid:])
        split = False
        try:
            results = await _generate_in_thread(engine, payloads, self._mode, self._limiter)
        except Exception as exc:
            if not is_out_of_memory(exc):
                return [exc] * len(payloads)
            _drop_frames(exc)
            queue.budget.failed(cost, rows=len(payloads))
            log.info(
                "%s: out of memory at %d rows (cost %d); batch limit now %s",
                type(engine).__name__,
                len(payloads),
                cost,
                queue.budget.limit,
            )
            if len(payloads) == 1:
                await _release_memory(engine, self._limiter)
                return [exc]
            split = True  # below, once ``exc`` and its traceback are gone
        if split:
            await _release_memory(engine, self._limiter)
            mid = len(payloads) // 2
            first = await self._generate(queue, payloads[:mid], tokens[:mid])
            return first + await self._generate(queue, payloads[mid:], tokens[mid:])
        queue.budget.succeeded(cost)
        if (
            not isinstance(results, Sequence)
            or isinstance(results, str | bytes)
            or len(results) != len(payloads)
        ):
            got = f"{len(results)} results" if isinstance(results, Sequence) else type(results).__name__
            err = BatchResultError(
                f"{type(engine).__name__}.generate_batch returned {got} for {len(payloads)} requests; it "
                "must return a list with one result (or Exception) per request, in order"
            )
            return [err] * len(payloads)
        return list(results)


def _request_tokens(engine: Engine, payload: Any) -> int:
    """What one row costs in a batch: the engine's ``request_tokens(payload)`` (prompt + max_new tokens), or
    1 (the budget then counts rows) when it has none or cannot tell (the batch itself will say what's wrong).
    """
    count = getattr(engine, "request_tokens", None)
    if not callable(count):
        return 1
    try:
        tokens = count(payload)
    except Exception:
        log.debug("%s.request_tokens failed", type(engine).__name__, exc_info=True)
        return 1
    return tokens if isinstance(tokens, int) and tokens >= 1 else 1


def _first_budget(engine: Engine) -> int | None:
    """The engine's own estimate of what fits (its optional ``token_budget()``: e.g. free CUDA memory)."""
    estimate = getattr(engine, "token_budget", None)
    if not callable(estimate):
        return None
    try:
        tokens = estimate()
    except Exception:
        log.warning("%s.token_budget() failed; no first estimate", type(engine).__name__, exc_info=True)
        return None
    return tokens if isinstance(tokens, int) and tokens >= 1 else None


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of every finished frame in ``exc``'s tracebacks (its causes and contexts too).

    The traceback text stays printable (code and line numbers are kept); what goes is what the frames held,
    above all the tensors of a batch that ran out of memory.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        stack += [err.__cause__, err.__context__]


async def _release_memory(engine: Engine, limiter: anyio.CapacityLimiter) -> None:
    """Call the engine's optional ``release_memory()`` (in the device's thread: it may wait on the device)."""
    release = getattr(engine, "release_memory", None)
    if callable(release):
        try:
            await run_in_thread(release, limiter=limiter)
        except Exception:  # best effort: the retry itself finds out whether memory is still short
            log.warning("%s.release_memory() failed", type(engine).__name__, exc_info=True)


async def _generate_in_thread(
    engine: Engine, payloads: Sequence[Any], mode: ExecutionMode, limiter: anyio.CapacityLimiter
) -> Any:
    """Run ``generate_batch`` in a thread; if we are cancelled meanwhile, set its ``cancelled`` event.

    The engine stops within a decode step and raises :class:`BatchCancelled`; the cancellation then
    surfaces here, so the device is never left to a batch still running behind our back.
    """
    cancelled = threading.Event()
    call = partial(engine.generate_batch, list(payloads), mode=mode, cancelled=cancelled)
    try:
        return await run_in_thread(call, limiter=limiter, cancelled=cancelled)
    except BatchCancelled:
        await anyio.lowlevel.checkpoint()  # if we were cancelled, the cancellation surfaces here
        raise  # otherwise the engine gave up on its own: an ordinary batch failure
