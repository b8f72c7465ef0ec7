"""``report.branch(at_turn=k)`` (issue 39): recorded jobs as branch points, expanded into continuations that
say where they come from, resumable, refused clearly where a point cannot be taken. Scripted participants
here (what a branch carries and records); exact replay on real models is in ``test_branch_models.py``."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import interlens
from interlens import (
    BranchError,
    ConfigurationError,
    Conversation,
    FingerprintMismatchError,
    RunReport,
    ScriptedParticipant,
    View,
)
from interlens.store import LedgerReader


def _debate(turns: int = 4, *, tag: str = "") -> Conversation:
    """Two speakers whose replies are a list (so a ledger's recipe rebuilds) and one that counts."""
    a = ScriptedParticipant("a", [f"a-one{tag}", f"a-two{tag}", f"a-three{tag}"])
    b = ScriptedParticipant("b", [f"b-one{tag}", f"b-two{tag}", f"b-three{tag}"])
    return Conversation(participants=[a, b], shared_context="Q").turns(turns)


def _texts(report: RunReport, job_id: str) -> list[str]:
    transcript = report.results[job_id].transcript
    assert transcript is not None
    return [m.content for m in transcript]


def _counting(view: View) -> str:
    return f"saw {len(view.messages)}"


@pytest.fixture
def parent(tmp_path: Path) -> RunReport:
    report = _debate().rollout(n=3, out_dir=tmp_path / "parent", seed=10, progress=False)
    assert report.failed == []
    return report


def test_each_job_becomes_n_continuations_that_say_where_they_come_from(
    parent: RunReport, tmp_path: Path
) -> None:
    branches = parent.branch(at_turn=2).turns(5)
    report = branches.rollout(n=2, out_dir=tmp_path / "branches", progress=False)
    assert report.failed == []
    assert sorted(report.results) == [f"rollout_{j:04d}@2/s{s:04d}" for j in range(3) for s in range(2)]
    # continuation s of job j draws from seed_j + s (parent j's seed: 10 + j)
    assert {jid: r.seed for jid, r in report.results.items()} == {
        f"rollout_{j:04d}@2/s{s:04d}": 10 + j + s for j in range(3) for s in range(2)
    }
    texts = _texts(report, "rollout_0001@2/s0001")
    assert texts[:3] == _texts(parent, "rollout_0001")[:3] == ["Q", "a-one", "b-one"]
    assert texts[3:] == ["a-two", "b-two", "a-three"]  # three more turns: .turns(5) in all
    result = report.results["rollout_0001@2/s0001"]
    assert result.tokens_generated == 9  # its 3 turns of 3 tokens ("a", "-", "two"): not the recorded 2
    with LedgerReader(tmp_path / "branches") as reader:
        stored = reader.result("rollout_0001@2/s0001")
        assert stored is not None
        assert stored["conversation"]["parent"] == {
            "out_dir": str(tmp_path / "parent"),
            "job_id": "rollout_0001",
            "turn": 2,
        }
        assert reader.turn_count("rollout_0001@2/s0001") == 3  # only its own turns are committed turns


def test_seed_given_overrides_the_parents_streams(parent: RunReport) -> None:
    report = parent.branch(at_turn=1, jobs=["rollout_0002"]).rollout(n=3, seed=100, progress=False)
    assert [r.seed for r in report.results.values()] == [100, 101, 102]


def test_a_ledger_alone_branches_and_a_branch_of_a_branch_is_a_chain(
    parent: RunReport, tmp_path: Path
) -> None:
    loaded = RunReport.load(tmp_path / "parent")
    assert sorted(loaded.results) == ["rollout_0000", "rollout_0001", "rollout_0002"]
    first = loaded.branch(at_turn=1, jobs=["rollout_0000"]).rollout(out_dir=tmp_path / "b1", progress=False)
    assert list(first.results) == ["rollout_0000@1/s0000"]
    with LedgerReader(tmp_path / "b1") as reader:  # the ledger reader's way in: RunReport.load(reader)
        again = RunReport.load(reader)
    second = again.branch(at_turn=3).rollout(out_dir=tmp_path / "b2", progress=False)
    job = "rollout_0000@1/s0000@3/s0000"
    assert list(second.results) == [job]
    assert _texts(second, job) == _texts(parent, "rollout_0000")
    with LedgerReader(tmp_path / "b2") as reader:
        stored = reader.result(job)
    assert stored is not None
    assert stored["conversation"]["parent"]["job_id"] == "rollout_0000@1/s0000"  # and that one's parent:
    with LedgerReader(tmp_path / "b1") as reader:
        stored = reader.result("rollout_0000@1/s0000")
    assert stored is not None and stored["conversation"]["parent"]["job_id"] == "rollout_0000"


VOICE = {"word": "yes"}


def _voice(view: View) -> str:
    return f"{VOICE['word']} {len(view.messages)}"


def test_a_rerun_skips_finished_branches_and_a_changed_parent_is_refused(tmp_path: Path) -> None:
    recipe = Conversation(participants=[ScriptedParticipant("a", _voice)], shared_context="Q").turns(3)
    parent = recipe.rollout(n=2, out_dir=tmp_path / "parent", progress=False)
    out = tmp_path / "branches"
    first = parent.branch(at_turn=2).rollout(n=2, out_dir=out, progress=False)
    assert first.skipped == []
    again = RunReport.load(tmp_path / "parent", conversations=recipe).branch(at_turn=2)
    assert sorted(again.rollout(n=2, out_dir=out, progress=False).skipped) == sorted(first.results)
    # the same recipe, rerun over the parent's ledger, said other things: its branch points moved
    VOICE["word"] = "no"
    try:
        changed = recipe.rollout(n=2, out_dir=tmp_path / "parent", resume=False, progress=False)
    finally:
        VOICE["word"] = "yes"
    before = sqlite3.connect(out / "ledger.sqlite").execute("SELECT count(*) FROM jobs").fetchone()
    with pytest.raises(FingerprintMismatchError) as excinfo:
        changed.branch(at_turn=2).rollout(n=2, out_dir=out, progress=False)
    message = str(excinfo.value)
    assert "the turns the conversation started from changed" in message
    assert "its parent's recorded turns" in message
    assert sqlite3.connect(out / "ledger.sqlite").execute("SELECT count(*) FROM jobs").fetchone() == before


def test_bad_branch_points_are_refused_before_anything_runs(parent: RunReport, tmp_path: Path) -> None:
    with pytest.raises(BranchError, match=r"job 'rollout_0001' has 4 generated turn\(s\).*at_turn <= 4"):
        parent.branch(at_turn=5, jobs=["rollout_0001"])
    with pytest.raises(BranchError, match=r"no job 'rollout_0009'.*did you mean"):
        parent.branch(at_turn=1, jobs=["rollout_0009"])
    with pytest.raises(BranchError, match="at_turn='end'"):
        parent.branch(at_turn=-1)
    with pytest.raises(BranchError, match="n is how many continuations"):
        parent.branch(at_turn=1, n=0)
    with pytest.raises(BranchError, match=r"lineup 'rollout'.*not the recipe that wrote the ledger"):
        RunReport.load(tmp_path / "parent", conversations=_debate(turns=6))


def test_a_job_that_failed_before_the_turn_is_named(tmp_path: Path) -> None:
    def fails_on_row_1(view: View) -> str:
        if "row 1" in view.messages[0].content:
            raise RuntimeError("broken row")
        return "fine"

    conv = Conversation(
        participants=[ScriptedParticipant("a", fails_on_row_1)], shared_context=lambda row: f"row {row['i']}"
    ).turns(2)
    report = conv.data([{"i": 0}, {"i": 1}]).rollout(out_dir=tmp_path, max_attempts=1, progress=False)
    assert report.failed == ["row_00001"]
    assert list(report.branch(at_turn=1).rollout(progress=False).results) == ["row_00000@1/s0000"]
    failed = r"job 'row_00001' failed \(RuntimeError: broken row\).*leave it out"
    with pytest.raises(BranchError, match=failed):
        report.branch(at_turn=1, jobs=["row_00001"])


def test_at_the_end_a_new_analyzer_measures_what_was_recorded_generating_nothing(
    parent: RunReport, tmp_path: Path
) -> None:
    def count(conv: Conversation) -> dict[str, Any]:
        return {"turns": conv.generated_turns, "last": conv.transcript[-1].content}

    report = parent.branch(at_turn="end").analyzer(count).rollout(out_dir=tmp_path / "again", progress=False)
    assert report.failed == []
    assert report.analyses() == {f"rollout_{j:04d}@4/s0000": {"turns": 4, "last": "b-two"} for j in range(3)}
    assert all(r.tokens_generated == 0 for r in report.results.values())
    conn = sqlite3.connect(tmp_path / "again" / "ledger.sqlite")
    try:
        assert conn.execute("SELECT count(*) FROM turns WHERE idx >= 0").fetchone() == (0,)
    finally:
        conn.close()


def test_two_lineups_of_one_run_pair_their_continuations(parent: RunReport) -> None:
    base = parent.branch(at_turn=2, jobs=["rollout_0000", "rollout_0001"])
    other = base.set(participants=[base.participants[0], ScriptedParticipant("b", _counting)])
    report = interlens.run([base.name("base"), other.name("other")], progress=False)
    assert sorted(report.results) == [
        f"{lineup}/rollout_{j:04d}@2/s0000" for lineup in ("base", "other") for j in range(2)
    ]
    for j in range(2):
        pair = [report.results[f"{lineup}/rollout_{j:04d}@2/s0000"] for lineup in ("base", "other")]
        assert pair[0].seed == pair[1].seed == 10 + j  # paired: the same random streams
    assert _texts(report, "other/rollout_0000@2/s0000")[3:] == ["a-two", "saw 4"]


def test_lineage_is_shown_by_export_show_and_the_html_report(parent: RunReport, tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    report = parent.branch(at_turn=2, jobs=["rollout_0000"]).rollout(out_dir=tmp_path / "b", progress=False)
    where = f"rollout_0000@2 in {tmp_path / 'parent'}"
    frame = report.to_pandas()
    assert frame["parent"].tolist() == [where]
    assert json.loads(frame["transcript"][0])[1]["content"] == "a-one"
    assert parent.to_pandas()["parent"].tolist() == [None, None, None]
    env = {**os.environ, "COLUMNS": "300"}
    env.pop("FORCE_COLOR", None)
    shown = subprocess.run(
        [sys.executable, "-m", "interlens", "show", str(tmp_path / "b"), "rollout_0000@2/s0000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    assert f"branched from {where}: its first 2 turn(s) are the parent's" in shown
    page = report.to_html(tmp_path / "report.html").read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert match is not None
    assert [job["parent"] for job in json.loads(match[1])["jobs"]] == [where]
    assert '"branched from " + job.parent' in page


def test_a_recipe_json_cannot_bring_back_is_asked_for_by_name(tmp_path: Path) -> None:
    def closure_analyzer(conv: Conversation) -> int:
        return conv.generated_turns

    recipe = _debate().analyzer(closure_analyzer)
    recipe.rollout(n=1, out_dir=tmp_path, progress=False)
    loaded = RunReport.load(tmp_path)
    with pytest.raises(ConfigurationError, match=r"lineup 'rollout'.*conversations=\{'rollout': conv\}"):
        loaded.branch(at_turn=1)
    again = (
        RunReport.load(tmp_path, conversations={"rollout": recipe}).branch(at_turn=1).rollout(progress=False)
    )
    assert again.analyses() == {"rollout_0000@1/s0000": 4}
    with pytest.raises(ConfigurationError, match="has no lineup 'other'"):
        RunReport.load(tmp_path, conversations={"other": recipe})
