"""Workers: the places where jobs run, next to the engines they use.

:class:`Worker` is the placement seam. An :class:`InProcessWorker` runs jobs in this event loop; a
``SubprocessWorker`` (``workers._subprocess``) implements the same interface over a pipe to a spawned
process, which runs an :class:`InProcessWorker` of its own: it receives a picklable :class:`JobSpec` plus
the committed turns, sends each ``record_turn`` back through ``record_turn`` (so the parent stays the only
ledger writer) and returns a plain-data :class:`AttemptOutcome`. Placement accounting (``capacity``,
``load``, ``admit``, ``leave``) lives on the parent side of that seam, written once in
:class:`~._slots.Slots`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import anyio
from anyio.abc import TaskGroup

from ._batcher import Batcher, is_out_of_memory
from ._engine_loads import EngineCache
from ._errors import NoDeviceError, SchedulerError
from ._outcome import AttemptOutcome, ErrorInfo
from ._protocols import EngineSpec, ExecutionMode, JobResult, JobSpec
from ._signals import Notifier
from ._slots import Slots

if TYPE_CHECKING:
    from .gateway import Blocker

__all__ = ["HOST_DEVICE", "CallGateway", "InProcessWorker", "RecordTurn", "Worker", "is_fatal_device_error"]

log = logging.getLogger("interlens.scheduler")

#: The ``device`` of jobs that need no local model (scripted or API-only): they run in the host worker.
HOST_DEVICE = "host"

RecordTurn = Callable[[int, Mapping[str, Any]], Awaitable[None]]
#: How a job reaches the run's API gateway: ``(job_id, spec, request, blocker) -> result`` (see
#: ``JobContext``); ``blocker`` (or None) is told while the request waits on a provider batch.
CallGateway = Callable[[str, Any, Any, "Blocker | None"], Awaitable[Any]]


class Worker(Protocol):
    """Where jobs run. In-process now; a spawned process over a pipe later, with the same interface."""

    @property
    def device(self) -> str: ...

    @property
    def capacity(self) -> int:
        """How many jobs may be live on this worker at once."""
        ...

    @property
    def load(self) -> int:
        """How many jobs are live on this worker now (admitted and not yet left)."""
        ...

    def admit(self) -> None: ...

    def leave(self) -> None: ...

    async def started(self) -> None:
        """Return once the worker can take jobs; raise ``WorkerStartError`` if it cannot start."""
        ...

    async def run_attempt(
        self,
        spec: JobSpec,
        *,
        attempt: int,
        committed_turns: Sequence[Mapping[str, Any]],
        record_turn: RecordTurn,
        exclusive: bool = False,
    ) -> AttemptOutcome:
        """Run one attempt of ``spec.job``; never raises for a failure of the job itself.

        ``exclusive``: run it alone on the worker (a job whose worker died under it is retried alone, so a
        job that kills its worker is told apart from the jobs that merely shared the worker with it).
        """
        ...

    async def evict(self, keys: frozenset[Hashable]) -> None:
        """Drop the engines of ``keys`` if loaded here: no job left in the run needs them."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None: ...


class InProcessWorker(Slots):
    """Runs its jobs' coroutines in this event loop and hosts the engines of one device.

    ``device=None`` makes the host worker for jobs with ``needs_device=False``: it has no engines, and such a
    job calling ``ctx.generate`` gets :class:`NoDeviceError`.
    """

    def __init__(
        self,
        device: str | None,
        *,
        capacity: int,
        mode: ExecutionMode,
        max_batch_size: int,
        max_batch_wait: float,
        call_gateway: CallGateway | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._device = device
        self._call_gateway = call_gateway
        self._on_fatal = on_fatal
        self._fatal: BaseException | None = None
        super().__init__(capacity)
        self._mode = mode
        self._max_batch_size = max_batch_size
        self._max_batch_wait = max_batch_wait
        self._changed = Notifier()
        self._tg: TaskGroup | None = None
        self._engines: EngineCache | None = None
        self._batcher: Batcher | None = None

    @property
    def device(self) -> str:
        return HOST_DEVICE if self._device is None else self._device

    def _load_changed(self) -> None:
        self._changed.notify()

    async def started(self) -> None:
        pass  # nothing to wait for: this event loop is the worker

    async def __aenter__(self) -> Self:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self._device is not None:
            self._engines = EngineCache(self._device, task_group=self._tg)
            self._batcher = Batcher(
                mode=self._mode,
                max_batch_size=self._max_batch_size,
                max_wait=self._max_batch_wait,
                quiescent=self._quiescent,
                changed=self._changed,
            )
            self._tg.start_soon(self._batcher.serve)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()  # the dispatcher and engine loads are only ever stopped, never awaited
        return await self._tg.__aexit__(exc_type, exc, tb)

    async def run_attempt(
        self,
        spec: JobSpec,
        *,
        attempt: int,
        committed_turns: Sequence[Mapping[str, Any]],
        record_turn: RecordTurn,
        exclusive: bool = False,  # no worker process to lose here: nothing to isolate from
    ) -> AttemptOutcome:
        ctx = _Context(self, spec, attempt=attempt, committed_turns=committed_turns, record_turn=record_turn)
        job = spec.job
        try:
            result = await job.run(ctx)
            if not isinstance(result, JobResult):
                raise TypeError(
                    f"{type(job).__name__}.run returned {type(result).__name__}; it must return a JobResult"
                )
            tokens = result.tokens_generated
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
                raise TypeError(f"JobResult.tokens_generated must be an int >= 0, got {tokens!r}")
        except Exception as exc:  # the job's own failure; cancellation (a BaseException) propagates
            self._check_fatal(exc)
            return AttemptOutcome(error=ErrorInfo.from_exception(exc), transient=_is_transient(job, exc))
        error = None
        if result.analysis_error is not None:  # an analyzer's CUDA error poisons the process as much
            self._check_fatal(result.analysis_error)
            error = ErrorInfo.from_exception(result.analysis_error)
        return AttemptOutcome(
            conversation=result.conversation,
            analysis=result.analysis,
            tokens_generated=tokens,
            error=error,
        )

    async def evict(self, keys: frozenset[Hashable]) -> None:
        if self._engines is not None:
            await self._engines.evict(keys)

    def _quiescent(self) -> bool:
        """Every live job is blocked on a generation or an API call: nothing else can join the queue soon, so
        dispatch now (a mixed local + API debate forms full local batches without the fallback delay)."""
        assert self._batcher is not None
        return self._batcher.blocked >= self.load

    async def generate(self, ctx: _Context, engine: EngineSpec, request: Any) -> Any:
        if self._engines is None or self._batcher is None:
            raise NoDeviceError(
                f"job {ctx.job_id!r} declared needs_device=False but called ctx.generate; a job with a local "
                "model participant must set needs_device=True so it is placed on a device worker"
            )
        key, loaded = await self._engines.get(engine)
        try:
            return await self._batcher.submit(key, loaded, request, owner=ctx)
        except Exception as exc:  # seen here, before the job's code could wrap or swallow it
            self._check_fatal(exc)
            raise

    def _check_fatal(self, exc: BaseException) -> None:
        """A CUDA error other than out-of-memory corrupts the process's CUDA context: every later batch on
        the device would fail. A worker process exits (``on_fatal``) and is replaced; in the run's own process
        ``on_fatal`` stops the run (no new job starts) and says how to recover."""
        if self._device is None or not is_fatal_device_error(exc):  # the host worker holds no device
            return
        first = self._fatal is None
        if first:
            self._fatal = exc
        if self._on_fatal is not None:
            self._on_fatal(exc)
        elif first:
            log.error(
                "device %r hit a CUDA error that leaves this process unusable (%s: %s): later jobs on it "
                "will fail. Stop the run and start it again (it resumes from the ledger), or run with "
                "several devices, where each worker is a process that is replaced when this happens",
                self.device,
                type(exc).__name__,
                exc,
            )

    async def call_gateway(self, ctx: _Context, spec: Any, request: Any) -> Any:
        if self._call_gateway is None:
            raise SchedulerError(
                f"job {ctx.job_id!r} called ctx.call_gateway(...) but this worker has no API gateway; "
                "workers built by run_jobs always have one (pass call_gateway= when building one yourself)"
            )
        blocker = None
        if self._batcher is not None and getattr(spec, "batch_key", None) is not None:
            # A provider batch takes minutes: the local batch must not wait for this job. A single request
            # is back in a moment and its job may join the local batch then, so it does not count.
            blocker = _BatcherBlocker(self._batcher, ctx)
        return await self._call_gateway(ctx.job_id, spec, request, blocker)


class _Context:
    """The in-process :class:`JobContext`."""

    def __init__(
        self,
        worker: InProcessWorker,
        spec: JobSpec,
        *,
        attempt: int,
        committed_turns: Sequence[Mapping[str, Any]],
        record_turn: RecordTurn,
    ) -> None:
        self._worker = worker
        self._record_turn = record_turn
        self.outstanding = 0  # undelivered generations and API calls (the batcher's quiescence count)
        self.job_id = spec.job_id
        self.seed = spec.seed
        self.device = worker.device
        self.mode = worker._mode
        self.attempt = attempt
        self.committed_turns: Sequence[Mapping[str, Any]] = tuple(committed_turns)

    def __repr__(self) -> str:
        return f"JobContext(job_id={self.job_id!r}, device={self.device!r}, attempt={self.attempt})"

    async def generate(self, engine: EngineSpec, request: Any) -> Any:
        return await self._worker.generate(self, engine, request)

    async def call_gateway(self, spec: Any, request: Any) -> Any:
        return await self._worker.call_gateway(self, spec, request)

    async def record_turn(self, index: int, turn: Mapping[str, Any]) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"record_turn index must be an int >= 0, got {index!r}")
        if not isinstance(turn, Mapping):
            raise TypeError(f"record_turn takes the turn as a JSON mapping, got {type(turn).__name__}")
        await self._record_turn(index, turn)


class _BatcherBlocker:
    """The device batcher's side of a job's provider-batch wait (a ``Blocker`` for the gateway)."""

    __slots__ = ("_batcher", "_ctx")

    def __init__(self, batcher: Batcher, ctx: _Context) -> None:
        self._batcher = batcher
        self._ctx = ctx

    def block(self) -> None:
        self._batcher.block(self._ctx)

    def unblock(self) -> None:
        self._batcher.unblock(self._ctx)


_FATAL_PHRASES = (
    "cuda error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "cublas_status",
    "cudnn_status",
)


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a CUDA error that poisons the process: a device-side assert,
    an illegal memory access, a failed kernel launch. Out-of-memory is not: the batcher splits the batch."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if not is_out_of_memory(current):
            text = str(current).lower()
            if type(current).__name__ == "AcceleratorError" or any(p in text for p in _FATAL_PHRASES):
                return True
        current = current.__cause__ or current.__context__
    return False


def _is_transient(job: Any, exc: BaseException) -> bool:
    try:
        return bool(job.is_transient(exc))
    except Exception:  # a broken classifier must not turn one failure into two: do not retry
        return False
