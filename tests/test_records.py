"""One record per concept: a local turn's sampling settings travel as one ``SamplingSettings``, and a
``RunResult`` reads its facts from the job's ``JobOutcome`` (in memory, from the ledger, and when skipped)."""

from __future__ import annotations

import pytest

from interlens import AutoModelParticipant, ConfigurationError, Conversation, ScriptedParticipant
from interlens._core._view import GenerationOptions, View
from interlens.engine._generation import GenerationRequest
from interlens.engine._sampling import SamplingSettings
from interlens.store import LedgerReader


def _speaker(name: str) -> ScriptedParticipant:
    return ScriptedParticipant(name, lambda view: f"{name} turn {view.own_turns}")


def _conv() -> Conversation:
    return (
        Conversation(participants=[_speaker("a"), _speaker("b")], shared_context="Go.")
        .turns(2)
        .analyzer(lambda conv: {"turns": len(conv.transcript), "row": conv.row["q"]})
    )


def _facts(result) -> dict[str, object]:
    return {
        "job_id": result.job_id,
        "error": None if result.error is None else result.error.type,
        "analysis": result.analysis,
        "device": result.device,
        "tokens_generated": result.tokens_generated,
        "attempts": result.attempts,
        "row_index": result.row_index,
        "seed": result.seed,
        "transcript": None if result.transcript is None else [m.content for m in result.transcript],
    }


def test_run_result_facts_match_in_memory_ledger_and_skipped(tmp_path):
    rows = [{"q": "x"}, {"q": "y"}]
    memory = _conv().data(rows).rollout(n=2, seed=40)
    on_disk = _conv().data(rows).rollout(n=2, seed=40, out_dir=tmp_path)
    again = _conv().data(rows).rollout(n=2, seed=40, out_dir=tmp_path)

    assert len(memory.results) == 2
    for job_id, res in memory.results.items():
        assert res.job_id == job_id and res.error is None and res.skipped is False
        assert res.attempts == 1 and isinstance(res.row_index, int) and isinstance(res.seed, int)
        assert res.analysis == {"turns": 3, "row": rows[res.row_index]["q"]}
        assert res.tokens_generated == res.transcript.tokens_generated > 0
        assert res.conversation.seed == res.seed and res.conversation.row == rows[res.row_index]
        assert _facts(on_disk.results[job_id]) == _facts(res)
        assert on_disk.results[job_id].skipped is False
        skipped = again.results[job_id]
        assert skipped.skipped is True and _facts(skipped) == _facts(res)
        assert repr(res) == f"RunResult({job_id!r}, ok, tokens={res.tokens_generated}, device={res.device!r})"
    with LedgerReader(tmp_path) as reader:  # what the scheduler recorded is what the results report
        for job_id, res in on_disk.results.items():
            job = reader.job(job_id)
            assert job is not None and res.device is not None
            assert (res.device, res.attempts, res.seed, res.row_index, res.tokens_generated) == (
                job.device,
                job.attempts,
                job.seed,
                job.row_index,
                job.tokens_generated,
            )
    assert sorted({r.row_index for r in memory.results.values()}) == [0, 1]
    assert sorted(r.seed for r in memory.results.values()) == sorted(
        set(r.seed for r in memory.results.values())
    )


def test_run_result_of_a_failed_job_has_its_error_and_no_conversation():
    def fail(view: View) -> str:
        raise RuntimeError("scripted failure")

    conv = Conversation(participants=[ScriptedParticipant("a", fail)], shared_context="Go.").turns(1)
    [res] = conv.rollout(n=1).results.values()
    assert res.error is not None and "scripted failure" in res.error.message
    assert res.skipped is False and res.attempts == 1 and res.analysis is None
    assert res.conversation is None or res.conversation.transcript[-1].author != "a"


def test_a_turns_sampling_settings_travel_as_one_record(qwen2_path):
    participant = AutoModelParticipant.from_pretrained(
        qwen2_path, name="a", temperature=0.7, top_p=0.9, max_new_tokens=8, stop=["###"]
    )
    options = GenerationOptions(max_new_tokens=5, seed=3, stream_id="job-1")
    request = participant.request(View("a", None, ()), options)
    assert request.sampling == SamplingSettings(
        max_new_tokens=5, temperature=0.7, top_p=0.9, stop=("###",), seed=3
    )
    assert request.reuse_key == ("job-1", "a")

    handed_on = GenerationRequest((1, 2), sampling=request.sampling, reuse_key=request.reuse_key)
    assert handed_on.sampling is request.sampling
    by_keywords = GenerationRequest(
        prompt_ids=[1, 2],
        sampling=SamplingSettings(max_new_tokens=5, temperature=0.7, top_p=0.9, stop=["###"], seed=3),  # type: ignore[arg-type]
        reuse_key=("job-1", "a"),
    )
    assert by_keywords == handed_on
    assert (
        by_keywords.sampling.max_new_tokens,
        by_keywords.sampling.temperature,
        by_keywords.sampling.top_p,
    ) == (5, 0.7, 0.9)
    assert (by_keywords.sampling.stop, by_keywords.sampling.seed) == (("###",), 3)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (SamplingSettings(max_new_tokens=0), "GenerationRequest(max_new_tokens=0)"),
        (SamplingSettings(max_new_tokens=4, top_p=0.0), "GenerationRequest(top_p=0.0)"),
        (SamplingSettings(max_new_tokens=4, stop="###"), "stop=('###',)"),  # type: ignore[arg-type]
    ],
)
def test_settings_handed_to_the_engine_are_checked_there(settings: SamplingSettings, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        GenerationRequest((1,), sampling=settings)
    assert message in str(info.value)
