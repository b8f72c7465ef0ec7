"""The engine's parts alone: the kept-KV store's bounds, and each generation path over a bare model runner.

``LocalEngine`` composes a model runner, a kept-KV store and one object per generation path and only picks
the path per batch; so each path built by hand over a runner of the same tiny model (saved and loaded through
``from_pretrained``) must give the very tokens the engine gives, and the store must evict as the engine's
reuse relies on: least recently used first, within its streams and bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens.engine._batch_invariance import batch_invariant
from interlens.engine._decode import ModelRunner
from interlens.engine._generation import (
    GenerationRequest,
    GenerationResult,
    LocalEngine,
    SamplingSettings,
    ScoreRequest,
)
from interlens.engine._interp_rows import HookedRow
from interlens.engine._kept_kv import Kept, KeptKV
from interlens.engine._kv_reuse import ReusedPrefixBatch
from interlens.engine._prefill import PlainBatch
from interlens.engine._slot_rows import SlotLayout
from interlens.interp import CaptureSpec
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

_TOPICS = (
    "hi",
    "Debate: tabs versus spaces. Give your strongest argument and one weakness of it.",
    "Summarise the rules of chess in two sentences, then explain castling to a child who knows nothing.",
    "What is 2 + 2?",
)

# ---------------------------------------------------------------------------------------------- the store


def _entry(nbytes: int) -> Kept:
    return Kept(ids=[1, 2, 3], kv=[], nbytes=nbytes)


def test_the_store_evicts_the_least_recently_used_first_over_its_byte_budget() -> None:
    store = KeptKV(capacity=10, budget=100, device="cpu")
    for key, size in (("a", 30), ("b", 30), ("c", 30)):
        store.keep(key, _entry(size))
    assert list(store) == ["a", "b", "c"] and store.kept_bytes() == 90
    store.keep("a", store.take("a") or _entry(0))  # a turn of stream "a": taken out, then kept again
    assert list(store) == ["b", "c", "a"] and store.kept_bytes() == 90
    store.keep("d", _entry(50))  # 140 > 100: the oldest go until it fits, "b" then "c"
    assert list(store) == ["a", "d"] and store.kept_bytes() == 80
    assert store["a"].nbytes == 30 and "b" not in store and len(store) == 2
    store.keep("e", _entry(101))  # larger than the whole budget: not kept, and evicts nothing
    assert list(store) == ["a", "d"] and store.kept_bytes() == 80
    store.keep("a", _entry(101))  # a stream whose new cache does not fit loses its old one too
    assert list(store) == ["d"] and store.kept_bytes() == 50


def test_the_store_is_bounded_in_streams_and_frees_bytes_on_take_drop_and_clear() -> None:
    store = KeptKV(capacity=2, budget=None, device="cpu")  # budget from the free memory, on first keep
    store.keep("a", _entry(10))
    assert store.byte_limit() > 10
    store.keep("b", _entry(20))
    store.keep("c", _entry(40))  # a third stream: the least recently used one goes
    assert list(store) == ["b", "c"] and store.kept_bytes() == 60
    taken = store.take("b")
    assert taken is not None and taken.nbytes == 20 and list(store) == ["c"] and store.kept_bytes() == 40
    assert store.take("b") is None and store.take(None) is None
    store.drop("c")
    store.drop("never kept")
    assert store == {} and store.kept_bytes() == 0
    store.keep("x", _entry(5))
    store.clear()
    assert len(store) == 0 and store.kept_bytes() == 0
    assert store.enabled
    assert not KeptKV(capacity=0, budget=None, device="cpu").enabled
    assert not KeptKV(capacity=5, budget=0, device="cpu").enabled
    off = KeptKV(capacity=0, budget=100, device="cpu")
    off.keep("a", _entry(1))
    assert off == {} and off.kept_bytes() == 0


# ---------------------------------------------------------------------------------------------- the paths


@pytest.fixture(scope="module")
def qwen2() -> tuple[Any, Any]:
    path = tiny_model("qwen2")  # plain static layers: every path applies
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _prompt(tokenizer: Any, text: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(ids)


def _requests(tokenizer: Any, **settings: Any) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_ids=_prompt(tokenizer, t),
            sampling=SamplingSettings(max_new_tokens=5 + 3 * i, temperature=0.9, seed=i),
            **settings,
        )
        for i, t in enumerate((*_TOPICS, _TOPICS[0]))  # the last row's prompt is the first's
    ]


def _tokens(results: Sequence[GenerationResult | Exception]) -> list[list[int]]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return [r.token_ids for r in results if isinstance(r, GenerationResult)]


def test_the_plain_batch_over_a_bare_runner_gives_the_engines_tokens(qwen2: tuple[Any, Any]) -> None:
    """Batched (a shared prefill) and each row alone through the path, and through the engine: one answer."""
    model, tokenizer = qwen2
    requests = _requests(tokenizer)
    plain = PlainBatch(ModelRunner(model, tokenizer, device="cpu"))
    with torch.inference_mode():
        batched = plain.generate(requests, None)
        alone = [plain.generate([r], None)[0] for r in requests]
    engine = LocalEngine(model, tokenizer, device="cpu")
    by_engine = engine.generate_batch(requests)
    assert _tokens(batched) == _tokens(alone) == _tokens(by_engine)
    # Qwen's default system prompt opens every prompt: every row shares a long prefix with the others
    shared = [r.shared_prefix_tokens for r in batched]  # type: ignore[union-attr]
    assert shared == [r.shared_prefix_tokens for r in by_engine] and all(n > 0 for n in shared)


def test_the_slot_layout_over_a_bare_runner_passes_the_self_test_and_gives_the_engines_tokens(
    stock_invariant_dtype: str,
) -> None:
    path = tiny_model("qwen2")  # in the dtype whose stock kernels pass the self-test on this CPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, stock_invariant_dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    requests = _requests(tokenizer)
    layout = SlotLayout(ModelRunner(model, tokenizer, device="cpu"))
    with torch.inference_mode():
        assert layout.supported() and batch_invariant(layout)
        together = layout.generate(requests, None)
        alone = [layout.generate([r], None)[0] for r in requests]
    engine = LocalEngine(model, tokenizer, device="cpu")
    by_engine = engine.generate_batch(requests, mode=ExecutionMode.DETERMINISTIC)
    assert engine.batch_invariant is True
    assert _tokens(together) == _tokens(alone) == _tokens(by_engine)
    assert [r.batch_size for r in together] == [r.batch_size for r in by_engine] == [5] * 5  # type: ignore[union-attr]


def test_the_reused_prefix_batch_over_a_bare_runner_and_store_gives_the_engines_tokens(
    qwen2: tuple[Any, Any],
) -> None:
    model, tokenizer = qwen2
    runner = ModelRunner(model, tokenizer, device="cpu")
    store = KeptKV(capacity=8, budget=None, device="cpu")
    reused = ReusedPrefixBatch(runner, plain=PlainBatch(runner), kept=store)
    engine = LocalEngine(model, tokenizer, device="cpu", kv_reuse_capacity=0)  # a full prefill every turn
    keys = ["s0", "s1", None, "s3"]  # a row with no stream co-steps with them
    first = [
        GenerationRequest(
            _prompt(tokenizer, t),
            sampling=SamplingSettings(max_new_tokens=6 + i, temperature=0.9, seed=i),
            reuse_key=key,
        )
        for i, (t, key) in enumerate(zip(_TOPICS, keys, strict=True))
    ]
    with torch.inference_mode():
        turn1 = reused.generate(first, None)
    assert _tokens(turn1) == _tokens(engine.generate_batch(first))
    assert list(store) == ["s0", "s1", "s3"]
    assert store.kept_bytes() == sum(store[k].nbytes for k in store) > 0
    more = tokenizer(" and then what?", add_special_tokens=False).input_ids
    second = [
        GenerationRequest(
            (*r.prompt_ids, *t[:-1], *more),
            sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=10 + i),
            reuse_key=r.reuse_key,
        )
        for i, (r, t) in enumerate(zip(first, _tokens(turn1), strict=True))
    ]
    with torch.inference_mode():
        turn2 = reused.generate(second, None)
    assert _tokens(turn2) == _tokens(engine.generate_batch(second))
    counts = [r.kv_reused_tokens for r in turn2]  # type: ignore[union-attr]
    assert counts[2] == 0 and all(n > 0 for i, n in enumerate(counts) if i != 2)


def test_the_hooked_row_over_a_bare_runner_gives_the_engines_tokens_capture_and_scores(
    qwen2: tuple[Any, Any],
) -> None:
    """A captured row samples the tokens of the same row without the capture; its scores are the model's
    own teacher-forced log-probabilities."""
    model, tokenizer = qwen2
    runner = ModelRunner(model, tokenizer, device="cpu")
    plain = PlainBatch(runner)
    hooked = HookedRow(runner, plain=plain)
    engine = LocalEngine(model, tokenizer, device="cpu")
    request = GenerationRequest(
        _prompt(tokenizer, _TOPICS[1]),
        sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=3),
        capture=CaptureSpec(),
    )
    assert hooked.check(request.capture, request.steering) is None
    assert hooked.check(CaptureSpec(layers=(99,)), ()) is not None  # past this model's layers
    with torch.inference_mode():
        (alone,) = hooked.generate([request], None)
        (uncaptured,) = plain.generate(
            [
                GenerationRequest(
                    request.prompt_ids, sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=3)
                )
            ],
            None,
        )
    (want,) = engine.generate_batch([request])
    assert isinstance(alone, GenerationResult) and isinstance(want, GenerationResult)
    assert alone.token_ids == want.token_ids == _tokens([uncaptured])[0]
    assert alone.captured is not None and want.captured is not None
    assert (
        set(alone.captured.tensors)
        == set(want.captured.tensors)
        == {("residual", i) for i in range(len(hooked.layers()))}
    )
    for key, tensor in alone.captured.tensors.items():
        torch.testing.assert_close(tensor, want.captured.tensors[key], rtol=0, atol=0)
    score = ScoreRequest(request.prompt_ids, tuple(want.token_ids))
    with torch.inference_mode():
        mine = hooked.score(score)
        ids = torch.tensor([score.prompt_ids + score.continuation_ids])
        logits = model(input_ids=ids).logits[0, len(score.prompt_ids) - 1 : -1].float()
        direct = torch.log_softmax(logits, -1).gather(-1, ids[0, len(score.prompt_ids) :, None])[:, 0]
    (theirs,) = engine.score([score])
    assert mine.logprobs == theirs.logprobs  # type: ignore[union-attr]
    torch.testing.assert_close(torch.tensor(mine.logprobs), direct, rtol=1e-5, atol=1e-5)
