"""Starting a run: the recipe-fingerprint check that keeps two recipes from mixing under one job id.

A lineup's fingerprint is recorded the first time a run uses it. A later run that brings the same lineup
with another fingerprint is refused before anything is written, with the differences of the two recipe
summaries (``describe``) spelled out, because a silent mix of results from two recipes would corrupt every
statistic computed over the run directory. (Each job's own inputs — its data row, seed, mode — are compared
job by job by the caller, against ``jobs.input_fp``; this check is the recipe-level one that can say what
changed in the recipe.)

The refusal names how to start over in the caller's own words (``start_over``): the scheduler's users pass
``resume=False``, a direct user of :class:`~._ledger.Ledger` opens it with ``fresh=True``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._damage import rerun_unreadable
from ._diff import mismatch_line
from ._errors import FingerprintMismatchError
from ._group import Op
from ._json import SecretGuard, dumps

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["STORE_START_OVER", "begin_run_op", "check_lineups_op"]

#: How a direct user of the store starts a fresh ledger (callers with another API pass their own words).
STORE_START_OVER = "open the ledger with Ledger.open(out_dir, fresh=True)"


def _check_arguments(lineups: Mapping[str, str], describe: Mapping[str, Any] | None) -> dict[str, Any]:
    for name, fingerprint in lineups.items():
        if not isinstance(name, str) or not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(
                "lineups must map lineup names to non-empty fingerprint strings, "
                f"got {name!r}: {fingerprint!r}"
            )
    described = dict(describe or {})
    unknown = sorted(set(described) - set(lineups))
    if unknown:
        raise ValueError(f"describe has entries for lineups not in this run: {unknown}")
    return described


async def _refuse_changed_lineups(
    conn: aiosqlite.Connection,
    lineups: Mapping[str, str],
    describe: Mapping[str, Any],
    *,
    path: Path,
    start_over: str,
) -> None:
    rows = await conn.execute_fetchall("SELECT name, fingerprint, describe_json FROM lineups")
    recorded = {name: (fp, desc) for name, fp, desc in rows}
    problems = []
    for name, fingerprint in lineups.items():
        if name in recorded and recorded[name][0] != fingerprint:
            old_fp, old_desc = recorded[name]
            problems.append(
                mismatch_line(name, old_fp, fingerprint, json.loads(old_desc), describe.get(name))
            )
    if problems:
        raise FingerprintMismatchError(
            f"This run's recipe differs from the one recorded in {path} for the same job ids:\n"
            + "\n".join(problems)
            + f"\nResuming would mix results of two different recipes. To start over, {start_over}: the old "
            f"ledger is kept, moved aside to {path.parent}/ledger.<UTC timestamp>.sqlite. To keep both, use "
            "another out_dir or give the changed lineup a new name."
        )


def check_lineups_op(
    lineups: Mapping[str, str], describe: Mapping[str, Any] | None, *, path: Path, start_over: str
) -> Op:
    """The operation behind ``Ledger.check_lineups``: the refusal of ``begin_run``, without writing."""
    described = _check_arguments(lineups, describe)

    async def apply(conn: aiosqlite.Connection) -> None:
        await _refuse_changed_lineups(conn, lineups, described, path=path, start_over=start_over)

    return Op("check_lineups", apply=apply)


def begin_run_op(
    lineups: Mapping[str, str],
    versions: Mapping[str, str],
    describe: Mapping[str, Any] | None,
    *,
    path: Path,
    guard: SecretGuard,
    start_over: str = STORE_START_OVER,
) -> Op:
    """The operation behind ``Ledger.begin_run``; validates its arguments now, in the caller."""
    described = _check_arguments(lineups, describe)
    versions_json = dumps(dict(versions), what="the run's versions", guard=guard)
    describe_json = {
        name: dumps(described.get(name, {}), what=f"the recipe summary of lineup {name!r}", guard=guard)
        for name in lineups
    }

    async def apply(conn: aiosqlite.Connection) -> tuple[int, list[str]]:
        await _refuse_changed_lineups(conn, lineups, described, path=path, start_over=start_over)
        damaged = await rerun_unreadable(conn)  # jobs with a record that does not parse run again
        now = time.time()
        await conn.execute("UPDATE runs SET status = 'crashed' WHERE status = 'running'")
        run_rows = await conn.execute_fetchall(
            "INSERT INTO runs (started_at, status, pid, host, versions_json) "
            "VALUES (?, 'running', ?, ?, ?) RETURNING run_id",
            (now, os.getpid(), socket.gethostname(), versions_json),
        )
        run_id = int(next(iter(run_rows))[0])
        await conn.executemany(
            "INSERT OR IGNORE INTO lineups (name, fingerprint, describe_json, first_run) VALUES (?, ?, ?, ?)",
            [(name, fp, describe_json[name], run_id) for name, fp in lineups.items()],
        )
        await conn.executemany(
            "INSERT INTO run_lineups (run_id, lineup, fingerprint) VALUES (?, ?, ?)",
            [(run_id, name, fp) for name, fp in lineups.items()],
        )
        return run_id, damaged

    return Op("begin_run", apply=apply)
