"""A ledger with one damaged record (a malformed JSON value in a file SQLite still opens; issue #25): every
reader names the job and the record and goes on with the rest, and a rerun runs that job again from what still
reads, keeping everything else."""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from interlens import Conversation, ScriptedParticipant
from interlens.store import LedgerReader, UnreadableRecordError


def recipe() -> Conversation:
    a = ScriptedParticipant("a", lambda view: f"a says {view.own_turns} to {view.messages[0].content}")
    b = ScriptedParticipant("b", lambda view: f"b answers {view.own_turns}")
    return (
        Conversation([a, b], shared_context=("Topic ", _topic()))
        .turns(4)
        .data([{"t": t} for t in ("tabs", "spaces", "rust", "go")])
    )


def _topic() -> Any:
    from interlens import dataset_field

    return dataset_field("t")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlens", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "COLUMNS": "250"},
    )


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, dict[str, list[str]]]:
    """A finished run whose row_00001 lost turn 2 and row_00002 its result's state (a damaged write)."""
    out = tmp_path / "run"
    report = recipe().rollout(out_dir=out, progress=False)
    fresh = {job: [m.content for m in res.transcript] for job, res in report.results.items()}
    with sqlite3.connect(out / "ledger.sqlite") as db:
        db.execute(
            "UPDATE turns SET turn_json = substr(turn_json, 1, 17) WHERE job_id = 'row_00001' AND idx = 2"
        )
        db.execute("UPDATE results SET state_json = '{\"row\": {\"t\"' WHERE job_id = 'row_00002'")
    return out, fresh


@pytest.mark.floors
def test_readers_name_the_damaged_records_and_read_the_rest(
    damaged: tuple[Path, dict[str, list[str]]], caplog: pytest.LogCaptureFixture
) -> None:
    out, fresh = damaged
    with LedgerReader(out) as reader:
        assert [r.describe() for r in reader.unreadable_records()] == [
            "job 'row_00001''s turn 2",
            "job 'row_00002''s result",
        ]
        with pytest.raises(UnreadableRecordError, match=r"job 'row_00001''s turn 2 in .* is not valid JSON"):
            reader.result("row_00001")
        with pytest.raises(UnreadableRecordError, match="job 'row_00002''s result") as raised:
            reader.result("row_00002")
        assert (raised.value.job_id, raised.value.idx) == ("row_00002", None)
        with caplog.at_level(logging.WARNING, logger="interlens.store"):
            listed = {job.job_id: result for job, result in reader.iter_results()}
        assert sorted(listed) == ["row_00000", "row_00003"]  # the rest, whole
        assert [m["content"] for m in listed["row_00003"]["conversation"]["transcript"]] == fresh["row_00003"]
        assert [e.job_id for e in reader.left_out] == ["row_00001", "row_00002"]
        assert sum("left out here" in r.getMessage() for r in caplog.records) == 2
        assert len(list(reader.turn_values("$.metadata"))) == 4 * 5 - 1  # every message that reads (4 turns
        # and the shared context per job)

    status = cli("status", str(out))
    assert status.returncode == 0, status.stderr
    assert "unreadable: job 'row_00001''s turn 2 is not valid JSON" in status.stdout
    assert "unreadable: job 'row_00002''s result is not valid JSON" in status.stdout
    show = cli("show", str(out), "row_00001")
    assert (
        show.returncode == 2 and "job 'row_00001''s turn 2" in show.stderr and "Traceback" not in show.stderr
    )
    assert cli("show", str(out), "row_00000").returncode == 0
    exported = cli("export", str(out))
    assert exported.returncode == 0, exported.stderr
    assert sorted(json.loads(line)["job_id"] for line in exported.stdout.splitlines()) == [
        "row_00000",
        "row_00003",
    ]
    assert "row_00001" in exported.stderr and "row_00002" in exported.stderr  # said, not silently dropped
    report = cli("report", str(out), "-o", str(out / "report.html"))
    assert report.returncode == 0, report.stderr
    assert "row_00000" in (out / "report.html").read_text()


@pytest.mark.floors
def test_a_rerun_runs_the_damaged_jobs_again_from_what_still_reads(
    damaged: tuple[Path, dict[str, list[str]]], caplog: pytest.LogCaptureFixture
) -> None:
    out, fresh = damaged
    with sqlite3.connect(out / "ledger.sqlite") as db:
        finished = dict(db.execute("SELECT job_id, finished_at FROM jobs"))
        kept_turns = dict(
            db.execute("SELECT idx, committed_at FROM turns WHERE job_id = 'row_00001' AND idx IN (0, 1)")
        )
    with caplog.at_level(logging.WARNING, logger="interlens.store"):
        again = recipe().rollout(out_dir=out, progress=False)
    assert again.failed == [] and sorted(again.results) == sorted(fresh)
    assert {job: [m.content for m in res.transcript] for job, res in again.results.items()} == fresh
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "job 'row_00001' (turn 2 does not parse): runs again, its turns before turn 2 kept" in warned
    assert "job 'row_00002' (its result does not parse): runs again, its committed turns kept" in warned
    with sqlite3.connect(out / "ledger.sqlite") as db:
        now = dict(db.execute("SELECT job_id, finished_at FROM jobs"))
        assert {j: now[j] for j in ("row_00000", "row_00003")} == {
            j: finished[j] for j in ("row_00000", "row_00003")
        }
        assert now["row_00001"] > finished["row_00001"] and now["row_00002"] > finished["row_00002"]
        assert (
            dict(
                db.execute("SELECT idx, committed_at FROM turns WHERE job_id = 'row_00001' AND idx IN (0, 1)")
            )
            == kept_turns
        )  # replayed, not generated again
    with LedgerReader(out) as reader:
        assert reader.unreadable_records() == []


def test_page_damage_is_named_with_what_integrity_check_says_and_what_to_do(tmp_path: Path) -> None:
    """Garbage written over pages of the file (not one record's JSON): every command names the file, what
    SQLite's integrity check says and what to do, exit 2, no traceback; Python readers raise the store's
    LedgerCorruptError."""
    import os

    from interlens.store import LedgerCorruptError

    out = tmp_path / "run"
    words = ScriptedParticipant("a", lambda view: "word " * 60)
    Conversation([words]).turns(3).rollout(n=200, out_dir=out, progress=False)
    path = out / "ledger.sqlite"
    size = path.stat().st_size
    with open(path, "r+b") as fh:  # the middle half of the file, page-aligned: the header page stays
        fh.seek(size // 4 - size // 4 % 4096)
        fh.write(os.urandom(size // 2))
    for command in (["status", str(out)], ["export", str(out), "--format", "jsonl"], ["show", str(out), "x"]):
        result = cli(*command)
        assert result.returncode == 2, (command, result.stdout[-300:], result.stderr[-2000:])
        assert "Traceback" not in result.stderr and "is damaged below its records" in result.stderr
        assert str(path) in result.stderr.replace("\n", "") and "PRAGMA integrity_check" in result.stderr
        assert "resume=False" in result.stderr
    report = cli("report", str(out), "-o", str(tmp_path / "r.html"))
    assert report.returncode == 2 and "is damaged below its records" in report.stderr
    with LedgerReader(out) as reader:
        with pytest.raises(LedgerCorruptError, match="is damaged below its records"):
            reader.summary()
        with pytest.raises(LedgerCorruptError, match="is damaged below its records"):
            list(reader.iter_results())  # a generator: where its iteration meets the damage
