"""Rollouts over real tiny HF models: co-stepping, shared prefill, deterministic mode, OOM isolation."""

from __future__ import annotations

import pytest

import interlens
from interlens import AutoModelParticipant, Conversation, ScriptedParticipant, dataset_field


def model_debate(path: str, **settings) -> Conversation:
    a = AutoModelParticipant.from_pretrained(path, name="a", temperature=0.9, max_new_tokens=8, **settings)
    b = AutoModelParticipant.from_pretrained(path, name="b", temperature=0.9, max_new_tokens=8, **settings)
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(4)


def test_two_model_debate_rollout_co_steps(qwen2_path, tmp_path):
    conv = model_debate(qwen2_path)
    report = conv.rollout(n=8, devices=["cpu"], out_dir=tmp_path / "debate", seed=0)
    assert report.failed == [] and len(report.results) == 8
    for job_id, res in report.results.items():
        assert res.error is None and res.device == "cpu"
        turns = res.transcript[1:]
        assert [m.author for m in turns] == ["a", "b", "a", "b"]
        assert all(m.metadata["batched"] and m.metadata["batch_size"] == 8 for m in turns), job_id
        assert res.tokens_generated == sum(m.n_tokens for m in turns) > 0
    # turn 1: eight samples off one identical prompt were prefilled once
    first_turns = [res.transcript[1] for res in report.results.values()]
    assert all(m.metadata["shared_prefill"] for m in first_turns)
    assert len({m.content for m in first_turns}) > 1  # sampled independently
    assert conv.generated_turns == 0  # rollout copies, never mutates


def test_deterministic_mode_is_token_identical_run_to_run(qwen2_path, co_step_dtype):
    conv = model_debate(qwen2_path, kv_reuse=False, dtype=co_step_dtype).turns(3)
    first = conv.rollout(n=3, devices=["cpu"], batched=False, seed=7)
    second = conv.rollout(n=3, devices=["cpu"], batched=False, seed=7)
    for job_id in first.results:
        t1, t2 = first.results[job_id].transcript, second.results[job_id].transcript
        assert [m.content for m in t1] == [m.content for m in t2]
        # co-stepped where the engine's self-test found its deterministic path batch-invariant
        assert all(m.metadata["batch_invariant"] is True for m in t1[1:])
    assert {m.metadata["batch_size"] for r in first.results.values() for m in r.transcript[1:]} == {3}
    contents = [first.results[j].transcript[1].content for j in first.results]
    assert len(set(contents)) > 1  # different rollout seeds, different samples


def test_analyzer_samples_the_live_model_inside_the_rollout(qwen2_path):
    def stance(conv):
        reply = conv.sample("a", "One word stance?")
        return {"n_turns": len(conv.transcript), "stance_tokens": reply.n_tokens}

    report = model_debate(qwen2_path).turns(2).analyzer(stance).rollout(n=4, devices=["cpu"])
    for res in report.results.values():
        assert res.error is None
        assert res.analysis["n_turns"] == 3 and 1 <= res.analysis["stance_tokens"] <= 8


def test_injected_oom_in_one_row_of_sixteen_fails_only_that_row(qwen2_path):
    torch = pytest.importorskip("torch")
    solver = AutoModelParticipant.from_pretrained(qwen2_path, name="solver", max_new_tokens=4)
    engine = solver.live_engine()
    marker = engine.tokenizer("POISONPILL", add_special_tokens=False)["input_ids"]
    seen_batches: list[int] = []

    def out_of_memory_on_poison(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape[1] < len(marker):
            return None
        windows = ids.unfold(1, len(marker), 1)
        if (windows == torch.tensor(marker)).all(-1).any():
            seen_batches.append(ids.shape[0])  # batches holding the poisoned row (not a shared prefix's)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        return None

    handle = engine.engine.model.register_forward_pre_hook(out_of_memory_on_poison, with_kwargs=True)
    try:
        rows = [{"q": f"What is {i} plus {i}?"} for i in range(16)]
        rows[5] = {"q": "What is POISONPILL?"}
        conv = Conversation(participants=[solver], shared_context=dataset_field("q")).turns(1).data(rows)
        report = conv.rollout(devices=["cpu"], max_batch_size=16)
    finally:
        handle.remove()
    assert report.failed == ["row_00005"]
    err = report.results["row_00005"].error
    assert err.type == "OutOfMemoryError" and "injected" in err.message
    assert all(report.results[f"row_{i:05d}"].error is None for i in range(16) if i != 5)
    assert seen_batches[0] == 16 and seen_batches[-1] == 1  # split in halves down to the single bad row


def test_mixed_lineups_share_one_pool(qwen2_path, llama_path):
    qa = model_debate(qwen2_path).turns(2).name("qwen_pair")
    la = model_debate(llama_path).turns(2).name("llama_pair")
    host = ScriptedParticipant("host", ["Go on."])
    mixed = Conversation(
        participants=[host, AutoModelParticipant.from_pretrained(qwen2_path, name="guest", max_new_tokens=4)]
    ).turns(2)
    report = interlens.run([qa, la, mixed.name("mixed")], devices=["cpu"])
    assert sorted(report.results) == ["llama_pair", "mixed", "qwen_pair"]
    assert report.failed == []
    guest_turn = report.results["mixed"].transcript[-1]
    assert guest_turn.author == "guest" and guest_turn.metadata["model"] == qwen2_path


def test_token_budget_on_the_batched_path(qwen2_path):
    from interlens import TokenBudget

    conv = model_debate(qwen2_path).turns(None)
    with TokenBudget(per_conversation=10, per_turn=4):
        report = conv.rollout(n=6, devices=["cpu"])
    assert report.failed == []
    for res in report.results.values():
        turns = res.transcript[1:]
        assert all(m.n_tokens <= 4 for m in turns)
        assert res.tokens_generated == sum(m.n_tokens for m in turns)
        # stops once ITS OWN spend reaches the budget; the last turn is capped to what was left
        assert res.tokens_generated == 10
        assert any(m.metadata["batched"] for m in turns)


def test_a_prompt_past_the_models_context_fails_its_job_naming_the_lengths(qwen2_path):
    """A model past its positions gives no answer (RoPE extrapolates into noise): the job fails, saying how
    long the prompt is, how long the context is, and what to do; the other rows are answered."""
    from interlens import dataset_field

    solver = AutoModelParticipant.from_pretrained(qwen2_path, name="solver", max_new_tokens=4)
    context = solver.live_engine().engine.model.config.max_position_embeddings
    rows = [{"q": "What is 2 plus 2?"}, {"q": "tabs " * (context + 50)}, {"q": "Name a color."}]
    conv = Conversation(participants=[solver], shared_context=dataset_field("q")).turns(1).data(rows)
    report = conv.rollout(devices=["cpu"], progress=False)
    assert report.failed == ["row_00001"]
    error = report.results["row_00001"].error
    assert error is not None and error.type == "GenerationError"
    assert f"this model's context holds {context:,} positions" in error.message
    assert "the prompt is" in error.message and "shorten the conversation" in error.message
