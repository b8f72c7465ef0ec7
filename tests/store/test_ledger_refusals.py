"""What the ledger refuses, and how it says so: a second writer, a changed recipe, a newer schema, a file
that is not a ledger, a credential. Every refusal names the problem and the way out, and leaves files as
they were."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from interlens.store import (
    BatchRecord,
    FingerprintMismatchError,
    JobRecord,
    Ledger,
    LedgerCorruptError,
    LedgerLockedError,
    LedgerNotFoundError,
    LedgerReader,
    LedgerSchemaError,
    StoreError,
)

_HOLDER = """
import sys, anyio
from interlens.store import Ledger

async def main():
    ledger = await Ledger.open(sys.argv[1])
    await ledger.begin_run({"lineup": "fp"}, versions={})
    print("locked", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)  # hold the lock until killed

anyio.run(main)
"""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def _make_ledger(
    out_dir: Path, *, fingerprint: str = "fp-1", describe: dict[str, object] | None = None
) -> None:
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"pair": fingerprint}, versions={}, describe={"pair": describe or {}})
        await ledger.add_jobs(JobRecord(f"pair/row_{i:03d}", "pair", seed=i) for i in range(300))
        await ledger.start_job("pair/row_000", device="cpu")
        await ledger.finish_job(
            "pair/row_000", conversation={"t": ["x" * 500]}, analysis=None, tokens_generated=1
        )
        await ledger.end_run("completed")


async def test_a_second_live_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    async with await Ledger.open(tmp_path):
        with pytest.raises(LedgerLockedError) as info:
            await Ledger.open(tmp_path)
        message = str(info.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "different out_dir" in message
    async with await Ledger.open(tmp_path):  # released on close
        pass


async def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(LedgerLockedError, match=f"pid {holder.pid} on host"):
            await Ledger.open(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    async with await Ledger.open(tmp_path) as ledger:  # the kernel dropped the dead process's flock
        await ledger.begin_run({"lineup": "fp"}, versions={})
    with LedgerReader(tmp_path) as reader:
        assert [r["status"] for r in reader.runs()] == ["crashed", "interrupted"]


async def test_a_changed_recipe_is_refused_with_what_differs_and_how_to_start_over(tmp_path: Path) -> None:
    old = {"turns": 6, "participants": [{"model": "qwen-0.5b", "temperature": 0.9}]}
    new = {"turns": 12, "participants": [{"model": "qwen-0.5b", "temperature": 0.7}]}
    await _make_ledger(tmp_path, fingerprint="fp-1", describe=old)
    async with await Ledger.open(tmp_path) as ledger:
        with pytest.raises(FingerprintMismatchError) as info:
            await ledger.begin_run({"pair": "fp-2", "solo": "fp-9"}, versions={}, describe={"pair": new})
        message = str(info.value)
        for expected in (
            "lineup 'pair'",
            "'fp-1'",
            "'fp-2'",
            "turns: 6 → 12",
            "participants[0].temperature: 0.9 → 0.7",
            "Ledger.open(out_dir, fresh=True)",  # the store's own way to start over, and no other
            f"{tmp_path}/ledger.<UTC timestamp>.sqlite",
        ):
            assert expected in message
        assert "qwen" not in message  # only what differs
        assert "resume=" not in message
        # A caller with its own option (the scheduler: resume=False) has the refusal name that one instead;
        # checking alone writes nothing either.
        with pytest.raises(FingerprintMismatchError, match="To start over, pass resume=False: ") as info:
            await ledger.check_lineups(
                {"pair": "fp-2"}, describe={"pair": new}, start_over="pass resume=False"
            )
        assert "fresh=True" not in str(info.value)
        # The same recipe (and a new lineup beside it) is fine.
        await ledger.begin_run({"pair": "fp-1", "solo": "fp-9"}, versions={})
    with LedgerReader(tmp_path) as reader:
        assert [r["status"] for r in reader.runs()] == [
            "completed",
            "interrupted",
        ]  # the refusal wrote nothing
        assert reader.summary()["lineups"]["solo"]["fingerprint"] == "fp-9"


async def test_fresh_start_moves_the_old_ledger_aside(tmp_path: Path) -> None:
    await _make_ledger(tmp_path, fingerprint="fp-1")
    async with await Ledger.open(tmp_path, fresh=True) as ledger:
        assert ledger.moved_aside is not None
        assert ledger.moved_aside.parent == tmp_path and ledger.moved_aside.name.startswith("ledger.")
        await ledger.begin_run({"pair": "fp-2"}, versions={})  # no mismatch: a new ledger
        assert await ledger.counts() == {"pending": 0, "running": 0, "done": 0, "failed": 0}
        moved = ledger.moved_aside
    with LedgerReader(moved) as old:  # nothing was lost
        assert old.done_job_ids() == {"pair/row_000"} and len(old.job_ids()) == 300
    async with await Ledger.open(tmp_path, fresh=True) as ledger:  # twice in one second: distinct names
        assert ledger.moved_aside is not None and ledger.moved_aside != moved
        assert ledger.moved_aside.exists()


async def test_a_ledger_from_a_newer_version_is_refused_untouched(tmp_path: Path) -> None:
    await _make_ledger(tmp_path)
    path = tmp_path / "ledger.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    before = _digest(path)
    with pytest.raises(LedgerSchemaError, match=r"schema version 99.*up to 7.*Upgrade interlens"):
        await Ledger.open(tmp_path)
    with pytest.raises(LedgerSchemaError):
        LedgerReader(tmp_path)
    assert _digest(path) == before
    async with await Ledger.open(tmp_path, fresh=True):  # the lock was released by the refusal
        pass


@pytest.mark.parametrize(
    "content",
    [b"this is a CSV file, not a database\n" * 20, b"SQLite format 3\x00" + b"\xff" * 4000],
    ids=["not-sqlite", "garbled-sqlite"],
)
async def test_a_file_that_is_not_a_ledger_is_refused_untouched(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(content)
    with pytest.raises(LedgerCorruptError, match=r"left untouched.*fresh=True"):
        await Ledger.open(tmp_path)
    with pytest.raises(LedgerCorruptError):
        LedgerReader(tmp_path)
    assert path.read_bytes() == content


async def test_a_damaged_ledger_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    await _make_ledger(tmp_path)
    path = tmp_path / "ledger.sqlite"
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page + 100 : 3 * page] = os.urandom(page - 100)  # scribble over a b-tree page
    path.write_bytes(bytes(data))
    with pytest.raises(LedgerCorruptError, match=r"is damaged|not a readable SQLite ledger"):
        await Ledger.open(tmp_path)
    assert path.read_bytes() == bytes(data)


async def test_another_applications_database_is_refused(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    with pytest.raises(LedgerCorruptError, match=r"not an interlens ledger.*invoices"):
        await Ledger.open(tmp_path)


async def test_bad_locations_and_arguments(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(StoreError, match="exists and is not a directory"):
        await Ledger.open(not_a_dir)
    with pytest.raises(ValueError, match="synchronous must be 'normal' or 'full'"):
        await Ledger.open(tmp_path, synchronous=cast(Any, "sometimes"))
    with pytest.raises(LedgerNotFoundError, match="no ledger at") as info:
        LedgerReader(tmp_path / "missing")
    assert isinstance(info.value, FileNotFoundError)
    async with await Ledger.open(tmp_path / "deep" / "run") as ledger:  # parents are created
        with pytest.raises(ValueError, match="describe has entries for lineups not in this run"):
            await ledger.begin_run({"a": "fp"}, versions={}, describe={"b": {}})


async def test_a_planted_api_key_never_reaches_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "sk-planted-" + hashlib.sha256(b"interlens").hexdigest()
    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-" + key[::-1])
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run(
            {"pair": "fp"}, versions={"openai": "3.57"}, describe={"pair": {"model": "gpt-x"}}
        )
        await ledger.add_jobs([JobRecord("a", "pair", seed=0), JobRecord("b", "pair", seed=1)])
        await ledger.start_job("a", device="cpu")
        await ledger.record_turn("a", 0, {"content": "hello"})
        # A key that leaked into a turn, a result or batch metadata is refused, named but never echoed.
        with pytest.raises(StoreError, match="OPENAI_API_KEY") as info:
            await ledger.record_turn("a", 1, {"content": f"my key is {key}"})
        assert key not in str(info.value)
        with pytest.raises(StoreError, match="ANTHROPIC_API_KEY"):
            await ledger.finish_job(
                "a",
                conversation={"repr": f"Client(api_key='sk-ant-{key[::-1]}')"},
                analysis=None,
                tokens_generated=1,
            )
        # A key in a failure's text is redacted instead: the job fails, the run goes on. In a result it kept
        # for the failed job, it is refused like any result.
        with pytest.raises(StoreError, match="OPENAI_API_KEY"):
            await ledger.fail_job(
                "b", error_type="E", message="", traceback="", conversation={"t": [f"key {key}"]}
            )
        await ledger.fail_job(
            "b", error_type="AuthenticationError", message=f"bad key {key}", traceback=f"at {key}\n"
        )
        with LedgerReader(tmp_path) as reader:  # a reader is fine while the writer is live
            failed = reader.job("b")
        assert failed is not None and failed.state == "failed"
        assert (failed.error_message, failed.traceback) == (
            "bad key [redacted:OPENAI_API_KEY]",
            "at [redacted:OPENAI_API_KEY]\n",
        )
        with pytest.raises(StoreError, match=r"'api_key' field"):
            await ledger.record_batch(
                BatchRecord("openai", "b1", "in_progress", meta={"headers": {"api_key": "x"}})
            )
        await ledger.finish_job("a", conversation={"t": ["hello"]}, analysis=None, tokens_generated=1)
        files = sorted(tmp_path.iterdir())  # while open: ledger, -wal, -shm, lock
        assert {f.name for f in files} >= {"ledger.sqlite", "ledger.sqlite-wal", "ledger.lock"}
        for path in files:
            data = path.read_bytes()
            assert key.encode() not in data and key[::-1].encode() not in data, path
    for path in tmp_path.iterdir():
        assert key.encode() not in path.read_bytes(), path
