"""The recorder of a run with ``out_dir``: every state change goes to the SQLite ledger (``interlens.store``).

The parent process is the ledger's only writer; workers route ``record_turn`` back here. Nothing about a
finished job stays in memory: the :class:`RunOutcome` reads from the ledger (paged), so a million-job run
does not hold a million conversations. The only per-run memory is the resume scan (every recorded job's id
and input fingerprint, the done ones and the ones an earlier run left unfinished) and the ids of live jobs.

Cost per job, and what the SIGKILL promise needs (a run of short jobs is bound by ledger round trips):

- ``add``: jobs are inserted a chunk per transaction, ahead of their start (see ``_run_jobs``). A crash leaves
  the inserted-but-not-started ones pending, which is what a rerun would do with them anyway.
- ``committed_turns``: read only for a job that may have some: one an earlier run left unfinished (the set
  is read once at the start) or one that recorded a turn in this run (a retry). Any other job was inserted
  fresh by this run, so it has none, and the read is skipped.
- ``start``, ``record_turn``, ``finish`` stay one awaited write each. Concurrent jobs share transactions
  (group commit), so what a job costs is the operation, not a transaction. ``record_turn`` stays durable
  before the job goes on, as the ``JobContext`` contract says: resume only needs the committed turns to be
  a prefix (group commit keeps submission order, so a write-behind turn would still be one), but a turn
  that is paid for (an API call) or seen by the user's code must not be lost to a crash after it was
  acknowledged. Not awaiting ``start`` saves no operation (it would still be one write per job), so it is
  awaited too: the attempt number it returns is then the ledger's, across runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from interlens.store import JobRecord, Ledger, LedgerFullError, LedgerReader, RecordedJobs, StoreError

from ._errors import DuplicateJobError
from ._outcome import AttemptOutcome, ErrorInfo, JobOutcome, JobState, RunOutcome
from ._protocols import JobSpec, LineupSpec
from ._resume import START_OVER

__all__ = ["LedgerRecorder"]


class LedgerRecorder:
    """Writes a run's state through :class:`interlens.store.Ledger`."""

    value_errors: tuple[type[BaseException], ...] = (TypeError, ValueError, StoreError)

    def __init__(self, ledger: Ledger, *, lineups: Sequence[LineupSpec], versions: Mapping[str, str]) -> None:
        self._ledger = ledger
        self._run_id: int | None = None  # set by begin()
        self._versions = dict(versions)
        self._fingerprints = {lineup.name: lineup.fingerprint for lineup in lineups}
        self._describe = {lineup.name: dict(lineup.describe) for lineup in lineups}
        self._lineups = tuple(self._fingerprints)
        self._live: set[str] = set()  # O(concurrency): catches a job id pulled twice while both are live
        # Ids an earlier run left pending/running/failed (the only ones that may have committed turns) and
        # live jobs of this run that recorded a turn. The first is at most the size of the resume scan.
        self._unfinished: set[str] = set()
        self._has_turns: set[str] = set()

    @classmethod
    async def open(
        cls,
        out_dir: str | os.PathLike[str],
        *,
        lineups: Sequence[LineupSpec],
        resume: bool,
        versions: Mapping[str, str],
    ) -> LedgerRecorder:
        """Open (lock) the ledger; refuses a changed recipe before anything is written or runs.

        The run itself is recorded by :meth:`begin`, once the recorded jobs' inputs have been verified, so a
        refused rerun leaves the ledger as it was.
        """
        ledger = await Ledger.open(out_dir, fresh=not resume)
        recorder = cls(ledger, lineups=lineups, versions=versions)
        try:
            await ledger.check_lineups(
                recorder._fingerprints, describe=recorder._describe, start_over=START_OVER
            )
        except BaseException:
            await ledger.close()
            raise
        return recorder

    @property
    def ledger_path(self) -> Path:
        return self._ledger.path

    @property
    def batch_store(self) -> Ledger:
        """Where the run's API gateway records provider batches (so that a rerun re-attaches to them)."""
        return self._ledger

    async def recorded(self) -> RecordedJobs:
        recorded = await self._ledger.recorded_jobs()
        # Every job an earlier run left pending, running (requeued by begin) or failed.
        self._unfinished = {job_id for job_id in recorded.inputs if job_id not in recorded.done}
        return recorded

    async def begin(self) -> None:
        self._run_id = await self._ledger.begin_run(
            self._fingerprints, versions=self._versions, describe=self._describe, start_over=START_OVER
        )
        await self._ledger.requeue_running()  # left by a run that crashed or was interrupted

    async def add_many(self, specs: Sequence[JobSpec]) -> None:
        ids = [spec.job_id for spec in specs]
        for job_id in ids:
            if job_id in self._live:
                raise _duplicate(job_id)
            self._live.add(job_id)
        try:
            await self._ledger.add_jobs(
                JobRecord(spec.job_id, spec.lineup, spec.seed, spec.row_index, input_fp=spec.input_fp)
                for spec in specs
            )
        except BaseException:
            self._live.difference_update(ids)
            raise

    async def start(self, job_id: str, *, device: str) -> int:
        try:
            return await self._ledger.start_job(job_id, device=device)
        except LedgerFullError:  # a full disk is a full disk, whatever it stopped
            raise
        except StoreError as exc:  # done ids were skipped at the start: it finished earlier in this run
            raise _duplicate(job_id) from exc

    async def committed_turns(self, job_id: str) -> list[dict[str, Any]]:
        # Only a job an earlier run left unfinished, or one that recorded a turn in this run (a retry), can
        # have committed turns: every other job was inserted fresh by this run. Skipping the read for those
        # saves a ledger round trip per job, which is most of the cost of a run of short jobs.
        if job_id not in self._unfinished and job_id not in self._has_turns:
            return []
        return await self._ledger.committed_turns(job_id)

    async def record_turn(self, job_id: str, index: int, turn: Mapping[str, Any]) -> None:
        self._has_turns.add(job_id)  # before the write: a failed write may still have committed
        await self._ledger.record_turn(job_id, index, turn)

    async def finish(self, job_id: str, outcome: AttemptOutcome) -> None:
        await self._ledger.finish_job(
            job_id,
            conversation=outcome.conversation or {},
            analysis=outcome.analysis,
            tokens_generated=outcome.tokens_generated,
        )
        self._live.discard(job_id)
        self._has_turns.discard(job_id)

    async def fail(self, job_id: str, outcome: AttemptOutcome) -> None:
        error = outcome.error or ErrorInfo("UnknownError", "the job failed without an error", "")
        await self._ledger.fail_job(
            job_id,
            error_type=error.type,
            message=error.message,
            traceback=error.traceback,
            conversation=outcome.conversation,
            tokens_generated=outcome.tokens_generated,
        )
        self._live.discard(job_id)
        if job_id in self._has_turns:  # a duplicate id pulled later must still replay them
            self._unfinished.add(job_id)
        self._has_turns.discard(job_id)

    async def retry(self, job_id: str) -> None:
        await self._ledger.return_to_pending(job_id)

    async def end(self, status: str) -> None:
        if self._run_id is not None:  # a run refused before it began recorded nothing to end
            await self._ledger.end_run(status)

    async def close(self) -> None:
        await self._ledger.close()

    def outcome(self, *, counts: Mapping[str, int], skipped: list[str]) -> RunOutcome:
        assert self._run_id is not None, "outcome() of a run that never began"
        source = _LedgerSource(self._ledger.path, run_id=self._run_id, lineups=self._lineups, skipped=skipped)
        return RunOutcome(
            ledger_path=self._ledger.path, counts=dict(counts), _source=source, _skipped=skipped
        )


def _duplicate(job_id: str) -> DuplicateJobError:
    return DuplicateJobError(
        f"job id {job_id!r} occurs twice in this run; job ids must be unique across all lineups of a run"
    )


class _LedgerSource:
    """Per-job outcomes of one run, read from the ledger on demand (nothing cached)."""

    def __init__(self, path: Path, *, run_id: int, lineups: Sequence[str], skipped: Sequence[str]) -> None:
        self._path = path
        self._run_id = run_id
        self._lineups = lineups
        self._skipped = frozenset(skipped)

    def _mine(self, job: JobRecord) -> bool:
        return job.run_id == self._run_id or job.job_id in self._skipped

    def job_ids(self, state: JobState | None = None) -> list[str]:
        with LedgerReader(self._path) as reader:
            if state is not None:  # done/failed by this run; skipped jobs are listed by RunOutcome.skipped
                return reader.job_ids(state=state, run=self._run_id)
            ran = set(reader.job_ids(run=self._run_id))
            return [
                job_id
                for lineup in self._lineups
                for job_id in reader.job_ids(lineup=lineup)
                if job_id in ran or job_id in self._skipped
            ]

    def outcome(self, job_id: str) -> JobOutcome:
        with LedgerReader(self._path) as reader:
            job = reader.job(job_id)
            if job is None or not self._mine(job):
                raise KeyError(f"job {job_id!r} is not part of this run (run {self._run_id} of {self._path})")
            return self._outcome(job, reader.result(job_id))

    def outcomes(self) -> Iterator[JobOutcome]:
        with LedgerReader(self._path) as reader:
            for job, result in reader.iter_results(states=("done", "failed")):
                if self._mine(job) and job.lineup in self._lineups:
                    yield self._outcome(job, result)

    def _outcome(self, job: JobRecord, result: dict[str, Any] | None) -> JobOutcome:
        return JobOutcome.from_ledger(job, result, skipped=job.job_id in self._skipped)
