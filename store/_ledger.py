"""The writer side of the ledger: one :class:`Ledger` per run, owned by the scheduler (the only writer).

Every write goes through a :class:`~._group.GroupCommitter`, so concurrent jobs share transactions and each
``await`` returns only once its own write is committed — durable against the death of the process (see
``_group`` for why WAL + ``synchronous=NORMAL`` is enough for that). Reads on this object go through the same
path, so they see every write that was acknowledged before them.

Requires the asyncio backend (aiosqlite is asyncio-only); anyio on asyncio is fine.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel

from ._damage import unreadable_jobs
from ._errors import LedgerSchemaError, StoreError
from ._files import move_aside
from ._group import GroupCommitter, Op
from ._json import SecretGuard
from ._lock import WriterLock
from ._provider_batches import open_batches_op, record_batch_op, update_batch_op
from ._records import JOB_STATES, RUN_STATUSES, BatchRecord, JobRecord, RecordedJobs
from ._results import EncodedResult, encode_result, store_results
from ._runs import STORE_START_OVER, begin_run_op, check_lineups_op
from ._schema import (
    LEDGER_FILENAME,
    SCHEMA,
    SCHEMA_VERSION,
    SPLIT_FUNCTION,
    check_existing,
    migration_script,
)
from ._secrets import redacting_logger
from ._token_rows import GeneratedIds, split_text, stored_values, unmarked_digest, unmarked_local
from ._turn_ops import committed_turns_op, record_turn_op, unknown_job

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["Ledger"]

log = redacting_logger("interlens.store")

_ADD_CHUNK = 5_000  # rows per add_jobs transaction: durable progress without one giant transaction
_SCAN_PAGE = 4_096  # rows per fetch of the resume scan: few thread hops, no list of every row at once

_INSERT_JOB = (
    "INSERT OR IGNORE INTO jobs (job_id, lineup, seed, row_index, state, attempts, created_at, "
    "tokens_generated, input_fp) VALUES (?, ?, ?, ?, 'pending', 0, ?, 0, ?)"
)
_MARK_DONE = (
    "UPDATE jobs SET state = 'done', finished_at = ?, tokens_generated = ?, run_id = ?, error_type = NULL, "
    "error_message = NULL, error_traceback = NULL WHERE job_id = ?"
)


def _split_part(text: str, part: int) -> Any:
    """The migrations' SQL function (``SPLIT_FUNCTION``): see ``_schema``."""
    if part == -2:
        return unmarked_local(text)
    if part < 0:
        return unmarked_digest(text)
    stored, row = split_text(text)
    if part == 0:
        return stored
    return None if row is None else stored_values(row, {})[part - 1]


async def _finish_jobs(
    conn: aiosqlite.Connection, payloads: Sequence[tuple[EncodedResult, tuple[Any, ...]]]
) -> None:
    """The finish_job calls of one transaction, together: their results, then their jobs marked done."""
    unknown = await store_results(conn, [result for result, _ in payloads])
    if unknown:  # nothing was written; bisection isolates the call that named it
        raise unknown_job("finish_job", unknown[0])
    await conn.executemany(_MARK_DONE, [done for _, done in payloads])


class Ledger:
    """Writer of ``out_dir/ledger.sqlite``. Create with ``await Ledger.open(out_dir)``; never directly.

    Use it as ``async with await Ledger.open(out_dir) as ledger: ...`` (closed on exit, even when cancelled),
    or call ``await ledger.close()`` yourself: closing commits what is queued, marks a run that was not ended
    as "interrupted" and releases the out_dir's writer lock.
    """

    def __init__(
        self,
        *,
        out_dir: Path,
        conn: aiosqlite.Connection,
        lock: WriterLock,
        moved_aside: Path | None,
        guard: SecretGuard,
    ) -> None:
        self.out_dir = out_dir
        self.path = out_dir / LEDGER_FILENAME
        #: Where ``fresh=True`` moved the previous ledger (None when there was none, or fresh was False).
        self.moved_aside = moved_aside
        self._conn = conn
        self._lock = lock
        self._guard = guard
        self._group = GroupCommitter(conn)
        self._run_id: int | None = None
        self._run_ended = False
        self._closed = False
        self._generated = GeneratedIds()  # what a running job's later prompts refer to (schema 6)

    # ------------------------------------------------------------------------------------------- lifecycle

    @classmethod
    async def open(
        cls,
        out_dir: str | os.PathLike[str],
        *,
        fresh: bool = False,
        synchronous: Literal["normal", "full"] = "normal",
        busy_timeout_s: float = 5.0,
    ) -> Ledger:
        """Open (creating if needed) the ledger of ``out_dir`` for writing, holding its writer lock.

        ``fresh=True`` starts a new ledger without deleting anything: an existing ``ledger.sqlite`` (with its
        ``-wal``/``-shm`` files) is renamed to ``ledger.<UTC timestamp>.sqlite`` in the same directory, and
        :attr:`moved_aside` says where it went. ``synchronous="normal"`` keeps every acknowledged write across
        a crash of the process; ``"full"`` also across an OS crash or power loss (one fsync per group commit).
        ``busy_timeout_s`` bounds how long a write waits on a lock held by some *other* program that opened
        the file behind the ledger's back, before failing.

        Raises LedgerLockedError (another live run holds ``out_dir``), LedgerSchemaError (a newer ledger, or
        an older one that cannot be upgraded; left as it was), LedgerCorruptError (not a readable ledger; the
        file is left untouched).
        """
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be 'normal' or 'full', got {synchronous!r}")
        if not busy_timeout_s >= 0:
            raise ValueError(f"busy_timeout_s must be >= 0, got {busy_timeout_s!r}")
        directory = Path(out_dir)
        path = directory / LEDGER_FILENAME
        guard = SecretGuard()

        def prepare() -> tuple[WriterLock, Path | None, int]:
            if directory.exists() and not directory.is_dir():
                raise StoreError(f"out_dir {directory} exists and is not a directory; pass a directory path.")
            directory.mkdir(parents=True, exist_ok=True)
            lock = WriterLock.acquire(directory)
            try:
                moved = move_aside(path) if fresh else None
                return lock, moved, check_existing(path, deep=True)
            except BaseException:
                lock.release()
                raise

        # Shielded so that a cancellation cannot drop the lock-holding result on the floor; it is honoured
        # right after, with the lock in hand to release.
        with anyio.CancelScope(shield=True):
            lock, moved, existing = await anyio.to_thread.run_sync(prepare)
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            import aiosqlite

            conn = await aiosqlite.connect(path, isolation_level=None)
            try:
                mode = (await (await conn.execute("PRAGMA journal_mode = WAL")).fetchone() or ("?",))[0]
                if str(mode).lower() != "wal":
                    raise StoreError(
                        f"SQLite refused WAL mode for {path} (got {mode!r}); the ledger needs a local "
                        f"filesystem that supports shared memory. Use an out_dir on a local disk."
                    )
                await conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
                await conn.execute("PRAGMA foreign_keys = ON")
                await conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
                if not existing:
                    await conn.executescript(f"BEGIN IMMEDIATE;{SCHEMA}COMMIT;")
                elif existing < SCHEMA_VERSION:  # an older ledger: brought up to date, in one transaction
                    await conn.create_function(SPLIT_FUNCTION, 2, _split_part, deterministic=True)
                    try:
                        await conn.executescript(migration_script(existing))
                    except sqlite3.Error as exc:
                        with suppress(sqlite3.Error):
                            await conn.execute("ROLLBACK")
                        raise LedgerSchemaError(
                            f"{path} is a ledger of schema version {existing} that cannot be brought up "
                            f"to version {SCHEMA_VERSION} ({type(exc).__name__}: {exc}); the upgrade runs "
                            f"in one transaction, so the file was left as it was. To start a new ledger, "
                            f"rerun with resume=False (rollout()/run(); Ledger.open(..., fresh=True) for the "
                            f"ledger on its own), which moves it aside, or use another out_dir; an "
                            f"interlens of the version that wrote it still reads it."
                        ) from exc
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await conn.close()
                raise
        except BaseException:
            lock.release()
            raise
        return cls(out_dir=directory, conn=conn, lock=lock, moved_aside=moved, guard=guard)

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Commit what is queued, mark an un-ended run "interrupted", close the file, release the lock."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                if self._run_id is not None and not self._run_ended:
                    # Closing must release the lock even if recording the run's end fails (disk full, ...).
                    with suppress(StoreError, sqlite3.Error):
                        await self.end_run("interrupted")
                await self._group.close("the ledger is closed")
                await self._conn.close()
            finally:
                self._lock.release()

    @property
    def run_id(self) -> int | None:
        """The id ``begin_run`` returned, or None before it."""
        return self._run_id

    @property
    def commit_stats(self) -> dict[str, int]:
        """How many transactions committed how many operations (group commit makes the first much smaller)."""
        return {"transactions": self._group.transactions, "operations": self._group.operations}

    async def _submit(self, op: Op) -> Any:
        return await self._group.submit(op)

    # ------------------------------------------------------------------------------------------------ runs

    async def begin_run(
        self,
        lineups: Mapping[str, str],
        *,
        versions: Mapping[str, str],
        describe: Mapping[str, Any] | None = None,
        start_over: str = STORE_START_OVER,
    ) -> int:
        """Record the start of a run over ``lineups`` ({name: recipe fingerprint}); return the run id.

        A lineup already recorded with a different fingerprint raises FingerprintMismatchError (nothing is
        written): results of two recipes must never mix under the same job ids. ``describe`` maps a lineup to
        a JSON summary of its recipe, stored with it and diffed in that error; ``start_over`` is how the
        error tells the caller's user to start a fresh ledger (a caller with its own option names it). A run
        that an earlier process left "running" is marked "crashed" (its process is dead: this one holds the
        lock).
        """
        if self._run_id is not None:
            raise StoreError(
                f"begin_run was already called on this ledger (run {self._run_id}); open a new one per run"
            )
        op = begin_run_op(
            lineups, versions, describe, path=self.path, guard=self._guard, start_over=start_over
        )
        self._run_id, damaged = await self._submit(op)
        for line in damaged:
            log.warning("%s: %s", self.path, line)
        return self._run_id

    async def check_lineups(
        self,
        lineups: Mapping[str, str],
        *,
        describe: Mapping[str, Any] | None = None,
        start_over: str = STORE_START_OVER,
    ) -> None:
        """Raise what :meth:`begin_run` would raise for ``lineups``, writing nothing.

        For a caller that has more to check before it commits to a run (the scheduler compares each recorded
        job's inputs in between), so that a refused run leaves the file exactly as it was.
        """
        await self._submit(check_lineups_op(lineups, describe, path=self.path, start_over=start_over))

    async def end_run(self, status: str) -> None:
        """Record the end of the run: "completed", "stopped" (ended early, jobs left pending), "interrupted"
        or "failed"."""
        if status not in RUN_STATUSES:
            raise ValueError(f"end_run status must be one of {RUN_STATUSES}, got {status!r}")
        run_id = self._require_run("end_run")
        await self._submit(
            Op(
                f"end_run({status!r})",
                stmts=(
                    (
                        "UPDATE runs SET status = ?, ended_at = ? WHERE run_id = ?",
                        (status, time.time(), run_id),
                    ),
                ),
            )
        )
        self._run_ended = True

    def _require_run(self, action: str) -> int:
        if self._run_id is None:
            raise StoreError(f"{action}: call begin_run() first, so the ledger knows which run this is")
        return self._run_id

    # ------------------------------------------------------------------------------------------------ jobs

    async def add_jobs(self, rows: Iterable[JobRecord]) -> None:
        """Insert ``rows`` as pending jobs, in order (that order is the job order), each with its
        ``input_fp``. Existing ids are kept as they are (fingerprint included), so calling it again on resume
        is harmless: comparing a rerun's inputs with the recorded ones is the caller's job, before it adds
        (see :meth:`recorded_jobs`). Durable on return."""
        chunk: list[tuple[Any, ...]] = []
        now = time.time()
        for row in rows:
            if not isinstance(row, JobRecord):
                raise TypeError(f"add_jobs takes JobRecord objects, got {type(row).__name__}: {row!r}")
            chunk.append((row.job_id, row.lineup, row.seed, row.row_index, now, row.input_fp))
            if len(chunk) >= _ADD_CHUNK:
                await self._add_chunk(chunk)
                chunk = []
        if chunk:
            await self._add_chunk(chunk)

    async def _add_chunk(self, chunk: list[tuple[Any, ...]]) -> None:
        async def apply(conn: aiosqlite.Connection) -> None:
            await conn.executemany(_INSERT_JOB, chunk)

        await self._submit(Op(f"add_jobs({len(chunk)} jobs from {chunk[0][0]!r})", apply=apply))

    async def done_job_ids(self) -> set[str]:
        """Ids of every job that is done: the resume scan (an index-only read)."""

        async def apply(conn: aiosqlite.Connection) -> set[str]:
            return {r[0] for r in await conn.execute_fetchall("SELECT job_id FROM jobs WHERE state = 'done'")}

        result: set[str] = await self._submit(Op("done_job_ids", apply=apply))
        return result

    async def recorded_jobs(self) -> RecordedJobs:
        """Every recorded job's input fingerprint, the done ones, and each lineup's job count, in one read:
        what a rerun checks before it starts. O(jobs) memory, like :meth:`done_job_ids`."""

        async def apply(conn: aiosqlite.Connection) -> RecordedJobs:
            recorded = RecordedJobs()
            async with conn.execute("SELECT job_id, lineup, state = 'done', input_fp FROM jobs") as cursor:
                while rows := await cursor.fetchmany(_SCAN_PAGE):
                    for job_id, lineup, done, input_fp in rows:
                        recorded.inputs[job_id] = input_fp
                        if done:
                            recorded.done.add(job_id)
                        recorded.per_lineup[lineup] = recorded.per_lineup.get(lineup, 0) + 1
            recorded.done.difference_update(await unreadable_jobs(conn))  # run again: see _damage
            return recorded

        result: RecordedJobs = await self._submit(Op("recorded_jobs", apply=apply))
        return result

    async def counts(self) -> dict[str, int]:
        """Number of jobs per state (every state present)."""

        async def apply(conn: aiosqlite.Connection) -> dict[str, int]:
            rows = await conn.execute_fetchall("SELECT state, count(*) FROM jobs GROUP BY state")
            return {state: 0 for state in JOB_STATES} | {s: int(n) for s, n in rows}

        result: dict[str, int] = await self._submit(Op("counts", apply=apply))
        return result

    async def requeue_running(self) -> list[str]:
        """Set jobs left "running" by a dead run back to "pending" and return their ids, in job order.

        Call it at the start of a run (before any start_job), when every "running" row is a leftover.
        """

        async def apply(conn: aiosqlite.Connection) -> list[str]:
            rows = await conn.execute_fetchall("SELECT job_id FROM jobs WHERE state = 'running' ORDER BY seq")
            await conn.execute("UPDATE jobs SET state = 'pending' WHERE state = 'running'")
            return [r[0] for r in rows]

        result: list[str] = await self._submit(Op("requeue_running", apply=apply))
        return result

    async def start_job(self, job_id: str, *, device: str) -> int:
        """Mark ``job_id`` running on ``device``, count the attempt; return the attempt number (1 first)."""

        async def apply(conn: aiosqlite.Connection) -> int:
            rows = list(
                await conn.execute_fetchall(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, device = ?, started_at = ?, "
                    "finished_at = NULL WHERE job_id = ? AND state != 'done' RETURNING attempts",
                    (device, time.time(), job_id),
                )
            )
            if rows:
                return int(rows[0][0])
            if await conn.execute_fetchall("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)):
                raise StoreError(f"start_job: job {job_id!r} is already done; a done job is never run again")
            raise unknown_job("start_job", job_id)

        attempts: int = await self._submit(Op(f"start_job({job_id!r})", apply=apply))
        return attempts

    async def record_turn(self, job_id: str, index: int, turn: Mapping[str, Any]) -> None:
        """Commit turn ``index`` of ``job_id``; durable on return. Re-recording an index replaces it."""
        op, row = record_turn_op(job_id, index, turn, guard=self._guard, generated=self._generated)
        await self._submit(op)
        self._generated.remember(job_id, index, row)  # committed: later turns of the job may refer to it

    async def committed_turns(self, job_id: str) -> list[dict[str, Any]]:
        """The committed turns of ``job_id`` in index order (what a resumed attempt replays), token records
        included as they were recorded: the replayed conversation is the one that ran."""
        result: list[dict[str, Any]] = await self._submit(committed_turns_op(job_id, self._generated))
        return result

    async def finish_job(
        self, job_id: str, *, conversation: Mapping[str, Any], analysis: Any, tokens_generated: int
    ) -> None:
        """Store the result and mark ``job_id`` done in ONE transaction (a done job always has its result).
        Clears the error fields of earlier attempts. Durable on return.

        The conversation's ``"transcript"`` list is stored as turns rows (its committed turns are not stored
        again) and a ``"recipe"`` equal to the lineup's is stored once per lineup: see ``_results``. A result
        stored earlier for the job (a failed attempt's kept conversation) is replaced, its state kept in
        ``superseded_results`` for :meth:`LedgerReader.result_values`."""
        run_id = self._require_run("finish_job")
        result = encode_result(
            job_id, conversation, analysis, what=f"the conversation of job {job_id!r}", guard=self._guard
        )

        done = (time.time(), int(tokens_generated), run_id, job_id)
        await self._submit(Op(f"finish_job({job_id!r})", apply_group=_finish_jobs, payload=(result, done)))
        self._generated.forget(job_id)

    async def fail_job(
        self,
        job_id: str,
        *,
        error_type: str,
        message: str,
        traceback: str,
        conversation: Mapping[str, Any] | None = None,
        tokens_generated: int = 0,
    ) -> None:
        """Mark ``job_id`` failed with its error. Pass ``conversation`` when the conversation finished but its
        analyzer failed: it is kept (analysis empty) so a rerun can redo only the analysis (a result stored
        earlier is replaced, its state kept, as in :meth:`finish_job`). Without one, a result stored earlier
        is left in place. Durable on return.

        A credential in the error text is redacted (``[redacted:VARNAME]``), not refused: the text describes
        the failure, and refusing it would leave the job running and abort the run. A credential in the
        ``conversation`` is refused (StoreError), like any result; the caller then fails the job without it.
        """
        run_id = self._require_run("fail_job")
        result = (
            None
            if conversation is None
            else encode_result(
                job_id,
                conversation,
                None,
                what=f"the conversation of failed job {job_id!r}",
                guard=self._guard,
            )
        )
        for name, text in (("error_type", error_type), ("message", message), ("traceback", traceback)):
            if not isinstance(text, str):
                raise TypeError(f"fail_job({job_id!r}): {name} must be a str, got {type(text).__name__}")
        error_type, message, traceback = (self._guard.redact(t) for t in (error_type, message, traceback))

        async def apply(conn: aiosqlite.Connection) -> None:
            rows = await conn.execute_fetchall(
                "UPDATE jobs SET state = 'failed', finished_at = ?, tokens_generated = ?, run_id = ?, "
                "error_type = ?, error_message = ?, error_traceback = ? WHERE job_id = ? RETURNING seq",
                (time.time(), int(tokens_generated), run_id, error_type, message, traceback, job_id),
            )
            if not rows:
                raise unknown_job("fail_job", job_id)
            if result is not None:
                await store_results(conn, [result])

        await self._submit(Op(f"fail_job({job_id!r})", apply=apply))
        self._generated.forget(job_id)

    async def return_to_pending(self, job_id: str) -> None:
        """Put a running job back to pending (its worker died); its attempt stays counted. A job that is no
        longer running (it finished in the meantime) is left alone."""

        async def apply(conn: aiosqlite.Connection) -> None:
            await conn.execute(
                "UPDATE jobs SET state = 'pending' WHERE job_id = ? AND state = 'running'", (job_id,)
            )
            if not await conn.execute_fetchall("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)):
                raise unknown_job("return_to_pending", job_id)

        await self._submit(Op(f"return_to_pending({job_id!r})", apply=apply))
        self._generated.forget(job_id)

    # --------------------------------------------------------------------------------------------- batches

    async def record_batch(self, batch: BatchRecord) -> None:
        """Record a submitted provider batch and its custom_id → (job, turn) map, before polling starts, so a
        resumed run re-attaches instead of paying twice. Re-recording the same batch replaces it."""
        await self._submit(record_batch_op(batch, guard=self._guard))

    async def update_batch(
        self, provider: str, batch_id: str, *, state: str, meta: Mapping[str, Any] | None = None
    ) -> None:
        """Record a batch's new state (and replace its metadata when ``meta`` is given)."""
        await self._submit(update_batch_op(provider, batch_id, state=state, meta=meta, guard=self._guard))

    async def open_batches(self) -> list[BatchRecord]:
        """Batches not in a terminal state (TERMINAL_BATCH_STATES), oldest first, with their request maps."""
        result: list[BatchRecord] = await self._submit(open_batches_op())
        return result
