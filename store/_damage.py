"""Records that do not parse, in a ledger that otherwise reads: found by name, read around, run again.

A disk that filled mid-write, a copy cut short or a hand edit can leave one JSON value malformed (a turn, a
result's state, analysis or turn order) in a file SQLite still opens. Such a record is one job's loss, not the
ledger's:

- readers (``LedgerReader``) name the job and the record (:class:`~._errors.UnreadableRecordError`) where one
  job is asked for, leave the job out (with a warning) where many are listed, skip the record in totals, and
  list every one (:func:`unreadable_records`) for ``interlens status``;
- a rerun (``begin_run``, in its transaction) runs each such job again from what still reads
  (:func:`rerun_unreadable`): its turns before the first broken one are kept and replayed, the rest of its
  turns and its result are dropped (the result's text kept in ``superseded_results``), and a done job is
  pending again. Nothing that reads is lost, and no answer is built on a record nobody can read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import UnreadableRecordError

if TYPE_CHECKING:
    import sqlite3
    from pathlib import Path

    import aiosqlite

__all__ = [
    "UnreadableRecord",
    "loads",
    "rerun_unreadable",
    "unreadable_error",
    "unreadable_jobs",
    "unreadable_records",
]

# idx of a turns row, or NULL for a results row whose state, analysis or turn order does not parse; {job}:
# every job ("1") or one (a primary-key lookup, where a reader names the record it just failed to read).
_BROKEN = """
SELECT job_id, idx FROM turns WHERE {job} AND NOT json_valid(turn_json)
UNION ALL
SELECT job_id, NULL FROM results WHERE {job} AND (NOT json_valid(state_json)
    OR (analysis_json IS NOT NULL AND NOT json_valid(analysis_json))
    OR (turn_order IS NOT NULL AND NOT json_valid(turn_order)))
ORDER BY 1, 2
"""
_EVERY_JOB = _BROKEN.format(job="1")
_ONE_JOB = _BROKEN.format(job="job_id = :job")


@dataclass(frozen=True)
class UnreadableRecord:
    """One record that does not parse: job ``job_id``'s committed turn ``idx`` (>= 0), a message only its
    result holds (``idx`` < 0), or its result itself (``idx`` None)."""

    job_id: str
    idx: int | None

    def describe(self) -> str:
        if self.idx is None:
            return f"job {self.job_id!r}'s result"
        if self.idx < 0:
            return f"a message of job {self.job_id!r}'s result"
        return f"job {self.job_id!r}'s turn {self.idx}"


def loads(text: str, *, record: UnreadableRecord, path: Path) -> Any:
    """``json.loads(text)``, or :class:`UnreadableRecordError` naming the record."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise unreadable_error(record, path, exc) from exc


def unreadable_error(record: UnreadableRecord, path: Path, cause: BaseException) -> UnreadableRecordError:
    return UnreadableRecordError(
        f"{record.describe()} in {path} is not valid JSON ({cause}): the file was damaged there. The rest of "
        "the ledger reads; rerunning the same recipe into its out_dir runs this job again from what still "
        "reads (interlens status lists every unreadable record)",
        job_id=record.job_id,
        idx=record.idx,
    )


def unreadable_records(conn: sqlite3.Connection, *, job_id: str | None = None) -> list[UnreadableRecord]:
    """Every record that does not parse (one scan of the turns and results), or those of ``job_id``."""
    rows = conn.execute(_EVERY_JOB) if job_id is None else conn.execute(_ONE_JOB, {"job": job_id})
    return [UnreadableRecord(job, idx) for job, idx in rows.fetchall()]


async def unreadable_jobs(conn: aiosqlite.Connection) -> set[str]:
    """Ids of the jobs with a record that does not parse: not done for a rerun, whatever their state says."""
    return {job_id for job_id, _ in await conn.execute_fetchall(_EVERY_JOB)}


async def rerun_unreadable(conn: aiosqlite.Connection) -> list[str]:
    """Inside a rerun's first transaction: make every job with an unreadable record run again from what still
    reads (see the module docstring). Returns one line per such job, for the run's warning."""
    broken: dict[str, list[int | None]] = {}
    for job_id, idx in await conn.execute_fetchall(_EVERY_JOB):
        broken.setdefault(job_id, []).append(idx)
    lines = []
    for job_id, indices in broken.items():
        turns = [i for i in indices if i is not None and i >= 0]
        first = min(turns) if turns else None
        await conn.execute(
            "INSERT INTO superseded_results (job_id, state_json, analysis_json, replaced_at) "
            "SELECT job_id, state_json, analysis_json, ? FROM results WHERE job_id = ?",
            (time.time(), job_id),
        )
        await conn.execute("DELETE FROM results WHERE job_id = ?", (job_id,))
        await conn.execute(
            "DELETE FROM turns WHERE job_id = ? AND (idx < 0 OR idx >= ?)",
            (job_id, first if first is not None else 2**62),
        )
        await conn.execute("UPDATE jobs SET state = 'pending' WHERE job_id = ? AND state = 'done'", (job_id,))
        kept = "its committed turns kept" if first is None else f"its turns before turn {first} kept"
        where = "its result" if first is None else f"turn {first}"
        lines.append(f"job {job_id!r} ({where} does not parse): runs again, {kept}")
    return lines
