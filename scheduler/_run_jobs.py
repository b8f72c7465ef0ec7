"""``run_jobs``: pull jobs lazily from the lineups, place them on workers, record every outcome.

One pool serves every lineup: lineups are consumed in order, and the next lineup's jobs start as soon as
the previous one's stop filling the slots, so devices stay packed across lineups. A job is pulled only when
a slot is free, so memory stays O(concurrency) however long the data is. The parent is the only writer of
the ledger; a job's failure is recorded on that job and never cancels another.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from interlens.store import RecordedJobs

from ._checks import check_lineups, check_spec, needs_device
from ._config import RunConfig
from ._devices import check_ray_devices, validate_devices
from ._errors import DuplicateJobError, SchedulerConfigError
from ._eviction import EngineNeeds
from ._memory import MemoryRecorder
from ._outcome import AttemptOutcome, ErrorInfo, RunOutcome
from ._pool import open_workers, refuse_while_bootstrapping
from ._progress import Progress, progress_wanted
from ._protocols import JobSpec, LineupSpec
from ._resume import InputRefusal, input_changed, verify_recorded_inputs
from ._signals import Notifier
from ._worker import Worker
from .gateway import BatchStore, Blocker, Gateway, SpendLimitReached

__all__ = ["run_jobs"]

#: Jobs are added to the ledger this many at a time (one transaction), at most this many seconds of pulling
#: apart: a per-job insert would cap a run of trivial jobs at the ledger's transaction rate.
_ADD_CHUNK = 256
_ADD_CHUNK_S = 0.05


class Recorder(Protocol):
    """Where a run's state goes: the ledger (``out_dir`` set) or memory. Both implement this."""

    #: Exceptions from finish/fail that mean "this value cannot be stored" (not JSON, a leaked secret):
    #: they fail that job, not the run.
    value_errors: tuple[type[BaseException], ...]

    @property
    def batch_store(self) -> BatchStore | None:
        """Where the API gateway records provider batches (the ledger), or None (in memory)."""
        ...

    @property
    def ledger_path(self) -> Path | None: ...

    async def recorded(self) -> RecordedJobs:
        """What earlier runs recorded (read once, before anything is written): see ``_resume``."""
        ...

    async def begin(self) -> None:
        """Record the start of the run (after the recorded jobs' inputs were verified)."""
        ...

    async def add_many(self, specs: Sequence[JobSpec]) -> None: ...
    async def start(self, job_id: str, *, device: str) -> int: ...
    async def committed_turns(self, job_id: str) -> list[dict[str, Any]]: ...
    async def record_turn(self, job_id: str, index: int, turn: Mapping[str, Any]) -> None: ...
    async def finish(self, job_id: str, outcome: AttemptOutcome) -> None: ...
    async def fail(self, job_id: str, outcome: AttemptOutcome) -> None: ...
    async def retry(self, job_id: str) -> None: ...
    async def end(self, status: str) -> None: ...
    async def close(self) -> None: ...
    def outcome(self, *, counts: Mapping[str, int], skipped: list[str]) -> RunOutcome: ...


async def run_jobs(lineups: Sequence[LineupSpec], config: RunConfig) -> RunOutcome:
    """Run every job of ``lineups`` as ``config`` says (see :class:`RunConfig`) and return how each ended.

    Jobs with ``needs_device`` take one of ``max_batch_size`` slots on the least-loaded device worker and stay
    pinned to it; jobs without run in the host worker (in this process), at most ``max_concurrency`` at once.
    A rerun that would ask a recorded job something else, by its ``input_fp``, is refused before any job
    starts (see ``_resume``). Once the spend guard refuses a request no new job starts, a job whose request
    was refused goes back to pending (not failed), jobs in flight finish, and ``RunOutcome.stopped`` says why.
    Cancelling this coroutine stops within seconds and leaves the ledger consistent (the run is marked
    interrupted; running jobs are requeued by the next run).
    """
    check_lineups(lineups)
    if not isinstance(config, RunConfig):
        raise SchedulerConfigError(
            f"run_jobs takes a RunConfig, got {type(config).__name__}; e.g. run_jobs(lineups, "
            "RunConfig(devices=['cpu'], out_dir=None))"
        )
    config.check()
    if config.cluster is None and config.devices is None:
        raise SchedulerConfigError("devices must be a list of devices (None only with cluster='ray')")
    refuse_while_bootstrapping()
    if config.cluster is None:
        assert config.devices is not None
        devices: list[str] | None = validate_devices(config.devices)
    else:
        devices = check_ray_devices(config.devices)
    recorder = await _open_recorder(lineups, config)
    run = _Run(lineups, recorder=recorder, config=config, devices=devices)
    status = "failed"
    try:
        await run.execute()
        status = "completed" if run.stopped is None else "stopped"  # stopped: ended early, the rest pending
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
    outcome = recorder.outcome(counts=run.counts(), skipped=run.skipped)
    return replace(outcome, api=run.api_stats, stopped=run.stopped)


async def _open_recorder(lineups: Sequence[LineupSpec], config: RunConfig) -> Recorder:
    out_dir = config.out_dir
    if out_dir is None:
        return MemoryRecorder()
    # The store (aiosqlite) is imported only when a ledger is used.
    from ._ledger_recorder import LedgerRecorder

    return await LedgerRecorder.open(
        out_dir, lineups=lineups, resume=config.resume, versions=dict(config.versions)
    )


class _Run:
    def __init__(
        self,
        lineups: Sequence[LineupSpec],
        *,
        recorder: Recorder,
        config: RunConfig,
        devices: list[str] | None,
    ) -> None:
        self._lineups = lineups
        self._config = config
        self._spend = config.spend_guard
        self._poisoned: str | None = None  # why the run stopped: a device in this process is poisoned
        self._left_pending = 0  # jobs whose API request the spend guard refused, back to pending
        self._worker_init = tuple(config.worker_init)
        self._rec = recorder
        self._devices = devices  # checked: the run's own list (a Ray cluster's, when config.devices is None)
        total = None
        if all(lineup.n_jobs is not None for lineup in lineups):
            total = sum(lineup.n_jobs or 0 for lineup in lineups)
        self._progress = Progress(enabled=progress_wanted(config.progress), total=total)
        self._refill = Notifier()  # the buffer fell to its low-water mark
        self._refilled = Notifier()  # the pull loop added a chunk to the buffer (or found the end)
        self._buffer: deque[JobSpec] = deque()  # recorded as pending, not started yet
        # No more than the pools hold at once, so the specs held ahead of their start stay O(concurrency); as
        # many as that, so the runners of a full pool rarely find the buffer empty.
        self._chunk = min(_ADD_CHUNK, config.max_concurrency + len(devices or "1") * config.max_batch_size)
        self._exhausted = False
        self._pools: tuple[list[Worker], list[Worker]] = ([], [])  # (device workers, host workers)
        self._skipped: dict[str, None] = {}  # ordered set
        self._pulled = 0
        self._error: Exception | None = None
        self._tg: TaskGroup | None = None
        self._gateway: Gateway | None = None
        self._needs = EngineNeeds(lineups)
        self.api_stats: dict[str, Any] = {}
        self._total = total

    @property
    def skipped(self) -> list[str]:
        return list(self._skipped)

    def counts(self) -> dict[str, int]:
        p = self._progress
        counts = {"total": self._pulled, "done": p.done, "failed": p.failed, "skipped": p.skipped}
        if self.stopped is not None:  # jobs not finished: refused, never started, or never pulled
            total = max(self._total or 0, self._pulled)
            counts["pending"] = max(total - p.done - p.failed - p.skipped, self._left_pending)
        return counts

    @property
    def halted(self) -> bool:
        """The spend guard refused a request, or this process's device is poisoned: start no new job."""
        return self._poisoned is not None or (self._spend is not None and self._spend.halted)

    @property
    def stopped(self) -> str | None:
        if self._poisoned is not None:
            return self._poisoned
        return None if self._spend is None or not self._spend.halted else self._spend.refusal()

    def _poison(self, device: str, exc: BaseException) -> None:
        """A device worker in this process hit a CUDA error that leaves the process unusable: every later
        batch on it would fail, and nothing can replace this process. Stop starting jobs (those not started
        stay pending) and say how to go on."""
        if self._poisoned is None:
            self._poisoned = (
                f"device {device!r} hit a CUDA error that leaves this process unusable "
                f"({type(exc).__name__}: {exc}); the run stopped starting jobs, and the ones not started "
                "stay pending. Restart the Python process (in a notebook: the kernel) and rerun with the "
                "same out_dir to resume, or run with several devices, where each worker is a process that is "
                "replaced when this happens"
            )
            self._refill.notify()

    async def execute(self) -> None:
        try:
            recorded = await self._rec.recorded()
            # Before anything is written or started: no recorded job may now be asked something else.
            await verify_recorded_inputs(self._lineups, recorded, ledger_path=self._rec.ledger_path)
            await self._rec.begin()
            async with AsyncExitStack() as stack:
                # Entered first, so it closes last: workers' API calls in flight end before its clients do.
                gateway = Gateway(
                    store=self._rec.batch_store, quiescent=self._round_complete, spend=self._spend
                )
                self._gateway = await stack.enter_async_context(gateway)
                stack.callback(self._keep_api_stats, gateway)  # after the workers close, before it does
                # Before any job asks: a rerun re-attaches to the provider batches a crash left in flight.
                await gateway.load_open_batches()
                device_workers, host_workers = await open_workers(
                    stack,
                    devices=self._devices,
                    mode=self._config.mode,
                    max_batch_size=self._config.max_batch_size,
                    max_concurrency=self._config.max_concurrency,
                    max_batch_wait=self._config.max_batch_wait,
                    worker_init=self._worker_init,
                    start_timeout=self._config.worker_start_timeout,
                    call_gateway=self._call_gateway,
                    on_poisoned=self._poison,
                    cluster=self._config.cluster,
                )
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        await self._pull(tg, recorded, device_workers, host_workers)
                    except Exception as exc:
                        self._abort(exc)
            if self._error is not None:
                raise self._error
        finally:
            self._progress.close()

    def _keep_api_stats(self, gateway: Gateway) -> None:
        self.api_stats = gateway.stats()

    async def _call_gateway(self, job_id: str, spec: Any, request: Any, blocker: Blocker | None) -> Any:
        """Every worker's ``ctx.call_gateway`` ends here, in the parent, where the run's gateway lives."""
        assert self._gateway is not None
        return await self._gateway.call(spec, request, owner=job_id, blocker=blocker)

    def _round_complete(self) -> bool:
        """The gateway's quiescence probe: every live job waits on a batched API call, so no request can join
        a pending round any more and it flushes now instead of after ``idle_s``."""
        assert self._gateway is not None
        live = sum(w.load for pool in self._pools for w in pool)
        return self._gateway.batch_waiting >= live

    def _abort(self, exc: Exception) -> None:
        """A run-level failure (bad input mid-stream, the ledger failing): stop every job, raise ``exc``."""
        if self._error is None:
            self._error = exc
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def _pull(
        self, tg: TaskGroup, recorded: RecordedJobs, device_workers: list[Worker], host_workers: list[Worker]
    ) -> None:
        """Keep a small buffer of recorded-but-not-started jobs filled; start jobs while slots are free.

        Jobs are added to the recorder a chunk at a time, ahead of their start: one ledger transaction per
        chunk instead of one per job. The buffer never holds more than 1.5 chunks, a chunk being no bigger
        than the pools (``max_concurrency`` + devices x ``max_batch_size``): memory stays O(concurrency).
        Jobs added but not started are plain "pending" rows: a crash leaves them to the next run, exactly
        like jobs not pulled yet. Starting is mostly done by the runners themselves (see :meth:`_runner`):
        this loop wakes only to refill the buffer and to spawn runners for slots nobody is serving.
        """
        self._pools = (device_workers, host_workers)
        specs = self._specs(recorded)
        while True:
            refill = self._refill.event()
            if self.halted:  # the API budget is spent: what is not started stays for a rerun
                self._exhausted = True
                self._refilled.notify()
                return
            if len(self._buffer) <= self._chunk // 2:
                chunk = _take_chunk(specs, limit=self._chunk, seconds=_ADD_CHUNK_S)
                if not chunk:
                    self._exhausted = True
                    self._refilled.notify()
                    self._fill(tg)
                    return  # the runners start what is left in the buffer, then end
                await self._rec.add_many(chunk)
                self._buffer.extend(chunk)
                self._refilled.notify()
                self._fill(tg)
                continue
            self._fill(tg)
            await refill.wait()

    def _specs(self, recorded: RecordedJobs) -> Iterator[JobSpec]:
        """Every job to run, pulled lazily from the lineups in order; done ones are skipped (and counted).

        A recorded job that would now be asked something else stops the run before it starts: the pass
        before the run already refused that for lineups it could read twice, this catches one-shot iterators
        (and data that changed between the two reads).
        """
        done_ids = recorded.done
        for lineup in self._lineups:
            for spec in lineup.jobs:  # pulled lazily, one at a time
                check_spec(spec, lineup)
                self._pulled += 1
                if input_changed(recorded, spec):
                    refusal = InputRefusal(self._rec.ledger_path)
                    refusal.add(lineup, spec, recorded.inputs[spec.job_id])
                    raise refusal.error(pulled_from=lineup)
                if spec.job_id in done_ids:
                    if spec.job_id in self._skipped:
                        raise DuplicateJobError(
                            f"job id {spec.job_id!r} occurs twice in this run; job ids must be unique across "
                            "all lineups of a run"
                        )
                    self._skipped[spec.job_id] = None
                    self._progress.job_skipped()
                    continue
                needs_device(spec)  # a malformed job is refused when pulled, before it is recorded
                self._needs.pulled(lineup.name)
                yield spec
            self._evict(self._needs.exhausted(lineup.name))

    def _evict(self, keys: frozenset[Hashable]) -> None:
        """Drop engines no remaining job of the run needs from every device worker (``_eviction``)."""
        if keys and self._tg is not None:
            for worker in self._pools[0]:
                self._tg.start_soon(worker.evict, keys, name="interlens engine eviction")

    def _claim(self) -> tuple[JobSpec, Worker] | None:
        """The next buffered job and a slot for it on the least-loaded worker of its pool, if one is free.

        Jobs start in order: when the next one's pool is full, nothing starts (a later job of the other pool
        does not overtake it), exactly as if one loop pulled and placed them.
        """
        if not self._buffer or self._error is not None or self.halted:
            return None
        spec = self._buffer[0]
        pool = self._pools[0] if needs_device(spec) else self._pools[1]
        best: Worker | None = None
        for w in pool:
            if w.load < w.capacity and (best is None or w.load < best.load):
                best = w
        if best is None:
            return None
        self._buffer.popleft()
        if len(self._buffer) <= self._chunk // 2 and not self._exhausted:
            self._refill.notify()
        best.admit()
        return spec, best

    def _fill(self, tg: TaskGroup) -> None:
        """Spawn a runner for every job that can start now."""
        while (claimed := self._claim()) is not None:
            tg.start_soon(self._runner, *claimed, name="interlens job runner")

    async def _runner(self, spec: JobSpec, worker: Worker) -> None:
        """Run a job, then the next one that can start, until none can.

        A finished job hands its runner straight to the next job: no task spawn and no wake-up of the pull
        loop per job, which is most of the scheduler's own cost in a run of short jobs.
        """
        while True:
            await self._job(spec, worker)
            claimed = self._claim()
            while claimed is None and not self._buffer and not self._exhausted and self._error is None:
                # The buffer ran dry while the next chunk is being recorded: waiting for it is cheaper
                # than ending this runner and spawning another one a moment later.
                await self._refilled.wait()
                claimed = self._claim()
            if claimed is None:
                return
            spec, worker = claimed
            if self._tg is not None:
                self._fill(self._tg)  # the freed slot may serve a job of the other pool too

    async def _job(self, spec: JobSpec, worker: Worker) -> None:
        try:
            await self._drive(spec, worker)
        except Exception as exc:  # the recorder failed: the run cannot go on truthfully
            self._abort(exc)
        finally:
            worker.leave()
            unneeded = self._needs.ended(spec.lineup)
            if self._gateway is not None:
                self._gateway.poke()  # one job fewer to wait for: a pending round may be complete now
            if self.halted:
                self._refill.notify()  # the pull loop ends
        if unneeded:  # before this runner starts its next job, which may load the next model
            for device_worker in self._pools[0]:
                await device_worker.evict(unneeded)

    async def _drive(self, spec: JobSpec, worker: Worker) -> None:
        rec, job_id = self._rec, spec.job_id

        async def record_turn(index: int, turn: Mapping[str, Any]) -> None:
            await rec.record_turn(job_id, index, turn)

        failures = deaths = 0
        while True:
            attempt = await rec.start(job_id, device=worker.device)
            committed = await rec.committed_turns(job_id)
            outcome = await worker.run_attempt(
                spec,
                attempt=attempt,
                committed_turns=committed,
                record_turn=record_turn,
                exclusive=deaths > 0,  # alone after a worker death: who killed it becomes plain
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
            if outcome.worker_lost:
                # Every job the worker was running lost it, so a death alone blames no one; the retry runs
                # alone on a fresh worker. A job that still loses it then, each time, is the one killing it.
                deaths += 1
                if deaths < self._config.max_attempts:
                    await rec.retry(job_id)
                    continue
                await self._fail(job_id, _killer(outcome, deaths))
                return
            if (
                self.halted
                and outcome.error is not None
                and outcome.error.type == SpendLimitReached.__qualname__
            ):
                await rec.retry(job_id)  # not failed: it continues when a rerun has budget left
                self._left_pending += 1
                return
            failures += 1
            if outcome.transient and outcome.conversation is None and failures < self._config.max_attempts:
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


def _killer(outcome: AttemptOutcome, deaths: int) -> AttemptOutcome:
    assert outcome.error is not None
    message = (
        f"{outcome.error.message}. Its worker died on each of its {deaths} attempts, the last "
        f"{deaths - 1} with this job alone on a fresh worker, so this job is what kills it (out of memory, a "
        "crash in native code, os._exit): it is failed, the other jobs carry on"
    )
    return replace(outcome, error=ErrorInfo(outcome.error.type, message, outcome.error.traceback))


def _take_chunk(specs: Iterator[JobSpec], *, limit: int, seconds: float) -> list[JobSpec]:
    """Up to ``limit`` specs, but stop after ``seconds`` so a slow data stream does not hold back its jobs."""
    chunk: list[JobSpec] = []
    deadline = time.monotonic() + seconds
    for spec in specs:
        chunk.append(spec)
        if len(chunk) >= limit or time.monotonic() >= deadline:
            break
    return chunk
