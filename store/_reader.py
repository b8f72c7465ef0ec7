"""The read side of the ledger: synchronous, read-only, safe to use while a run is writing.

Reports and the CLI read through here (plain ``sqlite3``, ``mode=ro``), so a report over a million jobs
streams rows instead of holding every conversation in memory. WAL mode lets this read a consistent snapshot
while the writer commits; a read never blocks the writer. Every query is an indexed lookup or a keyset-paged
scan, and :meth:`LedgerReader.iter_results` reads page by page in short read transactions, so an abandoned
iterator holds nothing open and never pins the WAL.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from ._damage import UnreadableRecord, loads, reads_translated, unreadable_error, unreadable_records
from ._errors import LedgerNotFoundError, UnreadableRecordError
from ._records import (
    JOB_STATES,
    TERMINAL_BATCH_STATES,
    BatchRecord,
    JobRecord,
    TurnRecord,
    job_columns,
    job_from_row,
)
from ._results import assemble, chunks
from ._schema import LEDGER_FILENAME, check_existing, ro_uri
from ._token_rows import TOKENS_KEY, TOKENS_TABLE, TokenRowError, is_marker, join, local_marker, put_marker
from ._token_stream import STREAM_TABLE, filled, segments_of

__all__ = ["LedgerReader"]

log = logging.getLogger("interlens.store")

# The stored parts of a schema-3 result's conversation, in the order ``_assemble`` takes them.
_V3_PARTS = "r.state_json, r.lineup_recipe, r.turn_order"


def _states(states: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(states)
    bad = [s for s in chosen if s not in JOB_STATES]
    if bad or not chosen:
        raise ValueError(f"states must be a non-empty selection of {JOB_STATES}, got {chosen!r}")
    return chosen


@reads_translated  # page damage (a malformed file) named with what to do, from every reading method
class LedgerReader:
    """Read-only view of a ledger: ``LedgerReader(out_dir)`` or ``LedgerReader(path/to/ledger.sqlite)``.

    Use as a context manager or call :meth:`close`. One reader may be used from any thread, but not from two
    threads at once.
    """

    def __init__(self, path_or_out_dir: str | os.PathLike[str]) -> None:
        path = Path(path_or_out_dir).expanduser()
        if path.is_dir():
            path = path / LEDGER_FILENAME
        if not path.is_file():
            raise LedgerNotFoundError(
                f"no ledger at {path}: point LedgerReader at a run's out_dir or its {LEDGER_FILENAME}"
            )
        version = check_existing(path, deep=False)
        if not version:
            raise LedgerNotFoundError(f"{path} is empty: no run has written to it yet")
        self.path = path
        self._version = version
        self._recipes: dict[str, str | None] = {}  # lineup → its recipe text (never changes once written)
        # A reader takes an older ledger as it is: columns it lacks read as NULL.
        self._job_columns = job_columns(version)
        self._stored_tokens = "stored_tokens" if version >= 7 else "NULL"  # schema 7: a local turn's marker
        self._j_columns = ", ".join(
            c if c == "NULL" else f"j.{c}" for c in (c.strip() for c in self._job_columns.split(","))
        )
        #: Jobs ``iter_results`` left out because a record of theirs does not parse (each also a warning).
        self.left_out: list[UnreadableRecordError] = []
        self._conn = sqlite3.connect(ro_uri(path), uri=True, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA busy_timeout = 5000")
        self._conn.execute("PRAGMA query_only = ON")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> LedgerReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        return self._conn.execute(sql, tuple(params)).fetchall()

    # ------------------------------------------------------------------------------------------------ jobs

    def done_job_ids(self) -> set[str]:
        """Ids of every done job (an index-only scan)."""
        return {r[0] for r in self._all("SELECT job_id FROM jobs WHERE state = 'done'")}

    def counts(self) -> dict[str, int]:
        """Number of jobs per state; every state is present."""
        rows = self._all("SELECT state, count(*) FROM jobs GROUP BY state")
        return {state: 0 for state in JOB_STATES} | {s: int(n) for s, n in rows}

    def job_ids(
        self,
        *,
        state: str | None = None,
        lineup: str | None = None,
        run: int | None = None,
        before_run: int | None = None,
    ) -> list[str]:
        """Job ids in job order (the order they were added), filtered by any of:

        ``state``; ``lineup``; ``run``: finished/failed by that run; ``before_run``: finished/failed by a run
        older than that one — with ``state="done"``, the jobs a run skipped because they were already done.
        """
        where: list[str] = []
        params: list[Any] = []
        if state is not None:
            where.append("state = ?")
            params.append(_states([state])[0])
        if lineup is not None:
            where.append("lineup = ?")
            params.append(lineup)
        if run is not None:
            where.append("run_id = ?")
            params.append(run)
        if before_run is not None:
            where.append("run_id < ?")
            params.append(before_run)
        sql = "SELECT job_id FROM jobs" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY seq"
        return [r[0] for r in self._all(sql, params)]

    def job(self, job_id: str) -> JobRecord | None:
        """The job row (state, attempts, device, timings, tokens, error, input fingerprint), or None."""
        rows = self._all(f"SELECT {self._job_columns} FROM jobs WHERE job_id = ?", (job_id,))
        return job_from_row(rows[0]) if rows else None

    def result(self, job_id: str, *, token_markers: bool = True) -> dict[str, Any] | None:
        """``{"conversation", "analysis", "tokens_generated"}`` of a finished job (or a failed one whose
        conversation was kept), else None. ``token_markers=False``: a local turn's message without the marker
        of its record (schema 7 stores it in the turns row, not the JSON: a reader that has no use for it,
        a plain export, is spared it; schema 5-6 ledgers keep theirs in the JSON)."""
        if self._version < 3:
            rows = self._all(
                "SELECT r.conversation_json, r.analysis_json, j.tokens_generated FROM results r "
                "JOIN jobs j ON j.job_id = r.job_id WHERE r.job_id = ?",
                (job_id,),
            )
            if not rows:
                return None
            with self._unreadable_as_error(job_id):
                return _result(json.loads(rows[0][0]), *rows[0][1:])
        with self._snapshot():
            rows = self._all(
                f"SELECT j.lineup, {_V3_PARTS}, r.analysis_json, j.tokens_generated FROM results r "
                "JOIN jobs j ON j.job_id = r.job_id WHERE r.job_id = ?",
                (job_id,),
            )
            if not rows:
                return None
            lineup, *stored, analysis, tokens = rows[0]
            turns, marked = self._result_turns([job_id], token_markers)
            with self._unreadable_as_error(job_id):
                conversation = self._assemble(lineup, stored, turns.get(job_id, {}), marked.get(job_id, ()))
                return _result(conversation, analysis, tokens)

    def iter_results(
        self, *, states: Iterable[str] = ("done", "failed"), page_size: int = 256, token_markers: bool = True
    ) -> Iterator[tuple[JobRecord, dict[str, Any] | None]]:
        """Lazily yield ``(job, result or None)`` in job order for jobs in ``states`` (``token_markers``: see
        :meth:`result`).

        Reads ``page_size`` rows per short read transaction, so memory stays flat and rows committed while
        iterating may appear in later pages.
        """
        chosen = _states(states)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        marks = ", ".join("?" * len(chosen))
        stored = "r.conversation_json, NULL, NULL" if self._version < 3 else _V3_PARTS
        sql = (
            f"SELECT j.seq, {self._j_columns}, r.job_id IS NOT NULL, {stored}, r.analysis_json FROM jobs j "
            f"LEFT JOIN results r ON r.job_id = j.job_id WHERE j.seq > ? AND +j.state IN ({marks}) "
            f"ORDER BY j.seq LIMIT ?"
        )
        # "+j.state" keeps SQLite off the state index: walking the rowid (job order) from the last key makes
        # each page cost O(page), where the index would re-sort every matching row for every page.
        last = -1
        while True:
            with self._snapshot():
                rows = self._all(sql, (last, *chosen, page_size))
                turns: dict[str, dict[int, str]] = {}
                marked: dict[str, set[int]] = {}
                if self._version >= 3:
                    turns, marked = self._result_turns([row[1] for row in rows if row[-5]], token_markers)
            for row in rows:
                job = job_from_row(row[1:-5])
                has_result, *parts, analysis = row[-5:]
                if not has_result:
                    yield job, None
                    continue
                try:
                    with self._unreadable_as_error(job.job_id):
                        if self._version < 3:
                            conversation = json.loads(parts[0])
                        else:
                            conversation = self._assemble(
                                job.lineup, parts, turns.get(job.job_id, {}), marked.get(job.job_id, ())
                            )
                        result = _result(conversation, analysis, job.tokens_generated)
                except UnreadableRecordError as exc:  # one job's loss: named, and the listing goes on
                    log.warning("%s; left out here", exc)
                    self.left_out.append(exc)
                    continue
                yield job, result
            if len(rows) < page_size:
                return
            last = rows[-1][0]

    @contextmanager
    def _unreadable_as_error(self, job_id: str) -> Iterator[None]:
        """A record of ``job_id`` that does not parse leaves as :class:`UnreadableRecordError` naming it."""
        try:
            yield
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            found = unreadable_records(self._conn, job_id=job_id)
            record = found[0] if found else UnreadableRecord(job_id, None)
            raise unreadable_error(record, self.path, exc) from exc

    def unreadable_records(self) -> list[UnreadableRecord]:
        """Every record that does not parse (one scan of turns and results; see ``_damage``)."""
        return unreadable_records(self._conn)

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        """Several reads that see one state of the file (a result and its turns rows are written together)."""
        self._conn.execute("BEGIN")
        try:
            yield
        finally:
            self._conn.execute("COMMIT")

    def _result_turns(
        self, job_ids: Sequence[str], token_markers: bool = True
    ) -> tuple[dict[str, dict[int, str]], dict[str, set[int]]]:
        """Every turns row (idx → text) of each of ``job_ids``, from which their transcripts are read, and
        per job the idx of those whose record is in ``turn_tokens`` (schema 7: their marker is not in the
        JSON; none without ``token_markers``)."""
        out: dict[str, dict[int, str]] = {}
        marked: dict[str, set[int]] = {}
        flag = self._stored_tokens if token_markers else "NULL"
        for marks, piece in chunks(job_ids):
            sql = f"SELECT job_id, idx, turn_json, {flag} FROM turns WHERE job_id IN ({marks})"
            for job_id, idx, text, flagged in self._all(sql, piece):
                out.setdefault(job_id, {})[int(idx)] = text
                if flagged:
                    marked.setdefault(job_id, set()).add(int(idx))
        return out, marked

    def _assemble(
        self, lineup: str, stored: Sequence[Any], turns: Mapping[int, str], marked: Container[int] = ()
    ) -> dict[str, Any]:
        state_json, lineup_recipe, turn_order = stored
        recipe = None
        if lineup_recipe:
            if lineup not in self._recipes:
                rows = self._all("SELECT describe_json FROM lineups WHERE name = ?", (lineup,))
                self._recipes[lineup] = rows[0][0] if rows else None
            recipe = self._recipes[lineup]
        return assemble(state_json, recipe, turn_order, turns, marked)

    def turns(self, job_id: str) -> list[dict[str, Any]]:
        """The turns a job committed as it ran, in index order: what a resumed attempt replays. A stored
        result's whole transcript (seeded context included) is in :meth:`result`."""
        return [record.turn for record in self.turn_records(job_id)]

    def turn_count(self, job_id: str) -> int:
        """How many turns ``job_id`` committed (counted, not read: a damaged one counts too)."""
        return int(self._all("SELECT count(*) FROM turns WHERE job_id = ? AND idx >= 0", (job_id,))[0][0])

    def turn_records(self, job_id: str) -> list[TurnRecord]:
        """Like :meth:`turns`, with index and commit time."""
        rows = self._all(
            f"SELECT idx, turn_json, committed_at, {self._stored_tokens} FROM turns "
            "WHERE job_id = ? AND idx >= 0 ORDER BY idx",
            (job_id,),
        )
        out = []
        for idx, text, at, flag in rows:
            turn = loads(text, record=UnreadableRecord(job_id, idx), path=self.path)
            out.append(TurnRecord(job_id, idx, put_marker(turn) if flag else turn, at))
        return out

    def result_tokens(self, job_id: str) -> list[dict[str, Any] | None] | None:
        """The token records of ``job_id``'s result transcript, one per message in order (None where a
        message has none in ``turn_tokens``), as their JSON was written: put them back in place of the markers
        with ``_token_rows.restore``. None when the job has no stored transcript. The only read of the
        ``turn_tokens`` table (schema 5; schema 6 rows may refer to the job's other rows, all read here):
        :meth:`result` and the listings leave it alone. A row that does not
        decode to the record its marker names raises :class:`UnreadableRecordError` naming the job and turn;
        the rest of the ledger reads."""
        if self._version < 5:
            return None  # an older ledger keeps its records in the turns' JSON: result() has them
        flag = "t.stored_tokens" if self._version >= 7 else "NULL"
        with self._snapshot():
            order = self._all("SELECT turn_order FROM results WHERE job_id = ?", (job_id,))
            if not order or order[0][0] is None:
                return None
            rows = self._all(
                f"SELECT t.idx, t.turn_json, {flag}, k.facts_json, k.ids, k.model_logprobs, "
                f"k.sampling_logprobs, k.prompt_ids FROM turns t LEFT JOIN {TOKENS_TABLE} k "
                "ON k.job_id = t.job_id AND k.idx = t.idx WHERE t.job_id = ? "
                f"AND (k.job_id IS NOT NULL OR {flag})",
                (job_id,),
            )
            keys = segments_of(row[3:] for row in rows if row[3] is not None)
            segments: dict[int, bytes] = {}
            for start in range(0, len(keys), 500):
                piece = keys[start : start + 500]
                sql = f"SELECT k, data FROM {STREAM_TABLE} WHERE k IN ({', '.join('?' * len(piece))})"
                segments.update((int(k), bytes(data)) for k, data in self._all(sql, piece))
        with self._unreadable_as_error(job_id):
            indices = json.loads(order[0][0])
        records: dict[int, dict[str, Any]] = {}
        whole = [
            (int(idx), text, flag, None if values[0] is None else filled(values, segments))
            for idx, text, flag, *values in rows
        ]
        sources = {idx: v[1] for idx, _, _, v in whole if v is not None and v[1] is not None}
        for idx, text, flag, values in sorted(whole, key=lambda row: row[0]):  # a source before its users
            record = UnreadableRecord(job_id, idx)
            marker = (loads(text, record=record, path=self.path).get("metadata") or {}).get(TOKENS_KEY)
            if marker is None and flag:
                marker = local_marker()
            if not is_marker(marker):
                continue  # re-recorded without a record: the JSON is what holds
            try:
                if values is None:
                    raise TokenRowError("its row is missing")
                records[idx] = join(marker, values, sources)
            except TokenRowError as exc:
                raise UnreadableRecordError(
                    f"{record.describe()} in {self.path}: its token record ({TOKENS_TABLE}) does not "
                    f"read: {exc}; the file was damaged there. The turn itself and the rest of the ledger "
                    "read (read the job without its tokens, or rerun it into another out_dir)",
                    job_id=job_id,
                    idx=idx,
                ) from exc
        return [records.get(idx) for idx in indices]

    def turn_values(self, json_path: str, *, without: Sequence[str] = ()) -> Iterator[Any]:
        """The JSON value at ``json_path`` (an SQLite JSON path such as ``'$.metadata.usage'``) of every
        stored message that has one, whichever job, state or run it belongs to (each message is stored once):
        a scan for totals (what a run spent) without reading whole transcripts. ``without``: paths inside
        that value left out in SQL, never parsed here (``'$.tokens'`` of ``'$.metadata'``: a token record's
        marker, or an older ledger's whole record, which no total needs)."""
        value = "json_extract(turn_json, ?)"
        if without:
            value = f"json_remove({value}, {', '.join('?' * len(without))})"
        sql = (  # a record that does not parse is skipped here (``unreadable_records`` names it)
            f"SELECT {value} FROM turns "
            "WHERE CASE WHEN json_valid(turn_json) THEN json_type(turn_json, ?) END IN ('object', 'array')"
        )
        for (text,) in self._conn.execute(sql, (json_path, *without, json_path)):
            yield json.loads(text)

    def result_values(self, json_path: str) -> Iterator[Any]:
        """The JSON value at ``json_path`` of every stored result's conversation state (what a result keeps
        besides its transcript and recipe) that has one: a scan like :meth:`turn_values`, for totals.

        Results a later one replaced are included (``superseded_results``, schema 4: say an analyzer failed
        with its conversation kept and a rerun redid it), so a total counts what every attempt recorded, not
        only the current result's. Everything else here (:meth:`result`, :meth:`iter_results`) reads the
        current result only. A version 1 or 2 ledger (read as it is) holds the whole conversation per result,
        and no replaced ones."""
        column = "state_json" if self._version >= 3 else "conversation_json"
        tables = ("results", "superseded_results") if self._version >= 4 else ("results",)
        sql = " UNION ALL ".join(
            f"SELECT json_extract({column}, ?) FROM {table} "
            f"WHERE CASE WHEN json_valid({column}) THEN json_type({column}, ?) END IN ('object', 'array')"
            for table in tables
        )
        for (text,) in self._conn.execute(sql, (json_path, json_path) * len(tables)):
            yield json.loads(text)

    # ------------------------------------------------------------------------------------------ runs, batches

    def runs(self) -> list[dict[str, Any]]:
        """Every run, oldest first: id, times, status, pid, host, versions and its lineups' fingerprints."""
        fingerprints: dict[int, dict[str, str]] = {}
        for run_id, lineup, fp in self._all("SELECT run_id, lineup, fingerprint FROM run_lineups"):
            fingerprints.setdefault(run_id, {})[lineup] = fp
        rows = self._all(
            "SELECT run_id, started_at, ended_at, status, pid, host, versions_json FROM runs ORDER BY run_id"
        )
        return [
            {
                "run_id": run_id,
                "started_at": started,
                "ended_at": ended,
                "status": status,
                "pid": pid,
                "host": host,
                "versions": json.loads(versions),
                "lineups": fingerprints.get(run_id, {}),
            }
            for run_id, started, ended, status, pid, host, versions in rows
        ]

    def last_write(self) -> float | None:
        """When the ledger last recorded progress (a job started or finished, a turn committed): where a run
        whose process died stopped working. None for a ledger without any."""
        rows = self._all(
            "SELECT max(coalesce(max(finished_at), 0), coalesce(max(started_at), 0)) FROM jobs "
            "UNION ALL SELECT coalesce(max(committed_at), 0) FROM turns"
        )
        latest = max((float(r[0]) for r in rows if r[0]), default=0.0)
        return latest or None

    def batches(self, *, open_only: bool = False) -> list[BatchRecord]:
        """Recorded provider batches (only those not yet terminal with ``open_only``), oldest first."""
        rows = self._all(
            "SELECT provider, batch_id, state, meta_json, created_at, updated_at FROM batches "
            "ORDER BY created_at, provider, batch_id"
        )
        # A version-1 file (read as it is, never migrated by a reader) has no request hashes: NULL for all.
        columns = {row[1] for row in self._all("PRAGMA table_info(batch_requests)")}
        digest = "request_hash" if "request_hash" in columns else "NULL"
        out = []
        for provider, batch_id, state, meta_json, created, updated in rows:
            if open_only and state in TERMINAL_BATCH_STATES:
                continue
            reqs = self._all(
                f"SELECT custom_id, job_id, turn_index, {digest} FROM batch_requests "
                "WHERE provider = ? AND batch_id = ?",
                (provider, batch_id),
            )
            requests = {cid: (job, int(turn)) for cid, job, turn, _ in reqs}
            hashes = {cid: value for cid, _, _, value in reqs}
            meta = json.loads(meta_json)
            out.append(BatchRecord(provider, batch_id, state, requests, meta, created, updated, hashes))
        return out

    def summary(self) -> dict[str, Any]:
        """Totals for a report header, read in one consistent snapshot."""
        self._conn.execute("BEGIN")
        try:
            by_lineup: dict[str, dict[str, Any]] = {}
            for name, fp in self._all("SELECT name, fingerprint FROM lineups ORDER BY name"):
                by_lineup[name] = {"fingerprint": fp, "counts": {s: 0 for s in JOB_STATES}}
            for lineup, state, n in self._all(
                "SELECT lineup, state, count(*) FROM jobs GROUP BY lineup, state"
            ):
                entry = by_lineup.setdefault(
                    lineup, {"fingerprint": None, "counts": {s: 0 for s in JOB_STATES}}
                )
                entry["counts"][state] = int(n)
            failures = dict(
                self._all(
                    "SELECT coalesce(error_type, '?'), count(*) FROM jobs WHERE state = 'failed' "
                    "GROUP BY 1 ORDER BY 2 DESC"
                )
            )
            tokens = self._all("SELECT coalesce(sum(tokens_generated), 0) FROM jobs")[0][0]
            runs = self.runs()
            open_batches = len(self.batches(open_only=True))
            counts = self.counts()
            superseded = 0  # results later ones replaced, kept for result_values (schema 4)
            if self._version >= 4:
                superseded = int(self._all("SELECT count(*) FROM superseded_results")[0][0])
        finally:
            self._conn.execute("COMMIT")
        return {
            "path": str(self.path),
            "schema_version": self._version,
            "jobs": sum(counts.values()),
            "counts": counts,
            "tokens_generated": int(tokens),
            "lineups": by_lineup,
            "failures_by_type": failures,
            "runs": len(runs),
            "last_run": runs[-1] if runs else None,
            "open_batches": open_batches,
            "superseded_results": superseded,
        }

    def integrity_check(self) -> str:
        """``"ok"``, or SQLite's description of the damage (``PRAGMA integrity_check``; reads every page)."""
        return "; ".join(r[0] for r in self._all("PRAGMA integrity_check(20)"))


def _result(conversation: dict[str, Any], analysis_json: str | None, tokens: int) -> dict[str, Any]:
    return {
        "conversation": conversation,
        "analysis": None if analysis_json is None else json.loads(analysis_json),
        "tokens_generated": int(tokens),
    }
