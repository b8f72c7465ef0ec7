"""Shared-prefix prefill (``interlens.engine._prefill``): rows of one batch sharing a long token prefix
prefill it once, then their own suffixes, and decode exactly as the plain left-padded batch does.

References are the engine's own plain path (``shared_prefill=False``: one left-padded prefill of every row)
on the same tiny float32 models; nothing is mocked.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import AutoModelParticipant, Conversation, dataset_field
from interlens.engine._decode import left_pad
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.engine._prefill import MIN_SHARED_PREFIX, plain_static, prefix_groups
from interlens.testing import tiny_model

_SUFFIXES = (
    "What is two plus two?",
    "Name a colour.",
    "hi",
    "Explain castling in chess to a child who knows nothing of the game.",
    "Zebra?",
)


@pytest.fixture(scope="module", params=["qwen2", "llama", "gemma2"])
def engine(request: pytest.FixtureRequest) -> LocalEngine:
    path = tiny_model(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")


def _ids(engine: LocalEngine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def _prefix(engine: LocalEngine, n: int = 100) -> list[int]:
    ids = _ids(engine, " ".join(f"rule{i} holds." for i in range(n)))
    assert len(ids) >= n
    return ids[:n]


def _requests(engine: LocalEngine) -> list[GenerationRequest]:
    prefix = _prefix(engine)
    requests = [
        GenerationRequest(
            prompt_ids=prefix + _ids(engine, text),
            sampling=SamplingSettings(max_new_tokens=12, temperature=0 if i % 2 else 0.9, seed=i),
        )
        for i, text in enumerate(_SUFFIXES)
    ]
    unrelated = _ids(engine, "An unrelated short prompt")
    requests.insert(
        2,
        GenerationRequest(prompt_ids=unrelated, sampling=SamplingSettings(max_new_tokens=12, temperature=0)),
    )
    return requests


def _ok(results: list[GenerationResult | Exception]) -> list[GenerationResult]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return [r for r in results if isinstance(r, GenerationResult)]


def test_shared_prefix_rows_give_the_plain_batch_tokens(engine: LocalEngine) -> None:
    requests = _requests(engine)
    shared = _ok(engine.generate_batch(requests))
    engine.shared_prefill = False
    try:
        plain = _ok(engine.generate_batch(requests))
    finally:
        engine.shared_prefill = True
    assert [r.token_ids for r in shared] == [r.token_ids for r in plain]
    assert all(r.shared_prefix_tokens == 0 and not r.shared_prefill for r in plain)
    if engine.model.config.model_type == "gemma2":
        # sliding-window layers count cache slots, and the shared layout has masked holes: not shared
        assert [r.shared_prefix_tokens for r in shared] == [0] * 6
    else:
        assert [r.shared_prefix_tokens for r in shared] == [100, 100, 0, 100, 100, 100]
        assert [r.shared_prefill for r in shared] == [True, True, False, True, True, True]
    assert all(r.batch_size == 6 for r in shared)


def test_shared_prefix_prefill_logits_match_a_plain_prefill(engine: LocalEngine) -> None:
    from transformers import StaticCache

    requests = _requests(engine)
    prompts = [r.prompt_ids for r in requests]
    width = max(len(p) for p in prompts)
    with torch.inference_mode():
        ids, mask = left_pad(prompts, width, engine._runner.pad_id)
        plain = engine._runner.forward(
            ids, mask, StaticCache(config=engine.model.config, max_cache_len=width)
        )
        cache = StaticCache(config=engine.model.config, max_cache_len=width + 4)
        if engine.model.config.model_type == "gemma2":
            # sliding-window layers: the engine never takes this path (the tokens test checks the fallback)
            assert not plain_static(cache)
            return
        shared, laid = engine._plain.prefill_parts(requests, [(100, [0, 1, 3, 4, 5]), (0, [2])], cache, width)
    assert torch.allclose(shared, plain, atol=1e-4, rtol=1e-4), (shared - plain).abs().max()
    assert shared.argmax(-1).tolist() == plain.argmax(-1).tolist()
    # [pad][prefix][masked hole][suffix]: every row's real tokens counted once, its last token at the end
    assert laid.sum(-1).tolist() == [len(p) for p in prompts]
    assert laid[:, -1].tolist() == [1] * 6
    group_width = max(len(prompts[r]) for r in (0, 1, 3, 4, 5))
    for row in (0, 1, 3, 4, 5):
        n = len(prompts[row])
        expected = [0] * (width - group_width) + [1] * 100 + [0] * (group_width - n) + [1] * (n - 100)
        assert laid[row].tolist() == expected
    assert len(prompts[1]) < group_width  # this row really has a hole between prefix and suffix


def test_prefix_groups_pick_long_common_prefixes() -> None:
    system = tuple(range(100, 140))  # 40 shared tokens
    rows = [(*system, 1, 2), (*system, 3), (7, 8, 9), (*system, 1, 2, 5), (7, 8)]
    assert prefix_groups(rows) == [(40, [0, 1, 3])]
    # identical prompts share all but their last token; a prefix under the minimum is not worth a call
    assert prefix_groups([system, system]) == [(39, [0, 1])]
    assert prefix_groups([(*system[:20], 1), (*system[:20], 2)]) == []
    assert prefix_groups([(*system, 1), (*system, 2)], min_tokens=41) == []
    # a row that would cut a long shared prefix to a short one starts its own group
    long = tuple(range(500, 600))
    rows = [(*long, 1), (*long, 2), (*long[:35], 3), (*long[:35], 4)]
    assert prefix_groups(rows) == [(35, [2, 3]), (100, [0, 1])]
    assert MIN_SHARED_PREFIX == 32


def test_data_rollout_records_its_shared_prefix(qwen2_path, tmp_path) -> None:
    system = " ".join(f"Rule {i}: answer briefly." for i in range(8))
    solver = AutoModelParticipant.from_pretrained(
        qwen2_path, name="solver", temperature=0, max_new_tokens=8, system_prompt=system
    )
    # suffixes of very different lengths: the short rows' holes (masked slots between the shared prefix and
    # their suffix) are longer than their prompts, so attending to them would change their greedy answers
    long = "Explain, step by step and with an example for each step, " * 6
    questions = (long + "why is the sky blue?", "Name a prime.", "hi", "Why is the sky blue today?")
    rows = [{"q": q} for q in questions]
    conv = Conversation(participants=[solver], shared_context=("Q: ", dataset_field("q"))).turns(1).data(rows)
    report = conv.rollout(devices=["cpu"], out_dir=tmp_path / "shared", seed=0)
    assert report.failed == []
    engine = solver.live_engine().engine
    system_tokens = len(_ids(engine, system))
    turns = [res.transcript[1] for res in report.results.values()]
    assert all(m.metadata["batch_size"] == 4 for m in turns)
    shared = {m.metadata["shared_prefix_tokens"] for m in turns}
    assert len(shared) == 1 and shared.pop() >= system_tokens
    assert all(m.metadata["shared_prefill"] for m in turns)
    # the same rollout with the plain batched prefill: the same greedy answers, nothing shared
    engine.shared_prefill = False
    try:
        plain = conv.rollout(devices=["cpu"], out_dir=tmp_path / "plain", seed=0)
    finally:
        engine.shared_prefill = True
    plain_turns = [res.transcript[1] for res in plain.results.values()]
    assert [m.content for m in plain_turns] == [m.content for m in turns]
    assert all(m.metadata["shared_prefix_tokens"] == 0 for m in plain_turns)
