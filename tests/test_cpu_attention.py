"""The CPU engine's decode-step attention (``interlens/engine/_cpu_attention.py``) against transformers' SDPA.

A CPU engine swaps the attention of its model's one-token steps of ``FEWEST_ROWS`` rows or more for two
batched matrix products; everything else (a prefill, a step of fewer rows, a GPU, another implementation the
user asked for) stays transformers' own. So: a decode step's logits match SDPA's to float32 rounding, over
a padded batch in the engine's narrowed static cache and over a dynamic cache with no mask; a prefill's
logits, and a step of few rows, are SDPA's bit for bit (but for the slot layout's steps, at any row count);
the engine's greedy tokens are the same on either; and only a model running ``sdpa`` gets it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from interlens.engine._cpu_attention import (
    CPU_DECODE_ATTENTION,
    FEWEST_ROWS,
    at_any_row_count,
    use_cpu_decode_attention,
)
from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings
from interlens.engine._narrow_cache import narrowed_static_cache
from interlens.testing import tiny_model

_STEPS = 6


def _model(family: str, implementation: str = "sdpa") -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model(family), attn_implementation=implementation).eval()


def _padded_steps(model: Any, rows: int = FEWEST_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of ``rows`` prompts (40 tokens, less 0, 7, 14, ... of padding) prefilled into a
    narrowed static cache, then ``_STEPS`` one-token steps as the engine feeds them: (prefill logits, step
    logits)."""
    generator = torch.Generator().manual_seed(0)
    width = 40
    ids = torch.randint(5, model.config.vocab_size, (rows, width), generator=generator)
    mask = torch.ones(rows, width + _STEPS, dtype=torch.long)
    for row in range(rows):
        mask[row, : 7 * row % 35] = 0
    cache = narrowed_static_cache(model.config, width + _STEPS)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = model(
            input_ids=ids, attention_mask=mask[:, :width], position_ids=positions, cache=cache, use_cache=True
        )
        prefill = out.logits.clone()
        token = out.logits[:, -1:].argmax(-1)
        steps = []
        for s in range(_STEPS):
            if hasattr(cache, "narrow"):  # not where a model has sliding-window layers (gemma3)
                cache.narrow(width + s + 1)
            position = mask[:, : width + s + 1].sum(-1, keepdim=True) - 1
            logits = model(
                input_ids=token, attention_mask=mask, position_ids=position, cache=cache, use_cache=True
            ).logits[:, -1]
            steps.append(logits.clone())
            token = logits.argmax(-1, keepdim=True)
    return prefill, torch.stack(steps)


def _dynamic_steps(model: Any) -> torch.Tensor:
    """One row, no mask, a dynamic cache (a single reuse stream's path): its step logits."""
    ids = torch.arange(5, 35).unsqueeze(0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        steps = []
        for s in range(_STEPS):
            position = torch.tensor([[ids.shape[1] + s]])
            logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[:, -1]
            steps.append(logits.clone())
            token = logits.argmax(-1, keepdim=True)
    return torch.stack(steps)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
def test_decode_steps_match_sdpa_and_the_prefill_is_sdpa_itself(family: str) -> None:
    model = _model(family)
    stock_prefill, stock_steps = _padded_steps(model)
    stock_dynamic = _dynamic_steps(model)
    assert use_cpu_decode_attention(model)
    assert model.config._attn_implementation == CPU_DECODE_ATTENTION
    prefill, steps = _padded_steps(model)
    assert torch.equal(prefill, stock_prefill)  # several query tokens: transformers' sdpa function, unchanged
    assert stock_steps.abs().max() > 1  # logits worth comparing
    torch.testing.assert_close(steps, stock_steps, rtol=1e-4, atol=1e-4)
    assert not torch.equal(steps, stock_steps)  # and it did run: the products round differently
    with at_any_row_count():  # one row, no mask: the slot layout's steps take it at every row count
        dynamic = _dynamic_steps(model)
    torch.testing.assert_close(dynamic, stock_dynamic, rtol=1e-4, atol=1e-4)
    assert not torch.equal(dynamic, stock_dynamic)
    assert torch.equal(_dynamic_steps(model), stock_dynamic)  # elsewhere a step of one row keeps SDPA


def test_a_step_of_fewer_rows_keeps_sdpa() -> None:
    model = _model("qwen2")
    few = FEWEST_ROWS - 1
    stock = _padded_steps(model, few)[1]
    use_cpu_decode_attention(model)
    assert torch.equal(_padded_steps(model, few)[1], stock)
    with at_any_row_count():
        assert not torch.equal(_padded_steps(model, few)[1], stock)


def test_the_engine_gives_the_same_greedy_tokens_on_either_attention() -> None:
    path = tiny_model("qwen2")
    model = _model("qwen2")
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu", kv_reuse_capacity=0)
    assert model.config._attn_implementation == CPU_DECODE_ATTENTION  # a CPU engine installs it
    requests = [
        GenerationRequest(
            prompt_ids=tuple(range(5 + i, 5 + i + n)),
            sampling=SamplingSettings(max_new_tokens=12, temperature=0.0),
        )
        for i, n in enumerate((30, 17, 4, 23, 9, 30, 2, 15, 11))
    ]
    assert len(requests) >= FEWEST_ROWS
    ours = [r.token_ids for r in engine.generate_batch(requests)]
    model.set_attn_implementation("sdpa")
    assert [r.token_ids for r in engine.generate_batch(requests)] == ours
    assert all(len(tokens) == 12 for tokens in ours)


def test_only_a_model_on_sdpa_gets_it() -> None:
    eager = _model("qwen2", "eager")
    assert not use_cpu_decode_attention(eager)
    LocalEngine(eager, AutoTokenizer.from_pretrained(tiny_model("qwen2")), device="cpu")
    assert eager.config._attn_implementation == "eager"  # what the user asked for stays
    stock = _model("qwen2")
    assert use_cpu_decode_attention(stock) and use_cpu_decode_attention(stock)  # twice: still installed
    assert stock.config._attn_implementation == CPU_DECODE_ATTENTION


def test_an_attention_named_in_load_kwargs_is_kept_even_sdpa() -> None:
    from interlens.engine import load_engine
    from interlens.engine._model_cache import forget_engine

    path = tiny_model("qwen2")
    default = load_engine(path)
    named = load_engine(path, load_kwargs={"attn_implementation": "sdpa"})
    try:
        assert default is not named
        assert default.model.config._attn_implementation == CPU_DECODE_ATTENTION
        assert named.model.config._attn_implementation == "sdpa"
    finally:
        forget_engine(default)
        forget_engine(named)
