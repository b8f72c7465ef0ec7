"""Group commit: many concurrent writers share one transaction, each awaiting the commit of its own operation.

Why no background writer task: the first caller that finds the connection idle becomes the *leader*, takes
every operation queued so far, commits them as one transaction and wakes the others; callers that arrive
meanwhile queue up and the next of them leads the next transaction. Batches therefore grow exactly as fast as
commits are slow, there is no task whose lifetime has to be tied to the caller's task group (so
``await Ledger.open(...)`` works without one, and nothing is left running after ``close`` or a cancellation),
and an error can only ever land on the operations of the transaction that raised it.

Durability: an operation's result is handed back only after ``COMMIT`` returned. In WAL mode a committed
transaction is in the WAL file (the OS page cache at least) before COMMIT returns, so it survives the death of
the process even under ``synchronous=NORMAL``; only an OS crash or power loss can drop the last commits then
(``synchronous=FULL`` covers that at the cost of an fsync per transaction, shared by the whole batch).

Cancellation: the leader commits inside a shielded cancel scope, so a transaction is never abandoned half-way
by a cancelled caller. A caller cancelled while still waiting has its operation withdrawn if no transaction
has taken it yet; otherwise the operation commits and the caller simply does not hear about it.

Failure isolation: if a batch fails on an operation's own fault (a constraint, a check in its ``apply``), the
transaction is rolled back and the batch is committed again without that operation (a failing row of a
merged ``executemany`` or group is found by bisection), so one bad call fails only its caller. Any other
error (disk full, I/O, a foreign lock) fails the whole batch at once, each caller getting its own
:class:`StoreError` chained to the cause.
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from ._errors import LedgerFullError, StoreError

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["GroupCommitter", "Op"]

Apply = Callable[["aiosqlite.Connection"], Awaitable[Any]]
ApplyGroup = Callable[["aiosqlite.Connection", Sequence[Any]], Awaitable[None]]


@dataclass(eq=False, slots=True)
class Op:
    """One caller's unit of work, committed atomically (possibly together with others).

    Either ``apply`` (a coroutine run inside the transaction; its return value is the op's result), or
    ``stmts``: parameterised statements with no result, which the committer merges with the identical
    statements of neighbouring ops into one ``executemany`` each. Merging runs statement 1 of every op, then
    statement 2, ..., so ``stmts`` must not depend on another op's rows in between (true for per-job upserts).
    Or ``apply_group`` with a ``payload``: neighbouring ops with the same ``apply_group`` are applied by one
    call of it on all their payloads (a few ``executemany`` for the lot instead of statements per op, each a
    round trip to SQLite's thread); it raises for the group, and a failing payload is found by bisection.
    """

    what: str  # for messages: "record_turn('job_3', 2)"
    apply: Apply | None = None
    stmts: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    explain: Callable[[sqlite3.IntegrityError], BaseException] | None = None  # a constraint → a clear error
    apply_group: ApplyGroup | None = None
    payload: Any = None
    done: bool = field(default=False, init=False)
    result: Any = field(default=None, init=False)
    error: BaseException | None = field(default=None, init=False)

    @property
    def signature(self) -> tuple[Any, ...] | None:
        if self.apply_group is not None:
            return (self.apply_group,)
        return None if self.apply is not None else tuple(sql for sql, _ in self.stmts)


class _OwnFault(Exception):
    """Internal: the batch failed by the fault of ``batch[start:end]`` (one op, or one merged group)."""

    def __init__(self, cause: BaseException, start: int, end: int) -> None:
        super().__init__(str(cause))
        self.cause, self.start, self.end = cause, start, end


class GroupCommitter:
    """Serialises all access to one aiosqlite connection into group-committed transactions."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn
        self._queue: list[Op] = []
        self._busy = False
        self._idle = anyio.Event()
        self._closed_reason: str | None = None
        self.transactions = 0
        self.operations = 0

    async def submit(self, op: Op) -> Any:
        """Queue ``op`` and return its result once its transaction has committed (or raise its error)."""
        if self._closed_reason is not None:
            raise StoreError(f"cannot {op.what}: {self._closed_reason}")
        self._queue.append(op)
        try:
            while not op.done:
                if self._busy:
                    await self._idle.wait()
                else:
                    await self._lead()
        except BaseException:
            if not op.done:
                with suppress(ValueError):
                    self._queue.remove(op)
            raise
        if op.error is not None:
            raise op.error
        return op.result

    async def close(self, reason: str) -> None:
        """Refuse new operations and wait until every queued one has been committed or failed."""
        self._closed_reason = reason
        while self._busy or self._queue:
            if self._busy:
                await self._idle.wait()
            else:
                await self._lead()

    async def _lead(self) -> None:
        self._busy = True
        batch, self._queue = self._queue, []
        try:
            with anyio.CancelScope(shield=True):
                await self._commit(batch)
        finally:
            for op in batch:  # nothing may be left hanging, whatever happened above
                if not op.done:
                    op.done, op.error = (
                        True,
                        StoreError(f"the ledger writer stopped before committing {op.what}"),
                    )
            self._busy = False
            idle, self._idle = self._idle, anyio.Event()
            idle.set()

    async def _commit(self, batch: list[Op]) -> None:
        try:
            results = await self._transaction(batch)
        except _OwnFault as fault:
            await self._rollback()
            if fault.end - fault.start == 1:  # the culprit is known: fail it, commit the others without it
                culprit = batch[fault.start]
                culprit.done, culprit.error = True, _explain(culprit, fault.cause)
                rest = batch[: fault.start] + batch[fault.end :]
                if rest:
                    await self._commit(rest)
                return
            # One row of a merged executemany failed: bisect (O(log n) extra transactions per bad op).
            mid = (fault.start + fault.end) // 2
            await self._commit(batch[:mid])
            await self._commit(batch[mid:])
            return
        except Exception as exc:
            await self._rollback()
            for op in batch:
                error = _failed_write(op, exc)
                error.__cause__ = exc
                op.done, op.error = True, error
            return
        self.transactions += 1
        self.operations += len(batch)
        for op, result in zip(batch, results, strict=True):
            op.done, op.result = True, result

    async def _transaction(self, batch: Sequence[Op]) -> list[Any]:
        conn = self._conn
        await conn.execute("BEGIN IMMEDIATE")
        results: list[Any] = []
        i = 0
        while i < len(batch):
            op = batch[i]
            signature = op.signature
            end = i + 1
            if signature is not None:
                while end < len(batch) and batch[end].signature == signature:
                    end += 1
            try:
                if op.apply is not None:
                    results.append(await op.apply(conn))
                elif op.apply_group is not None:
                    await op.apply_group(conn, [member.payload for member in batch[i:end]])
                    results.extend([None] * (end - i))
                else:
                    group = batch[i:end]
                    for k, (sql, _) in enumerate(op.stmts):
                        await conn.executemany(sql, [member.stmts[k][1] for member in group])
                    results.extend([None] * len(group))
            except (sqlite3.IntegrityError, StoreError) as exc:
                raise _OwnFault(exc, i, end) from exc
            i = end
        await conn.execute("COMMIT")
        return results

    async def _rollback(self) -> None:
        with suppress(sqlite3.Error, ValueError):
            await self._conn.execute("ROLLBACK")


def _explain(op: Op, exc: BaseException) -> BaseException:
    """The error a caller sees for its own fault: a constraint explained in the op's terms, else as raised."""
    if not isinstance(exc, sqlite3.IntegrityError):
        return exc
    error = op.explain(exc) if op.explain is not None else StoreError(f"ledger refused {op.what}: {exc}")
    error.__cause__ = exc
    return error


_SQLITE_FULL = 13  # SQLite's result code for "database or disk is full"


def _failed_write(op: Op, exc: BaseException) -> StoreError:
    """A write that failed for a reason no op caused; a full disk said as such (it had read as whatever the
    caller made of a failed write, e.g. a job id "occurring twice")."""
    full = getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or (
        isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    )
    if full:
        return LedgerFullError(
            f"the disk holding the ledger is full ({type(exc).__name__}: {exc}): {op.what} was not written. "
            "No job starts from here; every turn and result committed before it is kept. Free space on that "
            "disk (or move the out_dir to one with room) and rerun into the same out_dir: it resumes there"
        )
    return StoreError(f"ledger write failed ({op.what}): {type(exc).__name__}: {exc}")
