"""A result is stored in parts (schema 3) and read back whole: its transcript's messages as turns rows (the
committed turns reused, not copied), its recipe once per lineup when it is the lineup's, the rest per job."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import anyio

from interlens.store import JobRecord, Ledger, LedgerReader, StoreError

RECIPE = {"participants": [{"name": "a", "system_prompt": "be brief"}], "turns": 2}
CONTEXT = {"author": "moderator", "content": "question", "metadata": {"shared_context": True}}
T0 = {"author": "a", "content": "first", "metadata": {"n_tokens": 1}}
T1 = {"author": "b", "content": "second", "metadata": {"n_tokens": 1, "finish": "stop"}}
NOTE = {"author": "moderator", "content": "added after the last turn", "metadata": {}}


def _rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


async def test_a_result_is_stored_in_parts_and_read_back_whole(tmp_path: Path) -> None:
    results = {
        "shared": {"schema": 1, "recipe": RECIPE, "transcript": [CONTEXT, T0, T1, NOTE], "row": {"q": 1}},
        "own_recipe": {"recipe": {**RECIPE, "turns": 3}, "transcript": [T0]},
        "no_lineup": {"recipe": RECIPE, "transcript": []},
        "plain": {"transcript": "not a list", "seed": 4},
    }
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={}, describe={"l": RECIPE})
        await ledger.add_jobs([JobRecord(j, "l", seed=0) for j in ("shared", "own_recipe", "plain")])
        await ledger.add_jobs([JobRecord("no_lineup", "unrecorded", seed=0)])
        for job_id, conversation in results.items():
            await ledger.start_job(job_id, device="cpu")
            if job_id != "plain":
                await ledger.record_turn(job_id, 0, T0)
            if job_id == "shared":
                await ledger.record_turn(job_id, 1, T1)
            await ledger.finish_job(job_id, conversation=conversation, analysis={"n": 1}, tokens_generated=2)
        assert await ledger.committed_turns("shared") == [T0, T1]  # what the turn loop committed, only

    with LedgerReader(tmp_path) as reader:
        assert {job_id: reader.result(job_id)["conversation"] for job_id in results} == results
        assert {
            job.job_id: result["conversation"] for job, result in reader.iter_results(page_size=2)
        } == results
        assert reader.turns("shared") == [T0, T1]
    path = tmp_path / "ledger.sqlite"
    stored = {
        job_id: (state, shared, order)
        for job_id, state, shared, order in _rows(
            path, "SELECT job_id, state_json, lineup_recipe, turn_order FROM results"
        )
    }
    assert stored == {
        "shared": ('{"schema":1,"row":{"q":1}}', 1, "[-1,0,1,-2]"),
        "own_recipe": (
            '{"recipe":{"participants":[{"name":"a","system_prompt":"be brief"}],"turns":3}}',
            0,
            "[0]",
        ),
        "no_lineup": (
            '{"recipe":{"participants":[{"name":"a","system_prompt":"be brief"}],"turns":2}}',
            0,
            "[]",
        ),
        "plain": ('{"transcript":"not a list","seed":4}', 0, None),
    }
    assert _rows(path, "SELECT idx FROM turns WHERE job_id = 'shared' ORDER BY idx") == [
        (-2,),
        (-1,),
        (0,),
        (1,),
    ]


async def test_a_kept_conversation_of_a_failed_job_is_replaced_by_its_retry(tmp_path: Path) -> None:
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={}, describe={"l": RECIPE})
        await ledger.add_jobs([JobRecord("job", "l", seed=0)])
        await ledger.start_job("job", device="cpu")
        await ledger.record_turn("job", 0, T0)
        kept = {"recipe": RECIPE, "transcript": [CONTEXT, T0, NOTE]}
        await ledger.fail_job(
            "job", error_type="AnalyzerError", message="m", traceback="t", conversation=kept
        )
        with LedgerReader(tmp_path) as reader:
            assert reader.result("job") == {"conversation": kept, "analysis": None, "tokens_generated": 0}
        assert await ledger.committed_turns("job") == [T0]  # the context and note are not replayed
        await ledger.start_job("job", device="cpu")
        await ledger.record_turn("job", 1, T1)
        done = {"recipe": RECIPE, "transcript": [CONTEXT, T0, T1]}
        await ledger.finish_job("job", conversation=done, analysis=1, tokens_generated=2)
    with LedgerReader(tmp_path) as reader:
        assert reader.result("job") == {"conversation": done, "analysis": 1, "tokens_generated": 2}
    # The failed attempt's context and note rows are gone: only the retry's context is stored besides turns.
    assert _rows(tmp_path / "ledger.sqlite", "SELECT idx FROM turns ORDER BY idx") == [(-1,), (0,), (1,)]


async def test_a_finish_for_an_unknown_job_fails_alone_among_concurrent_ones(tmp_path: Path) -> None:
    ids = [f"job_{i}" for i in range(6)]
    errors: dict[str, BaseException] = {}
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={}, describe={"l": RECIPE})
        await ledger.add_jobs([JobRecord(job_id, "l", seed=0) for job_id in ids])
        for job_id in ids:
            await ledger.start_job(job_id, device="cpu")
            await ledger.record_turn(job_id, 0, {**T0, "content": job_id})

        async def finish(job_id: str) -> None:
            transcript = [CONTEXT, {**T0, "content": job_id}]
            try:
                await ledger.finish_job(
                    job_id,
                    conversation={"recipe": RECIPE, "transcript": transcript},
                    analysis=1,
                    tokens_generated=1,
                )
            except StoreError as exc:
                errors[job_id] = exc

        async with anyio.create_task_group() as tg:
            for job_id in [*ids[:3], "ghost", *ids[3:]]:
                tg.start_soon(finish, job_id)
    assert list(errors) == ["ghost"] and "unknown job id 'ghost'" in str(errors["ghost"])
    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == 6
        for job_id in ids:
            assert reader.result(job_id)["conversation"]["transcript"] == [CONTEXT, {**T0, "content": job_id}]
    assert _rows(tmp_path / "ledger.sqlite", "SELECT count(*) FROM turns WHERE idx < 0") == [(6,)]


async def test_a_replaced_result_keeps_its_state_for_totals_and_readers_see_the_current_one(
    tmp_path: Path,
) -> None:
    def attempt(n: int, *messages: dict[str, Any]) -> dict[str, Any]:
        return {"recipe": RECIPE, "transcript": [CONTEXT, *messages], "spent": [{"calls": n}]}

    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={}, describe={"l": RECIPE})
        await ledger.add_jobs([JobRecord(j, "l", seed=0) for j in ("twice", "redone", "once")])
        for job_id in ("twice", "redone", "once"):
            await ledger.start_job(job_id, device="cpu")
            await ledger.record_turn(job_id, 0, T0)
        for n in (1, 2):  # the analyzer fails twice, the conversation kept each time, then succeeds
            await ledger.fail_job(
                "twice", error_type="AnalyzerError", message="m", traceback="t", conversation=attempt(n, T0)
            )
            await ledger.start_job("twice", device="cpu")
        await ledger.finish_job("twice", conversation=attempt(3, T0), analysis={"ok": 3}, tokens_generated=1)
        # A done job's result written again (not for a failure): the first is kept as well.
        await ledger.finish_job(
            "redone", conversation=attempt(10, T0), analysis={"ok": 10}, tokens_generated=1
        )
        await ledger.finish_job(
            "redone", conversation=attempt(11, T0), analysis={"ok": 11}, tokens_generated=1
        )
        await ledger.finish_job("once", conversation=attempt(20, T0), analysis=None, tokens_generated=1)

    with LedgerReader(tmp_path) as reader:
        assert sorted(v[0]["calls"] for v in reader.result_values("$.spent")) == [1, 2, 3, 10, 11, 20]
        assert [v[0]["calls"] for v in reader.result_values("$.spent")][:3] == [3, 11, 20]  # current first
        current = {"twice": (3, {"ok": 3}), "redone": (11, {"ok": 11}), "once": (20, None)}
        for job_id, (n, analysis) in current.items():  # every reader of "the" result: the current one only
            assert reader.result(job_id) == {
                "conversation": attempt(n, T0),
                "analysis": analysis,
                "tokens_generated": 1,
            }
        assert {job.job_id: r["conversation"]["spent"] for job, r in reader.iter_results(page_size=2)} == {
            job_id: [{"calls": n}] for job_id, (n, _) in current.items()
        }
        assert reader.counts()["done"] == 3 and reader.summary()["superseded_results"] == 3
    path = tmp_path / "ledger.sqlite"
    # Only the states are kept (the recipe is the lineup's, the transcript the job's turns rows): no copies.
    assert _rows(path, "SELECT job_id, state_json, analysis_json FROM superseded_results ORDER BY rowid") == [
        ("twice", '{"spent":[{"calls":1}]}', None),
        ("twice", '{"spent":[{"calls":2}]}', None),
        ("redone", '{"spent":[{"calls":10}]}', '{"ok":10}'),
    ]
    assert _rows(path, "SELECT job_id, count(*) FROM turns GROUP BY job_id ORDER BY job_id") == [
        ("once", 2),  # T0 and the current result's context row
        ("redone", 2),
        ("twice", 2),
    ]
