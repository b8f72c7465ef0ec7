"""What a rerun compares: a job the ledger already holds must be asked now exactly what it was asked then.

Job ids are positional (``row_00012`` is the 13th row of whatever data this run brings), so an id alone does
not say which question a recorded answer belongs to. Each job is therefore recorded with its input
fingerprint (``JobSpec.input_fp``), and a rerun into the same ``out_dir`` compares it for every recorded job
it brings — done, failed, pending, or running when the last run died — before resuming it. One that would now
be asked something else refuses the run: its recorded answer, and any turns it committed, belong to another
question. New jobs (a grown ``n``, appended rows) have nothing to compare: they simply run.

When the comparison happens:

- A lineup whose ``jobs`` can be iterated again (not an Iterator) is expanded once more before any job
  starts, up to the jobs the ledger holds for it. The pass holds no job: memory stays O(concurrency) plus the
  recorded ids and fingerprints. A refusal then comes before the run is recorded: no job record changes.
- A lineup whose ``jobs`` are an Iterator (rows from a generator) cannot be read twice: its jobs are compared
  as they are pulled, and the first mismatch stops the run before that job starts. Jobs pulled before it were
  asked what they were asked before, and may have run.

Every pulled job is compared in both cases, so data that changes between the two passes is caught as well.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio.lowlevel

from interlens.store import FingerprintMismatchError, RecordedJobs

from ._checks import check_spec
from ._protocols import JobSpec, LineupSpec

__all__ = ["InputRefusal", "input_changed", "verify_recorded_inputs"]

#: How a user of ``run_jobs`` (and of interlens' rollout/run) starts a fresh ledger.
START_OVER = "pass resume=False"

_SHOWN = 5  # mismatching jobs spelled out in the refusal; the rest are counted
_CHECKPOINT_EVERY = 256  # specs expanded between two cancellation points of the verification pass


def input_changed(recorded: RecordedJobs, spec: JobSpec) -> bool:
    """Whether ``spec`` is a recorded job that would now be asked something else.

    A job without a fingerprint (``input_fp=None``) is not compared; a recorded job without one (a ledger
    written before fingerprints were recorded) cannot be, and counts as changed.
    """
    if spec.input_fp is None or spec.job_id not in recorded.inputs:
        return False
    return recorded.inputs[spec.job_id] != spec.input_fp


class InputRefusal:
    """The first few jobs that would be asked something else, and the error that refuses the run."""

    def __init__(self, ledger_path: Path | None) -> None:
        self._path = ledger_path
        self._lines: list[str] = []
        self._count = 0
        self._unrecorded = False

    def __bool__(self) -> bool:
        return self._count > 0

    def add(self, lineup: LineupSpec, spec: JobSpec, recorded_fp: str | None) -> None:
        self._count += 1
        if recorded_fp is None:
            self._unrecorded = True
        if len(self._lines) < _SHOWN:
            self._lines.append(f"- {spec.job_id}: {_explain(lineup, spec, recorded_fp)}")

    def error(self, *, pulled_from: LineupSpec | None = None) -> FingerprintMismatchError:
        """The refusal; ``pulled_from``: the lineup of a job caught as it was pulled, mid-run."""
        where = f" in {self._path}" if self._path is not None else ""
        jobs = "1 job" if self._count == 1 else f"{self._count} jobs"
        lines = list(self._lines)
        if self._count > len(lines):
            lines.append(f"- ... and {self._count - len(lines)} more")
        parts = [
            f"{jobs} already recorded{where} would now be asked something different from what they were "
            "asked, so their recorded answers (and committed turns) do not answer this run's questions:",
            *lines,
        ]
        if self._unrecorded:
            parts.append(
                "This ledger was written by an older interlens (ledger schema 1), which did not record what "
                "each job was asked: its jobs cannot be checked against this run, so they are not resumed."
            )
        if pulled_from is None:
            parts.append("Nothing was run and no job record was changed.")
        elif isinstance(pulled_from.jobs, Iterator):
            parts.append(
                "The run stopped before this job started. Its jobs come from an iterator that can be read "
                "only once, so they are compared as they are pulled: jobs pulled before it were asked what "
                "they were asked before."
            )
        else:
            parts.append(
                "The run stopped before this job started: its lineup's data changed between the check before "
                "the run and this read of it."
            )
        folder = f"{self._path.parent}/" if self._path is not None else ""
        parts.append(
            "A rerun into the same out_dir resumes a recorded job only when it is asked exactly the same "
            "(data row, resolved prompts, seed, execution mode, participants' settings); growing n or "
            "appending rows is fine. To keep the old results, use another out_dir. To start over here, "
            f"{START_OVER}: the old ledger is moved aside to {folder}ledger.<UTC timestamp>.sqlite, "
            "nothing is deleted."
        )
        return FingerprintMismatchError("\n".join(parts))


def _explain(lineup: LineupSpec, spec: JobSpec, recorded_fp: str | None) -> str:
    if recorded_fp is None:
        return "what it was asked was not recorded"
    lines = lineup.explain_input(spec, recorded_fp) if lineup.explain_input is not None else []
    return "; ".join(lines) or f"input fingerprint {recorded_fp!r} → {spec.input_fp!r}"


async def verify_recorded_inputs(
    lineups: Sequence[LineupSpec], recorded: RecordedJobs, *, ledger_path: Path | None
) -> None:
    """Before any job starts: compare every recorded job of the lineups that can be iterated again.

    Each such lineup is expanded once more up to the last of its recorded jobs (a first run has none and
    costs nothing). Raises :class:`FingerprintMismatchError` naming the first few jobs that changed and how.
    """
    refusal = InputRefusal(ledger_path)
    for lineup in lineups:
        expected = recorded.per_lineup.get(lineup.name, 0)
        if not expected or isinstance(lineup.jobs, Iterator):
            continue  # nothing recorded, or one-shot: compared as pulled (see _run)
        seen = 0
        for pulled, spec in enumerate(lineup.jobs, start=1):
            check_spec(spec, lineup)
            if spec.job_id in recorded.inputs:
                if input_changed(recorded, spec):
                    refusal.add(lineup, spec, recorded.inputs[spec.job_id])
                seen += 1
                if seen >= expected:
                    break
            if pulled % _CHECKPOINT_EVERY == 0:
                await anyio.lowlevel.checkpoint()  # a long pass stays cancellable
    if refusal:
        raise refusal.error()
