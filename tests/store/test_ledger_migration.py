"""An older ledger is brought up to date at open, never misread.

A version-1 file (no job input fingerprints, no batch request hashes) and a version-2 file (each result's
whole conversation, transcript and recipe included, stored per job) open for writing with everything they
held, read back the same before and after, and have their ``user_version`` raised; a reader opens either as
it is. Version-2 files are built here with version 2's own SQL (``ledger_testkit``), not with today's writer.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from ledger_testkit import V2_SCHEMA, as_schema

from interlens.store import SCHEMA_VERSION, BatchRecord, JobRecord, Ledger, LedgerReader, LedgerSchemaError


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


def _text(value: Any) -> str:
    """JSON as the ledger writes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _message(author: str, content: str, **metadata: Any) -> dict[str, Any]:
    return {"author": author, "content": content, "metadata": metadata}


def _dump(path: Path) -> list[str]:
    """Every row and table definition of the file, with its user_version."""
    conn = sqlite3.connect(path)
    try:
        return [*conn.iterdump(), f"user_version {conn.execute('PRAGMA user_version').fetchone()[0]}"]
    finally:
        conn.close()


def _everything(path: Path) -> dict[str, Any]:
    """What a reader gives of every job: its row, committed turns and result."""
    with LedgerReader(path) as reader:
        everything = {
            job_id: (reader.job(job_id), reader.turns(job_id), reader.result(job_id))
            for job_id in reader.job_ids()
        }
        streamed = dict(reader.iter_results(states=("pending", "running", "done", "failed"), page_size=3))
    assert streamed == {job: result for job, _, result in everything.values()}  # both ways to read agree
    return everything


# ------------------------------------------------------------------------------------------- version 1


async def _version_1_ledger(out_dir: Path) -> Path:
    """A ledger as version 1 wrote it (version 2's columns dropped from what version 2 stored)."""
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"pair": "fp"}, versions={}, describe={"pair": {"turns": 1}})
        await ledger.add_jobs(JobRecord(f"pair/row_{i}", "pair", seed=i) for i in range(3))
        await ledger.start_job("pair/row_0", device="cpu")
        await ledger.record_turn("pair/row_0", 0, {"role": "a", "content": "hello"})
        await ledger.start_job("pair/row_2", device="cpu")
        await ledger.record_turn("pair/row_2", 0, {"role": "a", "content": "done"})
        conversation = {"recipe": {"turns": 1}, "transcript": [{"role": "a", "content": "done"}], "seed": 2}
        await ledger.finish_job("pair/row_2", conversation=conversation, analysis=[1], tokens_generated=1)
        await ledger.record_batch(BatchRecord("openai", "batch_1", "in_progress", {"c0": ("pair/row_1", 0)}))
        await ledger.end_run("interrupted")
    path = out_dir / "ledger.sqlite"
    as_schema(path, 1)
    return path


async def test_a_version_1_ledger_is_migrated_at_open_with_everything_kept(tmp_path: Path) -> None:
    path = await _version_1_ledger(tmp_path)
    with LedgerReader(tmp_path) as reader:  # a reader takes the old file as it is
        assert reader.job_ids() == ["pair/row_0", "pair/row_1", "pair/row_2"]
        assert reader.summary()["schema_version"] == 1  # the file's version, not this code's
    before = _everything(path)
    assert before["pair/row_2"][2]["conversation"]["transcript"] == [{"role": "a", "content": "done"}]

    async with await Ledger.open(tmp_path) as ledger:  # 1 → 2 → 3 → 4 → 5, in one transaction
        await ledger.begin_run({"pair": "fp"}, versions={})
        assert await ledger.committed_turns("pair/row_0") == [{"role": "a", "content": "hello"}]
        [batch] = await ledger.open_batches()
        assert batch.requests == {"c0": ("pair/row_1", 0)}
        await ledger.end_run("completed")

    assert _everything(path) == before
    with LedgerReader(tmp_path) as reader:
        assert reader.summary()["schema_version"] == SCHEMA_VERSION
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
        assert conn.execute("SELECT count(*) FROM superseded_results").fetchone()[0] == 0
        assert "input_fp" in _columns(conn, "jobs")
        assert "request_hash" in _columns(conn, "batch_requests")
        assert _columns(conn, "results") == [
            "job_id",
            "state_json",
            "lineup_recipe",
            "turn_order",
            "analysis_json",
        ]
        assert conn.execute("SELECT count(*) FROM jobs WHERE input_fp IS NULL").fetchone()[0] == 3
        # The finished job's one message is its committed turn, stored once; its recipe is its lineup's.
        assert conn.execute("SELECT count(*) FROM turns WHERE job_id = 'pair/row_2'").fetchone()[0] == 1
        assert conn.execute("SELECT lineup_recipe, turn_order FROM results").fetchall() == [(1, "[0]")]
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------- version 2

RECIPE = {"participants": [{"name": "a", "system_prompt": "Answer {q} ✓"}], "turns": 2, "name": "pair"}
CONTEXT = _message("moderator", "What is 2+2?", shared_context=True)
T0 = _message("a", "four", n_tokens=1, logprob=0.30000000000000004)
T1 = _message("b", 'say "ok"\n\u2028', n_tokens=2, finish="stop", big=123456789012345678901234567890)
SAME = _message("a", "same", n_tokens=1)


def _v2_ledger(path: Path) -> None:
    """A version-2 ledger written with version 2's schema and statements: every kind of job it could hold."""
    conn = sqlite3.connect(path, isolation_level=None)
    now = time.time()
    conn.executescript(f"BEGIN;{V2_SCHEMA}COMMIT;")
    conn.execute("BEGIN")
    conn.execute(
        "INSERT INTO runs (started_at, ended_at, status, pid, host, versions_json) "
        "VALUES (?, ?, 'completed', 1, 'h', '{}')",
        (now, now),
    )
    conn.execute("INSERT INTO lineups VALUES ('pair', 'fp', ?, 1)", (_text(RECIPE),))
    conn.execute("INSERT INTO run_lineups VALUES (1, 'pair', 'fp')")

    def job(
        job_id: str, state: str, turns: list[dict[str, Any]], result: Any = None, analysis: Any = None
    ) -> None:
        conn.execute(
            "INSERT INTO jobs (job_id, lineup, seed, row_index, state, attempts, created_at, started_at, "
            "finished_at, tokens_generated, run_id, input_fp, error_type) "
            "VALUES (?, 'pair', 0, NULL, ?, 1, ?, ?, ?, 3, 1, 'fp', ?)",
            (job_id, state, now, now, now, "Boom" if state == "failed" else None),
        )
        for idx, turn in enumerate(turns):
            conn.execute("INSERT INTO turns VALUES (?, ?, ?, ?)", (job_id, idx, _text(turn), now))
        if result is not None:
            conn.execute(
                "INSERT INTO results (job_id, conversation_json, analysis_json) VALUES (?, ?, ?)",
                (job_id, _text(result), None if analysis is None else _text(analysis)),
            )

    state = {"schema": 1, "row": {"q": "2+2", "x": 0.1}, "seed": 0}
    # A finished job: its seeded context is in no turn row, its turns are.
    job(
        "done", "done", [T0, T1], {**state, "recipe": RECIPE, "transcript": [CONTEXT, T0, T1]}, {"score": 1.5}
    )
    # Equal messages, and one the analyzer added after the last turn.
    after = _message("moderator", "analyzer note")
    job(
        "dupes", "done", [SAME, SAME], {**state, "recipe": RECIPE, "transcript": [SAME, SAME, SAME, after]}, 1
    )
    # The analyzer failed, the conversation was kept; a message changed after it was committed.
    edited = {**T1, "metadata": {**T1["metadata"], "edited": True}}
    job(
        "analyzer_failed",
        "failed",
        [T0, T1],
        {**state, "recipe": RECIPE, "transcript": [CONTEXT, T0, edited]},
    )
    # Old interlens stored the expanded recipe (its prompt resolved): not the lineup's, so kept per job.
    resolved = {**RECIPE, "participants": [{"name": "a", "system_prompt": "Answer 2+2 ✓"}]}
    job("templated", "done", [T0], {**state, "recipe": resolved, "transcript": [T0]})
    # A transcript of values that are not messages, and a conversation without a recipe or a transcript.
    job("odd", "done", [], {"transcript": ["hi", 3, 2.5, None, True], "recipe": "r"}, [])
    job("bare", "done", [], {"x": {"y": [1.0, -0.0]}})
    job("empty", "done", [], {**state, "transcript": []})
    # Unfinished: turns to replay, no result.
    job("crashed", "failed", [T0])
    job("pending", "running", [T0, T1])
    conn.execute("COMMIT")
    conn.close()


async def test_a_version_2_ledger_is_migrated_at_open_and_reads_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    _v2_ledger(path)
    before = _everything(path)  # read as version 2 stored it
    with LedgerReader(tmp_path) as reader:  # totals over results read version 2's whole conversations
        rows_before = list(reader.result_values("$.row"))
    assert len(rows_before) == 5 and rows_before[0] == {"q": "2+2", "x": 0.1}
    assert before["done"][2] == {
        "conversation": {**before["done"][2]["conversation"], "transcript": [CONTEXT, T0, T1]},
        "analysis": {"score": 1.5},
        "tokens_generated": 3,
    }
    assert before["done"][2]["conversation"]["recipe"] == RECIPE

    async with await Ledger.open(tmp_path) as ledger:
        assert await ledger.committed_turns("pending") == [T0, T1]  # what a resumed job replays
        assert await ledger.committed_turns("analyzer_failed") == [T0, T1]
        assert await ledger.committed_turns("dupes") == [SAME, SAME]

    after = _everything(path)
    assert after == before
    with LedgerReader(tmp_path) as reader:
        assert list(reader.result_values("$.row")) == rows_before
    for job_id, (_, _, result) in after.items():  # type for type too (1.0 == 1 in Python, not in JSON)
        assert json.dumps(result, sort_keys=True) == json.dumps(before[job_id][2], sort_keys=True), job_id
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("SELECT name FROM sqlite_temp_master").fetchall() == []
        stored = dict(conn.execute("SELECT job_id, turn_order FROM results").fetchall())
        assert stored == {
            "done": "[-1,0,1]",  # the context written once as its own row, the turns referenced
            "dupes": "[0,1,-1,-2]",
            "analyzer_failed": "[-1,0,-2]",  # the edited message is not the committed one
            "templated": "[0]",
            "odd": None,  # kept as it was, in its state
            "bare": None,
            "empty": "[]",
        }
        shared = dict(conn.execute("SELECT job_id, lineup_recipe FROM results").fetchall())
        assert [job_id for job_id, flag in shared.items() if flag] == ["done", "dupes", "analyzer_failed"]
        # No result holds a transcript message or the lineup's recipe any more: each is stored once.
        assert _occurrences(conn, "What is 2+2?") == 2  # the context rows of "done" and "analyzer_failed"
        assert _occurrences(conn, '"four"') == 5  # T0: committed by 5 jobs, each row read by its result
        assert _occurrences(conn, "Answer {q}") == 1  # the lineup's recipe
        assert _occurrences(conn, "Answer 2+2") == 1  # the one recipe that was not the lineup's
    finally:
        conn.close()


def _occurrences(conn: sqlite3.Connection, marker: str) -> int:
    """In how many stored JSON values (turns, results, lineups) ``marker`` occurs."""
    total = 0
    for table, column in (
        ("turns", "turn_json"),
        ("results", "state_json"),
        ("results", "analysis_json"),
        ("lineups", "describe_json"),
    ):
        total += conn.execute(f"SELECT count(*) FROM {table} WHERE instr({column}, ?)", (marker,)).fetchone()[
            0
        ]
    return int(total)


async def test_a_version_2_ledger_that_cannot_be_upgraded_is_refused_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    _v2_ledger(path)
    conn = sqlite3.connect(path)  # a result whose job is gone: version 2 never wrote one, an edited file may
    conn.execute("INSERT INTO results VALUES ('ghost', ?, NULL)", (_text({"transcript": []}),))
    conn.commit()
    conn.close()
    before = _dump(path)
    with pytest.raises(LedgerSchemaError) as excinfo:
        await Ledger.open(tmp_path)
    message = str(excinfo.value)
    assert str(path) in message and "schema version 2" in message and f"version {SCHEMA_VERSION}" in message
    assert "left as it was" in message and "resume=False" in message
    assert _dump(path) == before  # (only the journal mode changed: the writer's WAL is set first)
    with LedgerReader(tmp_path) as reader:  # still readable as version 2
        assert reader.result("ghost") is None and reader.result("done") is not None
    async with await Ledger.open(tmp_path, fresh=True) as ledger:  # the way out it names
        assert ledger.moved_aside is not None and _dump(ledger.moved_aside) == before


# ------------------------------------------------------------------------------------------- version 3


async def test_a_version_3_ledger_gains_the_table_of_replaced_results_and_keeps_its_own(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite"
    kept = {"recipe": RECIPE, "transcript": [CONTEXT, T0], "spent": [{"calls": 1}]}
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"pair": "fp"}, versions={}, describe={"pair": RECIPE})
        await ledger.add_jobs([JobRecord("kept", "pair", seed=0), JobRecord("done", "pair", seed=1)])
        for job_id in ("kept", "done"):
            await ledger.start_job(job_id, device="cpu")
            await ledger.record_turn(job_id, 0, T0)
        await ledger.fail_job(
            "kept", error_type="AnalyzerError", message="m", traceback="t", conversation=kept
        )
        finished = {**kept, "spent": [{"calls": 2}]}
        await ledger.finish_job("done", conversation=finished, analysis={"score": 1}, tokens_generated=1)
        await ledger.end_run("failed")
    as_schema(path, 3)
    with LedgerReader(tmp_path) as reader:  # read as it is
        assert reader.summary()["schema_version"] == 3 and reader.summary()["superseded_results"] == 0
        assert sorted(v[0]["calls"] for v in reader.result_values("$.spent")) == [1, 2]
    before = _everything(path)
    assert before["kept"][2] == {"conversation": kept, "analysis": None, "tokens_generated": 0}

    async with await Ledger.open(tmp_path) as ledger:  # 3 → 4 → 5 at open
        await ledger.begin_run({"pair": "fp"}, versions={})
        assert await ledger.committed_turns("kept") == [T0]
        assert _everything(path) == before
        await ledger.start_job("kept", device="cpu")  # the rerun redoes the analysis
        redone = {**kept, "spent": [{"calls": 3}]}
        await ledger.finish_job("kept", conversation=redone, analysis={"score": 2}, tokens_generated=1)
        await ledger.end_run("completed")
    with LedgerReader(tmp_path) as reader:
        assert (
            reader.summary()["schema_version"] == SCHEMA_VERSION
            and reader.summary()["superseded_results"] == 1
        )
        assert reader.result("kept") == {
            "conversation": redone,
            "analysis": {"score": 2},
            "tokens_generated": 1,
        }
        assert reader.result("done") == before["done"][2]
        assert sorted(v[0]["calls"] for v in reader.result_values("$.spent")) == [1, 2, 3]
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
