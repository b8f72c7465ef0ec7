"""Schema 6: a prompt's new ids stored as references to the ids its job's earlier turns generated (issue 40).

Debate-shaped transcripts: each speaker's later prompt holds the other speaker's answer ids. Real ledger
files, written and read through the writer and the reader; damage made with plain SQL.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path
from typing import Any

import pytest
from ledger_testkit import as_schema, inline_records, token_rows

from interlens import Message, TokenRecord, Transcript
from interlens.report import ledger_token_rows
from interlens.store import JobRecord, Ledger, LedgerReader, UnreadableRecordError, restore_tokens

A0 = list(range(100, 130))  # a's first answer: 30 ids
B0 = list(range(60_000, 60_025))  # b's first answer
A1 = list(range(300, 340))
B1 = [7, 8, *range(400, 420)]


def _turn(author: str, prompt: list[int], ids: list[int]) -> dict[str, Any]:
    record = TokenRecord.build(ids, [-0.5 - k / 64 for k in range(len(ids))], [-0.25] * len(ids), prompt)
    return Message(author, f"{author}: {len(ids)} ids", {"tokens": record.to_json()}).to_json()


def _debate() -> list[dict[str, Any]]:
    """Four turns; every later prompt quotes the other speaker's answer between template ids."""
    head_a, head_b = [1, 2, 3], [1, 2, 4]
    return Transcript.from_json(
        [
            _turn("a", head_a, A0),
            _turn("b", [*head_b, 5, *A0, 6], B0),
            _turn("a", [*head_a, *A0, 5, *B0, 6], A1),
            _turn("b", [*head_b, 5, *A0, 6, *B0, 5, *A1, 6], B1),
        ]
    ).to_json()


async def _write(out_dir: Path, *, jobs: int = 2, turns: int = 4) -> list[dict[str, Any]]:
    written = _debate()
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"job_{j}", "l", seed=j) for j in range(jobs))
        for j in range(jobs):
            await ledger.start_job(f"job_{j}", device="cpu")
            for i, turn in enumerate(written[:turns]):
                await ledger.record_turn(f"job_{j}", i, turn)
            if turns == len(written):
                conversation = {"transcript": written, "seed": j}
                await ledger.finish_job(
                    f"job_{j}", conversation=conversation, analysis=None, tokens_generated=1
                )
        await ledger.end_run("completed")
    return written


def _rows(path: Path, job_id: str) -> dict[int, tuple[dict[str, Any], bytes]]:
    rows = token_rows(path / "ledger.sqlite", job_id)
    return {idx: (json.loads(values[0]), values[4]) for idx, values in rows.items()}


def _markers(path: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(path / "ledger.sqlite") as db:
        rows = db.execute("SELECT json_extract(turn_json, '$.metadata.tokens') FROM turns WHERE idx >= 0")
        return [None if text is None else json.loads(text) for (text,) in rows]


def _read(reader: LedgerReader, job_id: str) -> list[dict[str, Any]]:
    result = reader.result(job_id)
    assert result is not None
    return restore_tokens(result["conversation"]["transcript"], reader.result_tokens(job_id) or [])


async def test_prompts_refer_to_the_other_speakers_answers_and_read_back_bit_for_bit(tmp_path: Path) -> None:
    written = await _write(tmp_path)
    rows = _rows(tmp_path, "job_0")
    assert "refs" not in rows[0][0]  # the first turn has nothing earlier to refer to
    # b's prompt: [1, 2, 4, 5] (its first turn: whole), then a's 30 ids from turn 0, then 6 literal
    assert rows[1][0]["refs"] == [[4, 0, 0, 30]] and len(rows[1][1]) == 5 * 2
    # a's second prompt keeps its first prompt + answer (``keep``); new: 5, b's answer, 6
    assert rows[2][0]["refs"] == [[1, 1, 0, 25]] and len(rows[2][1]) == 2 * 2
    assert rows[3][0]["refs"] == [[1, 2, 0, 40]]  # b keeps up to its answer; new: 5, a's A1 (turn 2), 6
    with LedgerReader(tmp_path) as reader:
        for job in ("job_0", "job_1"):
            assert _read(reader, job) == written  # the very JSON written, every record's bytes
        expected = [m.tokens for m in Transcript.from_json(written)]
        assert [m.tokens for m in Transcript.from_json(_read(reader, "job_1"))] == expected
    async with await Ledger.open(tmp_path) as ledger:  # a resumed attempt's replay resolves them too
        assert await ledger.committed_turns("job_1") == written
    exported = list(ledger_token_rows(tmp_path))
    assert len(exported) == 8 and exported[3]["prompt_ids"] == [1, 2, 4, 5, *A0, 6, *B0, 5, *A1, 6]


async def test_a_resumed_job_refers_to_the_turns_its_earlier_process_recorded(tmp_path: Path) -> None:
    written = await _write(tmp_path, jobs=1, turns=2)  # the process ends after two turns
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={})
        replayed = await ledger.committed_turns("job_0")
        assert replayed == written[:2]
        for i in (2, 3):
            await ledger.record_turn("job_0", i, written[i])
        await ledger.finish_job(
            "job_0", conversation={"transcript": written}, analysis=None, tokens_generated=1
        )
    rows = _rows(tmp_path, "job_0")
    assert rows[2][0]["refs"] == [[1, 1, 0, 25]]  # turn 1, written by the first process
    with LedgerReader(tmp_path) as reader:
        assert _read(reader, "job_0") == written


@pytest.mark.parametrize(
    ("damage", "named", "says"),
    [
        ("UPDATE turn_tokens SET ids = zeroblob(length(ids)) WHERE idx = 1", 1, "digest differs"),
        ("UPDATE turn_tokens SET ids = substr(ids, 1, 10) WHERE idx = 1", 1, "digest differs"),
        # its turns row says it has one (schema 7): the missing row itself is named, before what refers to it
        ("DELETE FROM turn_tokens WHERE idx = 1", 1, "its row is missing"),
    ],
)
async def test_a_reference_whose_source_is_damaged_is_named_by_job_and_turn(
    tmp_path: Path, damage: str, named: int, says: str
) -> None:
    written = await _write(tmp_path)
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        inline_records(db)  # in their own columns, as schema 6 wrote them (the stream's: test_turn_tokens)
        db.execute(damage + " AND job_id = 'job_1'")
    with LedgerReader(tmp_path) as reader:
        with pytest.raises(UnreadableRecordError, match=rf"job 'job_1'.s turn {named} .*{says}") as caught:
            reader.result_tokens("job_1")
        assert (caught.value.job_id, caught.value.idx) == ("job_1", named)
        assert _read(reader, "job_0") == written  # the rest of the ledger reads
    async with await Ledger.open(tmp_path) as ledger:  # a resume's replay names the same turn
        with pytest.raises(UnreadableRecordError, match=rf"job 'job_1'.s turn {named}: its token record"):
            await ledger.committed_turns("job_1")


async def test_a_version_5_ledger_is_upgraded_in_place_and_an_older_interlens_refuses_version_7(
    tmp_path: Path,
) -> None:
    written = await _write(tmp_path)
    path = tmp_path / "ledger.sqlite"
    as_schema(path, 5)  # every prompt id literal, as version 5 stored them
    assert all(
        "refs" not in facts and "digest" not in facts for facts, _ in _rows(tmp_path, "job_0").values()
    )
    assert all(len(m["digest"]) == 8 for m in _markers(tmp_path))  # version 5: the digest in the marker
    with LedgerReader(tmp_path) as reader:  # read as it is
        assert reader.summary()["schema_version"] == 5 and _read(reader, "job_0") == written
    async with await Ledger.open(tmp_path) as ledger:  # 5 → 6 → 7 at open: digests, then markers move
        await ledger.begin_run({"l": "fp"}, versions={})
        assert await ledger.committed_turns("job_1") == written
        await ledger.end_run("completed")
    with LedgerReader(tmp_path) as reader:
        assert reader.summary()["schema_version"] == 7 and _read(reader, "job_1") == written
    assert _markers(tmp_path) == [None] * 8  # local markers left the JSON for turns.stored_tokens
    assert all(len(facts["digest"]) == 8 for facts, _ in _rows(tmp_path, "job_1").values())
    import store._schema as schema

    older = schema.SCHEMA_VERSION - 1  # what an interlens of version 6 checks against
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schema, "SCHEMA_VERSION", older)
        with pytest.raises(
            schema.LedgerSchemaError, match="ledger schema version 7; this version understands up to 6"
        ):
            schema.check_existing(path, deep=False)


async def test_a_turn_recorded_again_refers_only_to_turns_before_it(tmp_path: Path) -> None:
    """Re-recording turn 1 (its job ran again from there) must not refer to turn 2, which is about to be
    recorded again too: a reference only ever points back, so a job's tail can be rewritten or dropped."""
    written = await _write(tmp_path, jobs=1, turns=4)
    again = [_turn("b", [1, 2, 4, 5, *A1, 6], B0), _turn("a", [9, *B0], list(range(500, 540)))]
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={})
        assert await ledger.committed_turns("job_0") == written
        await ledger.record_turn("job_0", 1, again[0])  # quotes turn 2's answer, A1, which is replaced next
        await ledger.record_turn("job_0", 2, again[1])
        assert await ledger.committed_turns("job_0") == [written[0], *again, written[3]]
    assert "refs" not in _rows(tmp_path, "job_0")[1][0]


async def test_a_result_refers_to_the_turn_whose_record_it_has_when_texts_and_markers_are_equal(
    tmp_path: Path,
) -> None:
    """Two turns alike but for their records (same author, text and length): their markers are equal, so a
    result's messages are matched to committed turns by text and the record's digest (in its row)."""
    first, second = _turn("a", [1, 2], [10, 11, 12]), _turn("a", [1, 2], [20, 21, 22])
    assert (
        first["metadata"]["tokens"] != second["metadata"]["tokens"] and first["content"] == second["content"]
    )
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={})
        await ledger.add_jobs([JobRecord("job_0", "l", seed=0)])
        await ledger.start_job("job_0", device="cpu")
        await ledger.record_turn("job_0", 0, first)
        await ledger.record_turn("job_0", 1, second)
        await ledger.finish_job(
            "job_0", conversation={"transcript": [second, first]}, analysis=None, tokens_generated=1
        )
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        assert db.execute("SELECT turn_order FROM results").fetchone()[0] == "[1,0]"  # no row stored again
        markers = {t for (t,) in db.execute("SELECT json_extract(turn_json, '$.metadata.tokens') FROM turns")}
        flags = {f for (f,) in db.execute("SELECT stored_tokens FROM turns")}
    assert markers == {None} and flags == {1}  # no marker in the JSON (schema 7): the turns row says it
    with LedgerReader(tmp_path) as reader:
        assert _read(reader, "job_0") == [second, first]


@pytest.mark.parametrize("width", [2, 4])
def test_runs_found_resolve_to_the_very_prompt_ids(width: int) -> None:
    """Prompts spliced from earlier answers (whole, cut, with ids changed at the seams) and fresh ids."""
    import random

    from store._token_refs import find_runs, resolve

    code = "<H" if width == 2 else "<I"
    rng = random.Random(width)
    top = 2**16 if width == 2 else 2**20
    referring = 0
    for _ in range(200):
        answers = {
            i: [rng.randrange(50) for _ in range(rng.randrange(1, 80))] for i in range(rng.randrange(1, 5))
        }
        prompt: list[int] = []
        for _ in range(rng.randrange(1, 6)):
            source = answers[rng.randrange(len(answers))]
            start = rng.randrange(len(source))
            prompt += source[start : start + rng.randrange(1, 60)] + [rng.randrange(top) for _ in range(3)]
        pack = lambda ids: b"".join(struct.pack(code, i) for i in ids)  # noqa: E731
        sources = {i: pack(ids) for i, ids in answers.items()}
        found = find_runs(pack(prompt), width, sources)
        if found is not None:
            refs, literal = found
            assert all(n >= 12 for *_, n in refs)
            assert resolve(refs, literal, width, sources) == pack(prompt)
            referring += 1
    assert referring > 100  # most prompts had a run to refer to
