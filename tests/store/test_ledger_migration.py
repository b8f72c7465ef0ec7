"""An older ledger is brought up to date at open, never misread: a version-1 file (no job input fingerprints,
no batch request hashes) opens for writing with its jobs, turns and batches intact, the new columns empty,
and its ``user_version`` raised; a reader opens it as it is."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from interlens.store import SCHEMA_VERSION, BatchRecord, JobRecord, Ledger, LedgerReader


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


async def _version_1_ledger(out_dir: Path) -> Path:
    """A ledger as version 1 wrote it: today's file with version 2's columns dropped."""
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"pair": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"pair/row_{i}", "pair", seed=i) for i in range(3))
        await ledger.start_job("pair/row_0", device="cpu")
        await ledger.record_turn("pair/row_0", 0, {"role": "a", "content": "hello"})
        await ledger.record_batch(BatchRecord("openai", "batch_1", "in_progress", {"c0": ("pair/row_1", 0)}))
        await ledger.end_run("interrupted")
    path = out_dir / "ledger.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "ALTER TABLE jobs DROP COLUMN input_fp; ALTER TABLE batch_requests DROP COLUMN request_hash; "
        "PRAGMA user_version = 1;"
    )
    conn.close()
    return path


async def test_a_version_1_ledger_is_migrated_at_open_with_everything_kept(tmp_path: Path) -> None:
    path = await _version_1_ledger(tmp_path)
    with LedgerReader(tmp_path) as reader:  # a reader takes the old file as it is
        assert reader.job_ids() == ["pair/row_0", "pair/row_1", "pair/row_2"]

    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"pair": "fp"}, versions={})
        assert await ledger.committed_turns("pair/row_0") == [{"role": "a", "content": "hello"}]
        [batch] = await ledger.open_batches()
        assert batch.requests == {"c0": ("pair/row_1", 0)}
        await ledger.end_run("completed")

    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        assert "input_fp" in _columns(conn, "jobs")
        assert "request_hash" in _columns(conn, "batch_requests")
        assert conn.execute("SELECT count(*) FROM jobs WHERE input_fp IS NULL").fetchone()[0] == 3
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
