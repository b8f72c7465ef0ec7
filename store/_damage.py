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

Damage below the records (pages of the file overwritten: a disk fault, garbage written mid-file) is no one
job's: SQLite answers "database disk image is malformed" wherever a query meets it. Readers raise it as
:class:`~._errors.LedgerCorruptError` naming the file, what ``PRAGMA integrity_check`` says and what to do
(:func:`page_damage_error`, applied to every reading method by :func:`reads_translated`).
"""

from __future__ import annotations

import functools
import inspect
import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ._errors import LedgerCorruptError, UnreadableRecordError
from ._schema import ro_uri

if TYPE_CHECKING:
    from pathlib import Path

    import aiosqlite

__all__ = [
    "UnreadableRecord",
    "loads",
    "page_damage_error",
    "reads_translated",
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
        await conn.execute(
            "DELETE FROM turn_tokens WHERE job_id = ? AND (idx < 0 OR idx >= ?)",
            (job_id, first if first is not None else 2**62),
        )
        await conn.execute("UPDATE jobs SET state = 'pending' WHERE job_id = ? AND state = 'done'", (job_id,))
        kept = "its committed turns kept" if first is None else f"its turns before turn {first} kept"
        where = "its result" if first is None else f"turn {first}"
        lines.append(f"job {job_id!r} ({where} does not parse): runs again, {kept}")
    return lines


C = TypeVar("C", bound=type)


def is_page_damage(exc: BaseException) -> bool:
    """SQLite's own "malformed" / "not a database" answers, not a busy or locked file (OperationalError)."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(
        exc, sqlite3.OperationalError | sqlite3.IntegrityError | sqlite3.ProgrammingError
    )


def page_damage_error(path: Path, exc: BaseException) -> LedgerCorruptError:
    """The damaged file named, what SQLite's integrity check finds (on a fresh connection), what to do."""
    try:
        conn = sqlite3.connect(ro_uri(path), uri=True)
        try:
            found = "reports: " + "; ".join(r[0] for r in conn.execute("PRAGMA integrity_check(5)"))
        finally:
            conn.close()
    except sqlite3.Error as check_exc:
        found = f"cannot finish either ({check_exc})"
    return LedgerCorruptError(
        f"{path} is damaged below its records: SQLite answers '{exc}', and PRAGMA integrity_check "
        f"{found}. Pages of the file were overwritten (a disk or filesystem fault, something writing into "
        "it). Keep the file as it is (copy it away before anything else): the sqlite3 command-line tool's "
        "'.recover' salvages what still reads into a new database; or rerun the recipe with resume=False "
        "(interlens demo: --fresh), which moves this ledger aside and starts over"
    )


def reads_translated(cls: C) -> C:
    """Every public method of a reader class raises page damage as :func:`page_damage_error` (generators
    too, wherever their iteration meets it)."""
    for name, fn in list(vars(cls).items()):
        if name.startswith("_") or not inspect.isfunction(fn) or name == "close":
            continue
        setattr(cls, name, _translated(fn))
    return cls


def _translated(fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                yield from fn(self, *args, **kwargs)
            except sqlite3.DatabaseError as exc:
                if not is_page_damage(exc):
                    raise
                raise page_damage_error(self.path, exc) from exc

        return generator

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except sqlite3.DatabaseError as exc:
            if not is_page_damage(exc):
                raise
            raise page_damage_error(self.path, exc) from exc

    return method
