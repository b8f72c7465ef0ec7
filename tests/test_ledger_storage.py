"""What a rollout leaves in its ledger (schema 3): each message stored once, the recipe once per lineup, and
results that read back exactly as the run produced them — also from a ledger an older interlens wrote.

Real rollouts of scripted participants into a real SQLite file; the in-memory run (no ``out_dir``) is the
reference for what a result is, since it keeps every result as the job returned it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from ledger_testkit import as_schema

from interlens import Conversation, ScriptedParticipant, View, dataset_field
from interlens._core._message import Message
from interlens.store import LedgerReader

RECIPE_MARK = "RECIPE-MARK-7f3a"
_ANALYZER_FAILS: set[str] = set()  # questions whose analyzer raises, while a test wants it to


def _reply(view: View) -> str:
    question = view.messages[0].content
    return f"TURN-{question}-{len(view.messages)}"


def _analyze(conv: Conversation) -> dict[str, Any]:
    question = conv.row["q"] if conv.row else ""
    if question in _ANALYZER_FAILS:
        raise RuntimeError(f"the analyzer breaks on {question}")
    conv.transcript.append(Message("moderator", f"NOTE-{question}", {"added_by": "analyzer"}))
    return {"messages": len(conv.transcript), "x": 0.30000000000000004}


def _recipe(rows: list[dict[str, str]]) -> Conversation:
    a = ScriptedParticipant("a", _reply, system_prompt=f"{RECIPE_MARK} answer " + "{q}")
    b = ScriptedParticipant("b", _reply, system_prompt=dataset_field("q"))
    return (
        Conversation(participants=[a, b], shared_context=dataset_field("q"))
        .turns(3)
        .data(rows)
        .analyzer(_analyze)
    )


def _rows(n: int) -> list[dict[str, str]]:
    return [{"q": f"Q{i}x"} for i in range(n)]


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _occurrences(path: Path, marker: str) -> int:
    """In how many stored values of any text column of any table ``marker`` occurs."""
    conn = sqlite3.connect(path)
    try:
        total = 0
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            for column in (row[1] for row in conn.execute(f"PRAGMA table_info({table})")):
                total += conn.execute(
                    f"SELECT count(*) FROM {table} WHERE instr(CAST({column} AS TEXT), ?)", (marker,)
                ).fetchone()[0]
        return int(total)
    finally:
        conn.close()


def test_a_rollout_stores_each_message_once_and_the_recipe_once_per_lineup(tmp_path: Path) -> None:
    rows = _rows(4)
    reference = _recipe(rows).rollout(progress=False)  # in memory: every result as the job returned it
    report = _recipe(rows).rollout(out_dir=tmp_path, progress=False)
    assert report.counts["done"] == 4 and report.failed == []
    expected = {job_id: r._state for job_id, r in reference.results.items()}
    got = {job_id: r._state for job_id, r in report.results.items()}
    assert _dump(got) == _dump(expected)  # message by message, metadata, row, seed and recipe included
    transcript = report.results["row_00001"].transcript
    assert transcript is not None
    assert [(m.author, m.content) for m in transcript] == [
        ("moderator", "Q1x"),  # the seeded shared context: never committed as a turn
        ("a", "TURN-Q1x-1"),
        ("b", "TURN-Q1x-2"),
        ("a", "TURN-Q1x-3"),
        ("moderator", "NOTE-Q1x"),  # added by the analyzer after the last turn
    ]
    assert transcript[-1].metadata == {"added_by": "analyzer"}
    assert transcript[0].metadata == {"shared_context": True} and "n_tokens" in transcript[1].metadata
    assert report.analyses() == reference.analyses()
    assert got["row_00002"]["recipe"]["participants"][0]["system_prompt"].startswith(RECIPE_MARK)

    path = tmp_path / "ledger.sqlite"
    assert _occurrences(path, RECIPE_MARK) == 1  # the lineup's recipe, not one per job
    for i in range(4):
        for turn in range(1, 4):
            assert _occurrences(path, f"TURN-Q{i}x-{turn}") == 1, (i, turn)
        assert _occurrences(path, f"NOTE-Q{i}x") == 1
    with LedgerReader(tmp_path) as reader:  # a resumed job would replay only what its turn loop committed
        assert [t["content"] for t in reader.turns("row_00003")] == ["TURN-Q3x-1", "TURN-Q3x-2", "TURN-Q3x-3"]


def test_a_rollout_ledger_of_schema_2_resumes_with_the_same_results(tmp_path: Path) -> None:
    rows = _rows(3)
    _ANALYZER_FAILS.add("Q1x")
    try:
        first = _recipe(rows).rollout(out_dir=tmp_path, progress=False)
    finally:
        _ANALYZER_FAILS.discard("Q1x")
    assert first.failed == ["row_00001"]  # its conversation kept, its analysis to redo
    kept = {job_id: r._state for job_id, r in first.results.items()}
    as_schema(tmp_path / "ledger.sqlite", 2)  # what interlens wrote before this schema
    with LedgerReader(tmp_path) as reader:  # read as it is, before anything migrates it
        assert {job_id: reader.result(job_id)["conversation"] for job_id in kept} == kept

    again = _recipe(rows).rollout(out_dir=tmp_path, progress=False)  # migrates, then resumes
    assert again.skipped == ["row_00000", "row_00002"] and again.failed == []
    assert _dump({j: again.results[j]._state for j in kept if j != "row_00001"}) == _dump(
        {j: s for j, s in kept.items() if j != "row_00001"}
    )
    # The failed job replayed its committed turns (not its stored context or note) and ran the analyzer again.
    reference = _recipe(rows).rollout(progress=False)
    assert _dump(again.results["row_00001"]._state) == _dump(reference.results["row_00001"]._state)
    assert again.analyses() == reference.analyses()
    conv = again.results["row_00002"].conversation
    assert conv is not None and [m.content for m in conv.transcript][-1] == "NOTE-Q2x"
    conn = sqlite3.connect(tmp_path / "ledger.sqlite")
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 7
        # The failed job's migrated result, replaced by the rerun's, is kept as a state (no transcript).
        assert conn.execute("SELECT job_id FROM superseded_results").fetchall() == [("row_00001",)]
    finally:
        conn.close()
    for i in range(3):  # a message is stored once, the replaced result's included
        assert _occurrences(tmp_path / "ledger.sqlite", f"NOTE-Q{i}x") == 1, i
