"""A rerun never returns the answer of another question (issue #9).

Job ids are positional (``row_00000`` is the first row of whatever data a run brings), so each job is recorded
with the fingerprint of what it is asked — data row, resolved prompts, seed, execution mode, participants'
settings — and a rerun into the same out_dir resumes a recorded job only when that matches. Otherwise the run
is refused before any job starts, saying which jobs changed and how, and how to get out (another out_dir, or
``resume=False``). New jobs (a grown ``n``, appended rows) just run.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from ledger_testkit import as_schema

import interlens
from interlens import (
    AutoModelParticipant,
    ConfigurationError,
    Conversation,
    FingerprintMismatchError,
    InterlensError,
    ScriptedParticipant,
    View,
    dataset_field,
)
from interlens.store import LedgerReader

_TABLES = ("runs", "lineups", "run_lineups", "jobs", "turns", "results")


def _snapshot(out_dir: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the ledger's tables (attempts, states, turns, results, runs) to compare before/after."""
    conn = sqlite3.connect(out_dir / "ledger.sqlite")
    try:
        return {table: sorted(conn.execute(f"SELECT * FROM {table}").fetchall()) for table in _TABLES}
    finally:
        conn.close()


class Answerer:
    """A scripted solver that answers what its shared context asks, and logs every turn it generates."""

    def __init__(self) -> None:
        # in the order asked; jobs run at once (a scripted callable runs in a thread of its own), so the
        # tests compare what was asked, not the order across jobs
        self.asked: list[str] = []

    def reply(self, view: View) -> str:
        question = view.messages[0].content
        self.asked.append(question)
        if question == "FAIL":
            raise RuntimeError("this row breaks the solver")
        return f"answer to {question}"


def _quiz(answerer: Answerer, rows: Any) -> Conversation:
    solver = ScriptedParticipant("solver", answerer.reply)
    return Conversation(participants=[solver], shared_context=dataset_field("q")).turns(1).data(rows)


def _rows(*questions: str) -> list[dict[str, str]]:
    return [{"q": q} for q in questions]


def _ran(report: interlens.RunReport) -> list[str]:
    """The jobs this run ran (neither skipped as done nor failed)."""
    return [job_id for job_id in report.results if job_id not in report.skipped + report.failed]


def _refusal(excinfo: pytest.ExceptionInfo[FingerprintMismatchError]) -> str:
    message = str(excinfo.value)
    assert "resume=False" in message and "another out_dir" in message  # the two ways out
    assert "fresh=True" not in message  # rollout takes no such option
    return message


# ------------------------------------------------------------------------------------------- data, seed


def test_rerun_with_other_data_is_refused_before_any_job_starts(tmp_path: Path) -> None:
    first = Answerer()
    report = _quiz(first, _rows("A0", "A1", "A2")).rollout(out_dir=tmp_path, progress=False)
    assert report.counts["done"] == 3
    before = _snapshot(tmp_path)

    again = Answerer()
    with pytest.raises(FingerprintMismatchError) as excinfo:
        _quiz(again, _rows("B0", "A1", "B2", "B3")).rollout(out_dir=tmp_path, progress=False)
    message = _refusal(excinfo)
    assert "2 jobs already recorded" in message
    assert "- row_00000: row content changed: now {'q': 'B0'}" in message
    assert "- row_00002: row content changed: now {'q': 'B2'}" in message
    assert "row_00001" not in message and "row_00003" not in message  # same row, and a new one
    assert "Nothing was run" in message
    assert again.asked == []  # no job started, not even the unchanged or the new one
    assert _snapshot(tmp_path) == before  # no attempt counted, no run recorded: the ledger as it was
    # Caught as either class, like every translated ledger error.
    assert isinstance(excinfo.value, InterlensError | interlens.store.FingerprintMismatchError)


def test_rerun_with_another_seed_is_refused(tmp_path: Path) -> None:
    _quiz(Answerer(), _rows("A0", "A1")).rollout(out_dir=tmp_path, seed=0, progress=False)
    before = _snapshot(tmp_path)
    again = Answerer()
    with pytest.raises(FingerprintMismatchError) as excinfo:
        _quiz(again, _rows("A0", "A1")).rollout(out_dir=tmp_path, seed=5, progress=False)
    message = _refusal(excinfo)
    assert "- row_00000: seed: 0 → 5" in message and "- row_00001: seed: 1 → 6" in message
    assert "row content" not in message
    assert again.asked == [] and _snapshot(tmp_path) == before


def test_sample_rerun_with_another_seed_or_mode_is_refused(tmp_path: Path) -> None:
    answerer = Answerer()
    conv = Conversation(
        participants=[ScriptedParticipant("solver", answerer.reply)], shared_context="Tabs or spaces?"
    ).turns(1)
    conv.rollout(n=3, out_dir=tmp_path, progress=False)
    before = _snapshot(tmp_path)
    with pytest.raises(FingerprintMismatchError) as excinfo:
        conv.rollout(n=3, out_dir=tmp_path, seed=1, progress=False)
    assert "- rollout_0000: seed: 0 → 1" in _refusal(excinfo)
    with pytest.raises(FingerprintMismatchError) as excinfo:
        conv.rollout(n=3, out_dir=tmp_path, batched=False, progress=False)
    message = _refusal(excinfo)
    assert "3 jobs already recorded" in message
    assert "- rollout_0002: mode: batched → deterministic" in message
    assert len(answerer.asked) == 3 and _snapshot(tmp_path) == before


def test_a_failed_job_asked_something_else_is_refused_too(tmp_path: Path) -> None:
    first = Answerer()
    report = _quiz(first, _rows("A0", "FAIL")).rollout(out_dir=tmp_path, progress=False)
    assert report.failed == ["row_00001"]
    before = _snapshot(tmp_path)
    again = Answerer()
    with pytest.raises(FingerprintMismatchError) as excinfo:
        _quiz(again, _rows("A0", "A1")).rollout(out_dir=tmp_path, progress=False)
    assert "- row_00001: row content changed: now {'q': 'A1'}" in _refusal(excinfo)
    assert again.asked == [] and _snapshot(tmp_path) == before


# --------------------------------------------------------------------------------- what still resumes


def test_same_inputs_skip_every_job(tmp_path: Path) -> None:
    first = _quiz(Answerer(), _rows("A0", "A1", "A2")).rollout(out_dir=tmp_path, progress=False)
    again = Answerer()
    report = _quiz(again, _rows("A0", "A1", "A2")).rollout(out_dir=tmp_path, progress=False)
    assert report.skipped == ["row_00000", "row_00001", "row_00002"] and again.asked == []
    assert report.results["row_00002"].transcript == first.results["row_00002"].transcript
    with LedgerReader(tmp_path) as reader:
        assert all(reader.job(job_id).attempts == 1 for job_id in reader.job_ids())


def test_growing_n_and_appending_rows_run_only_the_new_jobs(tmp_path: Path) -> None:
    answerer = Answerer()
    conv = Conversation(
        participants=[ScriptedParticipant("solver", answerer.reply)], shared_context="Tabs or spaces?"
    ).turns(1)
    conv.rollout(n=2, out_dir=tmp_path / "samples", progress=False)
    grown = conv.rollout(n=4, out_dir=tmp_path / "samples", progress=False)
    assert grown.skipped == ["rollout_0000", "rollout_0001"]
    assert _ran(grown) == ["rollout_0002", "rollout_0003"] and len(answerer.asked) == 4
    assert [grown.results[j].seed for j in grown.results] == [0, 1, 2, 3]

    rows = Answerer()
    _quiz(rows, _rows("A0", "A1")).rollout(out_dir=tmp_path / "rows", progress=False)
    appended = Answerer()
    report = _quiz(appended, _rows("A0", "A1", "A2", "A3")).rollout(out_dir=tmp_path / "rows", progress=False)
    assert report.skipped == ["row_00000", "row_00001"] and _ran(report) == ["row_00002", "row_00003"]
    assert sorted(appended.asked) == sorted(["A2", "A3"])
    # Fewer rows than recorded is fine too: the run is the rows it brings.
    fewer = _quiz(Answerer(), _rows("A0")).rollout(out_dir=tmp_path / "rows", progress=False)
    assert list(fewer.results) == ["row_00000"] and fewer.skipped == ["row_00000"]


def test_resume_false_runs_the_new_question_and_keeps_the_old_ledger(tmp_path: Path) -> None:
    _quiz(Answerer(), _rows("A0", "A1")).rollout(out_dir=tmp_path, progress=False)
    again = Answerer()
    report = _quiz(again, _rows("B0", "B1")).rollout(out_dir=tmp_path, resume=False, progress=False)
    assert report.skipped == [] and sorted(again.asked) == sorted(["B0", "B1"])
    assert report.results["row_00000"].transcript[-1].content == "answer to B0"
    [old] = tmp_path.glob("ledger.*.sqlite")  # moved aside, not deleted
    with LedgerReader(old) as reader:
        assert reader.result("row_00000")["conversation"]["transcript"][-1]["content"] == "answer to A0"


def test_a_changed_recipe_names_resume_false_not_fresh_true(tmp_path: Path) -> None:
    _quiz(Answerer(), _rows("A0")).rollout(out_dir=tmp_path, progress=False)
    with pytest.raises(FingerprintMismatchError) as excinfo:
        _quiz(Answerer(), _rows("A0")).turns(2).rollout(out_dir=tmp_path, progress=False)
    message = str(excinfo.value)
    assert "turns: 1 → 2" in message and "pass resume=False" in message and "fresh=True" not in message


def test_a_ledger_that_did_not_record_inputs_is_refused(tmp_path: Path) -> None:
    """A ledger written before job fingerprints existed (schema 1) cannot say what its jobs were asked."""
    _quiz(Answerer(), _rows("A0", "A1")).rollout(out_dir=tmp_path, progress=False)
    as_schema(tmp_path / "ledger.sqlite", 1)
    again = Answerer()
    with pytest.raises(FingerprintMismatchError) as excinfo:
        _quiz(again, _rows("A0", "A1")).rollout(out_dir=tmp_path, progress=False)
    message = _refusal(excinfo)
    assert "- row_00000: what it was asked was not recorded" in message
    assert "older interlens (ledger schema 1)" in message
    assert again.asked == []
    with LedgerReader(tmp_path) as reader:  # migrated, but no job touched
        assert reader.counts()["done"] == 2 and len(reader.runs()) == 1
        assert all(reader.job(job_id).attempts == 1 for job_id in reader.job_ids())
    report = _quiz(again, _rows("A0", "A1")).rollout(out_dir=tmp_path, resume=False, progress=False)
    assert _ran(report) == ["row_00000", "row_00001"] and sorted(again.asked) == sorted(["A0", "A1"])


@pytest.mark.floors
def test_datasets_are_read_again_and_a_changed_row_is_refused_before_anything_runs(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    for kind in ("dataset", "iterable"):

        def data(questions: list[str], kind: str = kind) -> Any:
            ds = datasets.Dataset.from_list(_rows(*questions))
            return ds if kind == "dataset" else ds.to_iterable_dataset()

        out_dir = tmp_path / kind
        _quiz(Answerer(), data(["A0", "FAIL", "A2"])).rollout(out_dir=out_dir, progress=False)
        before = _snapshot(out_dir)
        again = Answerer()
        with pytest.raises(FingerprintMismatchError) as excinfo:
            _quiz(again, data(["A0", "FAIL", "B2"])).rollout(out_dir=out_dir, progress=False)
        assert "- row_00002: row content changed: now {'q': 'B2'}" in _refusal(excinfo)
        assert again.asked == [] and _snapshot(out_dir) == before  # not even the failed row 1 was retried
        report = _quiz(again, data(["A0", "FAIL", "A2", "A3"])).rollout(out_dir=out_dir, progress=False)
        assert report.skipped == ["row_00000", "row_00002"] and sorted(again.asked) == sorted(
            ["FAIL", "A3"]
        ), kind


# ---------------------------------------------------------------------------------- one-shot iterators


def test_a_generator_feeds_one_rollout_and_the_second_is_refused(tmp_path: Path) -> None:
    answerer = Answerer()
    conv = _quiz(answerer, (row for row in _rows("A0", "A1")))
    assert _ran(conv.rollout(progress=False)) == ["row_00000", "row_00001"]
    for again in (conv, conv.turns(2)):  # a copy shares the (consumed) iterator
        with pytest.raises(ConfigurationError) as excinfo:
            again.rollout(progress=False)
        message = str(excinfo.value)
        assert ".data()" in message and "read only once" in message
        assert "a list, a datasets.Dataset or IterableDataset, or a zero-argument callable" in message
    assert sorted(answerer.asked) == sorted(["A0", "A1"])
    # Two lineups of one run cannot share one either: the second would get what the first left.
    shared = (row for row in _rows("A0", "A1"))
    with pytest.raises(ConfigurationError, match=r"\.data\(\)"):
        interlens.run([_quiz(answerer, shared).name("x"), _quiz(answerer, shared).name("y")])
    assert sorted(answerer.asked) == sorted(["A0", "A1"])


def test_a_callable_makes_fresh_rows_for_every_rollout(tmp_path: Path) -> None:
    questions = ["A0", "A1", "A2"]

    def rows():  # a generator function: each call is a fresh iterator
        for q in questions:
            yield {"q": q}

    answerer = Answerer()
    conv = _quiz(answerer, rows)
    assert _ran(conv.rollout(progress=False)) == ["row_00000", "row_00001", "row_00002"]
    assert _ran(conv.rollout(out_dir=tmp_path, progress=False)) == ["row_00000", "row_00001", "row_00002"]
    assert conv.rollout(out_dir=tmp_path, progress=False).skipped == ["row_00000", "row_00001", "row_00002"]
    assert sorted(answerer.asked) == sorted(questions * 2)
    # Read twice on resume, so a changed row is refused before anything runs.
    questions[1] = "B1"
    with pytest.raises(FingerprintMismatchError, match=r"row_00001: row content changed: now \{'q': 'B1'\}"):
        conv.rollout(out_dir=tmp_path, progress=False)
    assert sorted(answerer.asked) == sorted(["A0", "A1", "A2"] * 2)  # the refused run asked nothing
    with pytest.raises(ConfigurationError, match=r"callable given to \.data\(\) must return an iterable"):
        _quiz(answerer, lambda: 42).rollout(progress=False)


def test_a_one_shot_iterator_is_compared_as_pulled_and_stops_before_the_changed_job(tmp_path: Path) -> None:
    first = Answerer()
    _quiz(first, iter(_rows("A0", "FAIL", "A2", "A3"))).rollout(out_dir=tmp_path, progress=False)
    before = _snapshot(tmp_path)
    again = Answerer()
    with pytest.raises(FingerprintMismatchError) as excinfo:
        _quiz(again, iter(_rows("A0", "FAIL", "A2", "B3", "A4"))).rollout(out_dir=tmp_path, progress=False)
    message = _refusal(excinfo)
    assert "1 job already recorded" in message
    assert "- row_00003: row content changed: now {'q': 'B3'}" in message
    assert "can be read only once" in message
    assert "B3" not in again.asked and "A4" not in again.asked  # the changed job never started
    with LedgerReader(tmp_path) as reader:
        job = reader.job("row_00003")
        assert job is not None and job.state == "done" and job.attempts == 1
        assert reader.result("row_00003")["conversation"]["transcript"][-1]["content"] == "answer to A3"
    assert {t: rows for t, rows in _snapshot(tmp_path).items() if t in ("turns", "results")} == {
        t: rows for t, rows in before.items() if t in ("turns", "results")
    }


# -------------------------------------------------------------------------------------- a real model


def test_model_rerun_with_another_mode_or_temperature_is_refused(qwen2_path: str, tmp_path: Path) -> None:
    def debate(**settings: Any) -> Conversation:
        a = AutoModelParticipant.from_pretrained(qwen2_path, name="a", max_new_tokens=4, **settings)
        return Conversation(participants=[a], shared_context="Tabs or spaces?").turns(1)

    first = debate(temperature=0.9).rollout(n=2, devices=["cpu"], out_dir=tmp_path, progress=False)
    assert _ran(first) == ["rollout_0000", "rollout_0001"]
    before = _snapshot(tmp_path)
    with pytest.raises(FingerprintMismatchError) as excinfo:
        debate(temperature=0.9).rollout(n=2, devices=["cpu"], out_dir=tmp_path, batched=False, progress=False)
    assert "- rollout_0001: mode: batched → deterministic" in _refusal(excinfo)
    with pytest.raises(FingerprintMismatchError) as excinfo:
        debate(temperature=0.7).rollout(n=2, devices=["cpu"], out_dir=tmp_path, progress=False)
    assert "temperature: 0.9 → 0.7" in _refusal(excinfo)
    assert _snapshot(tmp_path) == before
    same = debate(temperature=0.9).rollout(n=3, devices=["cpu"], out_dir=tmp_path, progress=False)
    assert same.skipped == ["rollout_0000", "rollout_0001"] and _ran(same) == ["rollout_0002"]
    assert same.results["rollout_0001"].transcript == first.results["rollout_0001"].transcript


class _Echo:
    """A callable object: its default repr holds its memory address, which differs in every process."""

    def __call__(self, view: View) -> str:
        return f"echo {view.messages[0].content}"


def test_a_callable_object_as_replies_resumes_from_a_fresh_instance(tmp_path: Path) -> None:
    def quiz() -> Conversation:
        solver = ScriptedParticipant("solver", _Echo())  # a new object at a new address, as in a new process
        return Conversation(participants=[solver], shared_context=dataset_field("q")).turns(1)

    rows = [{"q": "A0"}, {"q": "A1"}]
    first = quiz().data(rows).rollout(out_dir=tmp_path)
    assert first.failed == [] and first.skipped == []
    again = quiz().data(rows).rollout(out_dir=tmp_path)
    assert again.skipped == ["row_00000", "row_00001"]
    assert again.results["row_00001"].transcript[-1].content == "echo A1"


def test_an_analyzer_with_a_comprehension_fingerprints_the_same_in_every_process(tmp_path: Path) -> None:
    """Nested code objects (comprehensions, inner functions) are hashed by content: their repr holds a
    memory address, which made a rerun of such a recipe refused as changed in every new process."""
    import subprocess
    import sys

    script = tmp_path / "recipe.py"
    script.write_text(
        "from interlens import Conversation, ScriptedParticipant\n"
        "def analyzer(conv):\n"
        "    def words(text):\n"
        "        return len(text.split())\n"
        "    return {str(i): words(m.content) for i, m in enumerate(conv.transcript)}\n"
        "conv = Conversation([ScriptedParticipant('a', ['hi'])], shared_context='x').turns(1)\n"
        "print(conv.analyzer(analyzer).fingerprint())\n"
    )
    prints = {
        subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
        for _ in range(3)
    }
    assert len(prints) == 1, prints


def test_the_turns_a_run_conversation_starts_from_are_part_of_what_is_compared(tmp_path: Path) -> None:
    """A branch point (``upto(k)`` of a conversation that has run) rolls out from its turns: every copy
    starts there. Those turns shape the answer, so a rerun from another start (the unrun recipe, another
    first turn) is refused, saying so, and the same start resumes. The unrun recipe's fingerprint has no
    such part (ledgers written before it existed still resume)."""
    answerer = Answerer()

    def debate() -> Conversation:
        solver = ScriptedParticipant("solver", answerer.reply)
        return Conversation(
            participants=[solver, ScriptedParticipant("b", ["ok"])], shared_context="Q"
        ).turns(3)

    started = debate()
    started.step("solver")  # the live turn every copy starts from
    started = started.upto(1)
    first = started.rollout(n=2, out_dir=tmp_path, progress=False)
    assert [m.author for m in first.results["rollout_0000"].transcript] == [
        "moderator",
        "solver",
        "b",
        "solver",
    ]
    assert started.rollout(n=2, out_dir=tmp_path, progress=False).skipped == ["rollout_0000", "rollout_0001"]
    before = _snapshot(tmp_path)
    with pytest.raises(FingerprintMismatchError) as excinfo:
        debate().rollout(n=2, out_dir=tmp_path, progress=False)  # the unrun recipe: another question
    assert "the turns the conversation started from changed" in _refusal(excinfo)
    assert _snapshot(tmp_path) == before
    fresh = debate().rollout(n=1, out_dir=tmp_path / "fresh", progress=False)
    with LedgerReader(tmp_path / "fresh") as reader:
        assert '"start"' not in reader.job("rollout_0000").input_fp  # a recipe's fingerprint: as before
    assert fresh.results["rollout_0000"].transcript[1].content == "answer to Q"
