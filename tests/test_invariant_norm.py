"""The fixed-order RMSNorm (engine/_invariant_norm.py): a row's output does not depend on how many rows
share the call, and it computes what the model's own norm computes (to rounding)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from interlens.engine._invariant_norm import fixed_order_norms, fixed_order_rms_norm, fixed_order_square_sum
from interlens.testing import tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 896, 2048, 7])
def test_a_rows_norm_is_bitwise_the_same_at_1_4_8_and_16_rows(width: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(16, width, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    alone = fixed_order_rms_norm(x[:1], weight, 1e-6)
    for rows in (4, 8, 16):
        together = fixed_order_rms_norm(x[:rows], weight, 1e-6)
        assert torch.equal(together[:1], alone), rows
        # and every other row, against itself alone
        assert all(
            torch.equal(together[r], fixed_order_rms_norm(x[r : r + 1], weight, 1e-6)[0]) for r in range(rows)
        )
    # the sum of squares is the float32 sum, to float32 rounding
    exact = x.double().square().sum(-1, keepdim=True)
    assert torch.allclose(fixed_order_square_sum(x).double(), exact, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swapped_norms_compute_what_the_models_own_norms_compute(dtype: torch.dtype) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=dtype).eval()
    norm = model.model.norm
    x = torch.randn(5, 3, norm.weight.shape[0]).to(dtype)
    own = norm(x)
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        with fixed_order_norms(model) as swapped:
            mine = norm(x)
            swapped_logits = model(input_ids=ids).logits
        after = norm(x)
    layers = model.config.num_hidden_layers
    assert swapped == 2 * layers + 1 + 2 * layers * hasattr(model.model.layers[0].self_attn, "q_norm")
    tolerance = 1e-5 if dtype is torch.float32 else 2e-2
    assert torch.allclose(mine.float(), own.float(), atol=tolerance, rtol=tolerance)
    assert torch.allclose(swapped_logits.float(), logits.float(), atol=10 * tolerance, rtol=10 * tolerance)
    assert torch.equal(after, own)  # the model's own forward is back on exit
