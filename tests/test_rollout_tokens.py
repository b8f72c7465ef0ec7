"""A rollout's turns as training data: ``record_tokens=True`` keeps each local turn's token ids and their
log-probabilities in its message (``message.tokens``), through the ledger and a resume (issue 27).

The engine's numbers are checked against a forward pass in tests/test_token_logprobs.py; here the record's
way through a real rollout on a real tiny model: a run directory's SQLite ledger, its resume, the recipe's
fingerprint.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ledger_testkit import token_rows
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import (
    AutoModelParticipant,
    ConfigurationTypeError,
    Conversation,
    FingerprintMismatchError,
    Message,
    TokenRecord,
)


def _debate(path: str, *, record: bool = True) -> Conversation:
    a = AutoModelParticipant.from_pretrained(
        path, name="a", max_new_tokens=12, temperature=0.9, record_tokens=record
    )
    b = AutoModelParticipant.from_pretrained(
        path, name="b", max_new_tokens=12, temperature=0, record_tokens=record
    )
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(4)


def test_each_turn_keeps_its_tokens_through_the_ledger_and_a_resume(qwen2_path: str, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    first = _debate(qwen2_path).rollout(n=3, out_dir=tmp_path, seed=1)
    assert not first.failed
    for result in first.results.values():
        for message in result.transcript[1:]:
            record = message.tokens
            assert record is not None and len(record.ids) == message.n_tokens > 0
            assert tokenizer.decode(list(record.ids), skip_special_tokens=True) == message.content
            assert all(lp < 0 for lp in record.model_logprobs)
            if message.author == "b":  # greedy: each pick was certain
                assert set(record.sampling_logprobs) == {0.0}
            else:  # T = 0.9: a sharper distribution than the model's
                assert record.sampling_logprobs != record.model_logprobs
        assert result.transcript[0].tokens is None  # the shared context: nobody generated it
    # a resume reads every turn back from the ledger: the same records
    again = _debate(qwen2_path).rollout(n=3, out_dir=tmp_path, seed=1)
    assert again.skipped == sorted(first.results)
    for job_id, result in first.results.items():
        assert [m.tokens for m in again.results[job_id].transcript] == [m.tokens for m in result.transcript]


def test_the_record_is_compact_binary_in_the_ledger(qwen2_path: str, tmp_path: Path) -> None:
    """Stored as little-endian bytes in the ledger's own tables (schema 5-7, issue 40), never JSON floats nor
    base64; ids in 2 bytes where the vocabulary allows; a greedy turn's sampling log-probabilities (all 0.0)
    not at all; a speaker's later prompts as their difference from its previous turn, stored once (the job's
    result refers to the recorded turns). The turn's JSON keeps nothing of it: its turns row says it has one
    (schema 7), and readers give the message its marker back."""
    report = _debate(qwen2_path).rollout(n=2, out_dir=tmp_path, seed=1)
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        rows = list(
            db.execute("SELECT job_id, idx, turn_json, stored_tokens FROM turns ORDER BY job_id, idx")
        )
    blobs = {
        (job, idx): (json.loads(values[0]), *values[1:])
        for job in {job for job, *_ in rows}
        for idx, values in token_rows(tmp_path / "ledger.sqlite", job).items()
    }
    turns = [
        (job, idx, json.loads(text))
        for job, idx, text, flag in rows
        if json.loads(text)["author"] != "moderator" and flag == 1
    ]
    assert [idx for _, idx, _ in turns] == [0, 1, 2, 3] * 2  # every generated turn, each stored once
    assert sorted(blobs) == sorted((job, idx) for job, idx, _ in turns)  # a row per recorded turn, no more
    for job, idx, turn in turns:
        n = turn["metadata"]["n_tokens"]
        assert "tokens" not in turn["metadata"]  # its count, digest and bytes are in the row
        facts, ids, model, sampling, prompt_ids = blobs[(job, idx)]
        prompt = report.results[job].transcript[1 + idx].tokens.prompt_ids  # type: ignore[union-attr]
        if idx < 2:  # each speaker's first turn: its whole prompt
            assert "keep" not in facts and len(prompt_ids) == 2 * len(prompt)
        else:  # the previous turn's prompt and answer, then the other speaker's turn and the template's
            assert facts["keep"] > len(prompt) // 2
            assert len(prompt_ids) == 2 * (len(prompt) - facts["keep"])
        assert facts["id_bytes"] == 2 and len(ids) == 2 * n  # a vocabulary under 65,536
        assert len(model) == 4 * n
        if turn["author"] == "b":  # greedy: nothing to store
            assert facts["sampling"] == "certain" and sampling is None
        else:
            assert len(sampling) == 4 * n


def test_recording_is_part_of_the_recipe_a_resume_compares(qwen2_path: str, tmp_path: Path) -> None:
    """Turns done without a record cannot be given one afterwards: a resume that asks for records refuses
    (the fix is resume=False or another out_dir), and a recipe that never asked keeps its fingerprint."""
    plain = _debate(qwen2_path, record=False)
    assert "record_tokens" not in json.dumps(plain.to_json())
    plain.rollout(n=2, out_dir=tmp_path, seed=1)
    with pytest.raises(FingerprintMismatchError, match="resume=False"):
        _debate(qwen2_path).rollout(n=2, out_dir=tmp_path, seed=1)
    report = plain.rollout(n=2, out_dir=tmp_path, seed=1)
    assert all(m.tokens is None for r in report.results.values() for m in r.transcript)


def test_a_record_decodes_what_it_stored_and_refuses_what_it_cannot_read() -> None:
    record = TokenRecord.build([5, 70000, 0], [-0.1, -2.5, -30.0], [0.0, -1.0, -0.25])
    back = Message("a", "x", {"tokens": record.to_json()}).tokens
    assert back == record and back.ids == (5, 70000, 0) and back.sampling_logprobs == (0.0, -1.0, -0.25)
    assert back.model_logprobs[0] == pytest.approx(-0.1, rel=1e-7)  # float32, as the engine computed it
    assert record.to_json()["id_bytes"] == 4  # an id past 65,535
    # a turn sampled from the model's own distribution (T = 1, no nucleus), and a greedy one
    same = TokenRecord.build([1, 2], [-0.5, -1.5], [-0.5, -1.5])
    greedy = TokenRecord.build([1, 2], [-0.5, -1.5], [0.0, 0.0])
    assert same.to_json()["sampling_logprobs"] == "model"
    assert greedy.to_json()["sampling_logprobs"] == "certain"
    assert TokenRecord.from_json(same.to_json()) == same and TokenRecord.from_json(greedy.to_json()) == greedy
    with pytest.raises(Exception, match=r"format 1 or 2.*newer interlens"):
        Message("a", "x", {"tokens": {"format": 3}}).tokens  # noqa: B018
    with pytest.raises(Exception, match="must align"):
        TokenRecord.build([1, 2], [-1.0], [-1.0])


def test_record_tokens_must_be_a_bool(qwen2_path: str) -> None:
    with pytest.raises(ConfigurationTypeError, match="record_tokens must be True or False, got 'yes'"):
        AutoModelParticipant.from_pretrained(qwen2_path, name="a", record_tokens="yes")


def test_the_token_export_gives_each_turn_the_ids_its_model_saw(qwen2_path: str, tmp_path: Path) -> None:
    """A row per generated turn, in the report and from the ledger (``interlens export --tokens``): the
    prompt ids are exactly what the model saw, so a forward pass of prompt + completion gives back the
    recorded log-probabilities (the later turns ran on kept KV caches: nothing was re-rendered)."""
    import pandas as pd

    from interlens.report import TOKEN_COLUMNS

    report = _debate(qwen2_path).rollout(n=2, out_dir=tmp_path / "run", seed=1)
    frame = report.to_pandas(tokens=True)
    assert list(frame.columns) == list(TOKEN_COLUMNS) and len(frame) == 2 * 4
    assert list(frame["turn"]) == [1, 2, 3, 4] * 2 and list(frame["speaker"]) == ["a", "b"] * 4
    model = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=torch.float32).eval()
    for row in frame.itertuples():
        ids = torch.tensor([[*row.prompt_ids, *row.completion_ids]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(row.prompt_ids) - 1 : -1]
        want = logits.log_softmax(-1).gather(1, torch.tensor(row.completion_ids)[:, None]).squeeze(1)
        assert (
            max(abs(a - b) for a, b in zip(row.completion_model_logprobs, want.tolist(), strict=True)) < 1e-4
        )
    reused = [m.metadata["kv_reused_tokens"] for r in report.results.values() for m in r.transcript[3:]]
    assert min(reused) > 0  # the later turns' prompts came from kept caches
    assert len(report.to_dataset(tokens=True)) == len(frame)

    target = tmp_path / "turns.parquet"
    command = [sys.executable, "-m", "interlens", "export", str(tmp_path / "run"), "--tokens"]
    done = subprocess.run(
        [*command, "-f", "parquet", "-o", str(target)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 8 turn row(s)" in done.stderr
    exported = pd.read_parquet(target)
    assert list(exported.columns) == list(TOKEN_COLUMNS)
    assert [list(x) for x in exported["completion_ids"]] == [list(x) for x in frame["completion_ids"]]
    assert [list(x) for x in exported["prompt_ids"]] == [list(x) for x in frame["prompt_ids"]]
    show = [sys.executable, "-m", "interlens", "show", str(tmp_path / "run"), "rollout_0000", "--metadata"]
    shown = subprocess.run(
        show, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"}
    )
    assert shown.returncode == 0, shown.stderr
    assert "tokens=<" in shown.stdout and "model_logprobs" not in shown.stdout  # no base64 in the terminal


def test_a_transcript_stores_each_speakers_prompts_as_differences_and_reads_them_back_whole() -> None:
    from interlens import Transcript

    def turn(author: str, prompt: list[int], ids: list[int]) -> Message:
        record = TokenRecord.build(ids, [-1.0] * len(ids), [-0.5] * len(ids), prompt)
        return Message(author, "x", {"n_tokens": len(ids), "tokens": record.to_json()})

    first = turn("a", [1, 2, 3], [4, 5])
    other = turn("b", [9, 1, 2], [6])
    again = turn("a", [1, 2, 3, 4, 5, 7, 6, 8], [10])  # a's previous prompt and answer, then more
    changed = turn("a", [1, 2, 99], [11])  # a template that re-renders the past differently
    transcript = Transcript([Message("moderator", "go"), first, other, again, changed])
    stored = transcript.to_json()
    assert stored[3]["metadata"]["tokens"]["prompt_ids"]["keep"] == 5  # [1, 2, 3, 4, 5] kept
    assert stored[4]["metadata"]["tokens"]["prompt_ids"]["keep"] == 2
    assert Transcript.from_json(stored) == transcript  # whole again, every record
    assert [m.tokens for m in Transcript.from_json(stored)] == [m.tokens for m in transcript]
    with pytest.raises(Exception, match="read the turn through its transcript"):
        Message.from_json(stored[3]).tokens  # noqa: B018
    with pytest.raises(Exception, match="not in the turns given"):
        Transcript.from_json(stored[3:])


def test_a_row_per_speaker_holds_its_last_sequence_and_a_mask_of_what_it_generated(
    qwen2_path: str, tmp_path: Path
) -> None:
    """``tokens="speakers"`` / ``--per speaker``: each speaker's last prompt + answer as one sequence, 1 in
    the mask where the speaker generated that very id (its last answer, and earlier answers its later
    prompts kept verbatim). One forward pass over the sequence gives back every masked log-probability:
    each such id saw exactly the prefix it was generated after."""
    import pandas as pd

    report = _debate(qwen2_path).rollout(n=2, out_dir=tmp_path / "run", seed=1)
    frame = report.to_pandas(tokens="speakers")
    assert len(frame) == 2 * 2 and sorted(frame["speaker"]) == ["a", "a", "b", "b"]
    model = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=torch.float32).eval()
    for row in frame.itertuples():
        turns = report.results[row.job_id].transcript
        last = turns[row.turns[-1]].tokens
        assert last is not None and list(row.input_ids) == [*last.prompt_ids, *last.ids]
        assert list(row.generated_mask[-len(last.ids) :]) == [1] * len(last.ids)
        assert list(row.turns) == [i for i, m in enumerate(turns) if m.author == row.speaker]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(row.input_ids)])).logits[0].log_softmax(-1)
        for p, generated in enumerate(row.generated_mask):
            if generated:
                want = logits[p - 1, row.input_ids[p]].item()
                assert abs(row.model_logprobs[p] - want) < 1e-4, (row.speaker, p)
            else:
                assert row.model_logprobs[p] == 0.0 and row.sampling_logprobs[p] == 0.0
    with pytest.raises(Exception, match="pass True or 'turns'"):
        report.to_pandas(tokens="rows")
    target = tmp_path / "speakers.parquet"
    command = [
        sys.executable,
        "-m",
        "interlens",
        "export",
        str(tmp_path / "run"),
        "--tokens",
        "--per",
        "speaker",
    ]
    done = subprocess.run(
        [*command, "-f", "parquet", "-o", str(target)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "wrote 4 speaker row(s)" in done.stderr, done.stderr
    exported = pd.read_parquet(target)
    assert [list(x) for x in exported["generated_mask"]] == [list(x) for x in frame["generated_mask"]]


def test_records_come_back_from_a_worker_process(qwen2_path: str, tmp_path: Path) -> None:
    """In a worker process (``devices=["cpu"]``) as in-process: ``rollout(record_tokens=True)`` turns the
    setting on for the local model, a scripted speaker's turns say why they have none, and each record comes
    back through the worker pipe into the parent's ledger whole."""
    from interlens import ScriptedParticipant

    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    local = AutoModelParticipant.from_pretrained(qwen2_path, name="a", max_new_tokens=6, temperature=0.9)
    conv = Conversation([local, ScriptedParticipant(name="s", replies=["ok"])], shared_context="Hi").turns(4)
    report = conv.rollout(n=2, devices=["cpu"], out_dir=tmp_path, seed=2, record_tokens=True, progress=False)
    assert not report.failed
    for result in report.results.values():
        for message in result.transcript[1:]:
            if message.author == "a":
                record = message.tokens
                assert record is not None and len(record.ids) == message.n_tokens
                assert tokenizer.decode(list(record.ids), skip_special_tokens=True) == message.content
            else:
                assert message.tokens is None and "no model tokens" in message.metadata["tokens_missing"]
    again = conv.rollout(n=2, devices=["cpu"], out_dir=tmp_path, seed=2, record_tokens=True, progress=False)
    assert again.skipped == sorted(report.results)
    for job_id, result in report.results.items():
        assert [m.tokens for m in again.results[job_id].transcript] == [m.tokens for m in result.transcript]
