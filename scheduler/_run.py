"""``run_jobs``: pull jobs lazily from the lineups, place them on workers, record every outcome.

One pool serves every lineup: lineups are consumed in order, and the next lineup's jobs start as soon as
the previous one's stop filling the slots, so devices stay packed across lineups. A job is pulled only when
a slot is free, so memory stays O(concurrency) however long the data is. The parent is the only writer of
the ledger; a job's failure is recorded on that job and never cancels another.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from ._devices import validate_devices
from ._errors import DuplicateJobError, SchedulerConfigError
from ._memory import MemoryRecorder
from ._outcome import AttemptOutcome, ErrorInfo, RunOutcome
from ._progress import Progress, progress_wanted
from ._protocols import ExecutionMode, JobSpec, LineupSpec
from ._signals import Notifier
from ._worker import InProcessWorker, Worker

__all__ = ["run_jobs"]


class Recorder(Protocol):
    """Where a run's state goes: the ledger (``out_dir`` set) or memory. Both implement this."""

    #: Exceptions from finish/fail that mean "this value cannot be stored" (not JSON, a leaked secret):
    #: they fail that job, not the run.
    value_errors: tuple[type[BaseException], ...]

    async def begin(self) -> set[str]: ...
    async def add(self, spec: JobSpec) -> None: ...
    async def start(self, job_id: str, *, device: str) -> int: ...
    async def committed_turns(self, job_id: str) -> list[dict[str, Any]]: ...
    async def record_turn(self, job_id: str, index: int, turn: Mapping[str, Any]) -> None: ...
    async def finish(self, job_id: str, outcome: AttemptOutcome) -> None: ...
    async def fail(self, job_id: str, outcome: AttemptOutcome) -> None: ...
    async def retry(self, job_id: str) -> None: ...
    async def end(self, status: str) -> None: ...
    async def close(self) -> None: ...
    def outcome(self, *, counts: Mapping[str, int], skipped: list[str]) -> RunOutcome: ...


async def run_jobs(
    lineups: Sequence[LineupSpec],
    *,
    devices: Sequence[str],
    out_dir: str | os.PathLike[str] | None,
    resume: bool = True,
    mode: ExecutionMode = ExecutionMode.BATCHED,
    max_batch_size: int = 64,
    max_concurrency: int = 256,
    max_attempts: int = 3,
    progress: bool | None = None,
    versions: Mapping[str, str] | None = None,
    max_batch_wait: float = 0.05,
) -> RunOutcome:
    """Run every job of ``lineups`` and return how each ended.

    ``devices``: one in-process worker per entry (a repeated entry means two workers sharing a device);
    jobs with ``needs_device`` take one of ``max_batch_size`` slots on the least-loaded device worker, jobs
    without run in the host worker, at most ``max_concurrency`` at once. ``out_dir``: the ledger directory
    (resumable: done jobs are skipped on a rerun unless ``resume=False``); None keeps everything in memory.
    ``max_attempts``: attempts per job in this run when ``job.is_transient`` says a failure may pass.
    ``max_batch_wait``: seconds a queued generation waits for more company when some live job is busy with
    something the scheduler cannot see. Cancelling this coroutine stops within seconds and leaves the
    ledger consistent (the run is marked interrupted; running jobs are requeued by the next run).
    """
    _check_arguments(
        lineups,
        mode=mode,
        max_batch_size=max_batch_size,
        max_concurrency=max_concurrency,
        max_attempts=max_attempts,
        max_batch_wait=max_batch_wait,
        versions=versions,
        out_dir=out_dir,
    )
    devices = validate_devices(devices)
    recorder = await _open_recorder(lineups, out_dir=out_dir, resume=resume, versions=versions or {})
    run = _Run(
        lineups,
        recorder=recorder,
        devices=devices,
        mode=mode,
        max_batch_size=max_batch_size,
        max_concurrency=max_concurrency,
        max_attempts=max_attempts,
        max_batch_wait=max_batch_wait,
        progress=progress_wanted(progress),
    )
    status = "failed"
    try:
        await run.execute()
        status = "completed"
    except (anyio.get_cancelled_exc_class(), KeyboardInterrupt):
        status = "interrupted"
        raise
    except BaseExceptionGroup as group:  # a crashed worker task: surface the one real error
        errors = group.exceptions
        if len(errors) == 1 and isinstance(errors[0], Exception):
            raise errors[0] from None
        raise
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(60):
            try:
                await recorder.end(status)
            finally:
                await recorder.close()
    return recorder.outcome(counts=run.counts(), skipped=run.skipped)


def _check_arguments(
    lineups: Sequence[LineupSpec],
    *,
    mode: ExecutionMode,
    max_batch_size: int,
    max_concurrency: int,
    max_attempts: int,
    max_batch_wait: float,
    versions: Mapping[str, str] | None,
    out_dir: object,
) -> None:
    """Refuse bad input before anything is opened or run, naming the problem and the fix."""
    if isinstance(lineups, LineupSpec):
        raise SchedulerConfigError("run_jobs takes a list of LineupSpec; wrap the single lineup: [lineup]")
    if not isinstance(lineups, Sequence) or isinstance(lineups, str):
        raise SchedulerConfigError(f"lineups must be a list of LineupSpec, got {type(lineups).__name__}")
    seen: set[str] = set()
    for lineup in lineups:
        if not isinstance(lineup, LineupSpec):
            raise SchedulerConfigError(f"every lineup must be a LineupSpec, got {type(lineup).__name__}")
        if not isinstance(lineup.name, str) or not lineup.name:
            raise SchedulerConfigError(f"a lineup name must be a non-empty str, got {lineup.name!r}")
        if lineup.name in seen:
            raise DuplicateJobError(
                f"two lineups are named {lineup.name!r}; their job ids would collide. Give each lineup of a "
                "run its own name"
            )
        seen.add(lineup.name)
        if not isinstance(lineup.fingerprint, str):
            raise SchedulerConfigError(f"lineup {lineup.name!r}: fingerprint must be a str")
    if not isinstance(mode, ExecutionMode):
        raise SchedulerConfigError(f"mode must be an ExecutionMode, got {mode!r}")
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("max_concurrency", max_concurrency),
        ("max_attempts", max_attempts),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SchedulerConfigError(f"{name} must be an int >= 1, got {value!r}")
    if not isinstance(max_batch_wait, int | float) or isinstance(max_batch_wait, bool) or max_batch_wait < 0:
        raise SchedulerConfigError(f"max_batch_wait must be a number of seconds >= 0, got {max_batch_wait!r}")
    if versions is not None and not (
        isinstance(versions, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items())
    ):
        raise SchedulerConfigError(f"versions must map str to str (package → version), got {versions!r}")
    if out_dir is not None and not isinstance(out_dir, str | os.PathLike):
        raise SchedulerConfigError(f"out_dir must be a path (str or os.PathLike) or None, got {out_dir!r}")


async def _open_recorder(
    lineups: Sequence[LineupSpec],
    *,
    out_dir: str | os.PathLike[str] | None,
    resume: bool,
    versions: Mapping[str, str],
) -> Recorder:
    if out_dir is None:
        return MemoryRecorder()
    # The store (aiosqlite) is imported only when a ledger is used.
    from ._ledger_recorder import LedgerRecorder

    return await LedgerRecorder.open(out_dir, lineups=lineups, resume=resume, versions=versions)


class _Run:
    def __init__(
        self,
        lineups: Sequence[LineupSpec],
        *,
        recorder: Recorder,
        devices: list[str],
        mode: ExecutionMode,
        max_batch_size: int,
        max_concurrency: int,
        max_attempts: int,
        max_batch_wait: float,
        progress: bool,
    ) -> None:
        self._lineups = lineups
        self._rec = recorder
        self._devices = devices
        self._mode = mode
        self._max_batch_size = max_batch_size
        self._max_concurrency = max_concurrency
        self._max_attempts = max_attempts
        self._max_batch_wait = max_batch_wait
        total = None
        if all(lineup.n_jobs is not None for lineup in lineups):
            total = sum(lineup.n_jobs or 0 for lineup in lineups)
        self._progress = Progress(enabled=progress, total=total)
        self._slots = Notifier()
        self._skipped: dict[str, None] = {}  # ordered set
        self._pulled = 0
        self._error: Exception | None = None
        self._tg: TaskGroup | None = None

    @property
    def skipped(self) -> list[str]:
        return list(self._skipped)

    def counts(self) -> dict[str, int]:
        p = self._progress
        return {"total": self._pulled, "done": p.done, "failed": p.failed, "skipped": p.skipped}

    async def execute(self) -> None:
        try:
            done_ids = await self._rec.begin()
            async with AsyncExitStack() as stack:
                device_workers: list[Worker] = []
                for device in self._devices:
                    worker = InProcessWorker(
                        device,
                        capacity=self._max_batch_size,
                        mode=self._mode,
                        max_batch_size=self._max_batch_size,
                        max_batch_wait=self._max_batch_wait,
                    )
                    device_workers.append(await stack.enter_async_context(worker))
                host = InProcessWorker(
                    None,
                    capacity=self._max_concurrency,
                    mode=self._mode,
                    max_batch_size=self._max_batch_size,
                    max_batch_wait=self._max_batch_wait,
                )
                host_workers: list[Worker] = [await stack.enter_async_context(host)]
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        await self._pull(tg, done_ids, device_workers, host_workers)
                    except Exception as exc:
                        self._abort(exc)
            if self._error is not None:
                raise self._error
        finally:
            self._progress.close()

    def _abort(self, exc: Exception) -> None:
        """A run-level failure (bad input mid-stream, the ledger failing): stop every job, raise ``exc``."""
        if self._error is None:
            self._error = exc
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def _pull(
        self, tg: TaskGroup, done_ids: set[str], device_workers: list[Worker], host_workers: list[Worker]
    ) -> None:
        for lineup in self._lineups:
            for spec in lineup.jobs:  # pulled lazily, one at a time
                _check_spec(spec, lineup)
                self._pulled += 1
                if spec.job_id in done_ids:
                    if spec.job_id in self._skipped:
                        raise DuplicateJobError(
                            f"job id {spec.job_id!r} occurs twice in this run; job ids must be unique across "
                            "all lineups of a run"
                        )
                    self._skipped[spec.job_id] = None
                    self._progress.job_skipped()
                    continue
                worker = await self._free_worker(device_workers if _needs_device(spec) else host_workers)
                worker.admit()
                try:
                    await self._rec.add(spec)
                except BaseException:
                    worker.leave()
                    raise
                tg.start_soon(self._job, spec, worker, name=f"interlens job {spec.job_id}")

    async def _free_worker(self, pool: list[Worker]) -> Worker:
        """The least-loaded worker of ``pool`` with a free slot, waiting for one if all are full."""
        while True:
            changed = self._slots.event()
            free = [w for w in pool if w.load < w.capacity]
            if free:
                return min(free, key=lambda w: w.load)
            await changed.wait()

    async def _job(self, spec: JobSpec, worker: Worker) -> None:
        try:
            await self._drive(spec, worker)
        except Exception as exc:  # the recorder failed: the run cannot go on truthfully
            self._abort(exc)
        finally:
            worker.leave()
            self._slots.notify()

    async def _drive(self, spec: JobSpec, worker: Worker) -> None:
        rec, job_id = self._rec, spec.job_id

        async def record_turn(index: int, turn: Mapping[str, Any]) -> None:
            await rec.record_turn(job_id, index, turn)

        tries = 0
        while True:
            tries += 1
            attempt = await rec.start(job_id, device=worker.device)
            committed = await rec.committed_turns(job_id)
            outcome = await worker.run_attempt(
                spec, attempt=attempt, committed_turns=committed, record_turn=record_turn
            )
            if outcome.ok:
                try:
                    await rec.finish(job_id, outcome)
                except rec.value_errors as exc:  # e.g. not JSON: the job fails, the run goes on
                    await self._fail(
                        job_id,
                        AttemptOutcome(
                            error=ErrorInfo.from_exception(exc), tokens_generated=outcome.tokens_generated
                        ),
                    )
                    return
                self._progress.job_done(tokens=outcome.tokens_generated)
                return
            if outcome.transient and outcome.conversation is None and tries < self._max_attempts:
                await rec.retry(job_id)
                continue
            await self._fail(job_id, outcome)
            return

    async def _fail(self, job_id: str, outcome: AttemptOutcome) -> None:
        try:
            await self._rec.fail(job_id, outcome)
        except self._rec.value_errors as exc:
            if outcome.conversation is None:
                raise
            # The kept conversation itself cannot be stored: record the failure without it, saying why.
            assert outcome.error is not None
            message = f"{outcome.error.message} (the conversation could not be kept: {exc})"
            await self._rec.fail(
                job_id,
                AttemptOutcome(
                    error=ErrorInfo(outcome.error.type, message, outcome.error.traceback),
                    tokens_generated=outcome.tokens_generated,
                ),
            )
        self._progress.job_failed(tokens=outcome.tokens_generated)


def _check_spec(spec: object, lineup: LineupSpec) -> None:
    if not isinstance(spec, JobSpec):
        raise SchedulerConfigError(
            f"lineup {lineup.name!r} yielded {type(spec).__name__}; its jobs must be JobSpec instances"
        )
    if not isinstance(spec.job_id, str) or not spec.job_id:
        raise SchedulerConfigError(
            f"lineup {lineup.name!r} yielded a job with id {spec.job_id!r}; ids are non-empty str"
        )
    if spec.lineup != lineup.name:
        raise SchedulerConfigError(
            f"job {spec.job_id!r} says it belongs to lineup {spec.lineup!r} but came from lineup "
            f"{lineup.name!r}; set JobSpec.lineup to the name of the lineup that yields it"
        )


def _needs_device(spec: JobSpec) -> bool:
    try:
        return bool(spec.job.needs_device)
    except AttributeError:
        raise SchedulerConfigError(
            f"job {spec.job_id!r}: {type(spec.job).__name__} has no needs_device attribute (the Job "
            "protocol); set it to True when the job uses a local model"
        ) from None
