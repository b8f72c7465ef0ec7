"""An RMSNorm whose reduction order is fixed by the hidden width alone, never by the number of rows.

Why: a row's mean of squares is a reduction, and a library's reduction kernel picks its blocking (how many
partial sums, which lanes add which elements) from the whole tensor's shape. On the first H200 run the 3B
shape failed the batch-invariance self-test in bfloat16 with every linear layer invariant (suspected: the
norms, whose CUDA reduction is shaped by the row count), and vLLM's and SGLang's batch-invariant modes both
replace RMSNorm with a fixed-order kernel. Here the sum of squares is built from element-wise additions
only: the width is halved while it is even (column ``j`` plus column ``j + w/2``), then the odd remainder is
added column by column, left to right. An element-wise addition is one correctly rounded IEEE operation per
element on every device, whatever the tensor's size, so a row's result is bitwise the same alone and among
any number of rows. It costs ``log2(width)`` small element-wise kernels a norm instead of one reduction, so
the engine swaps it in only where the stock norm is not invariant (CUDA), within the deterministic path's
forward passes (:func:`fixed_order_norms`), as ``_slot_rows`` swaps its fixed-row linear layers.

Only norms of the common form are swapped (:func:`swappable`): a module whose class name ends in
``RMSNorm`` with a ``weight`` of the hidden width and a ``variance_epsilon``, computing
``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)`` in float32 (Llama, Qwen2/3, Mistral, SmolLM, Phi-3
and most others in transformers). Others (Gemma's ``1 + weight``, LayerNorm with a bias) keep their own
forward; where theirs is not invariant the self-test says so and the rows run alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["fixed_order_norms", "fixed_order_rms_norm", "fixed_order_square_sum", "swappable"]


def fixed_order_square_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of squares over the last dimension of ``x`` (computed in float32), shape ``(..., 1)``, in an
    order set by the width alone (see the module docstring)."""
    part = x.float().square()
    while part.shape[-1] > 1 and part.shape[-1] % 2 == 0:
        half = part.shape[-1] // 2
        part = part[..., :half] + part[..., half:]
    total = part[..., :1]
    for j in range(1, part.shape[-1]):  # the odd remainder (9 for a width of 576), left to right
        total = total + part[..., j : j + 1]
    return total


def fixed_order_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)`` (transformers' RMSNorm), its mean from
    :func:`fixed_order_square_sum`."""
    import torch

    variance = fixed_order_square_sum(x) / x.shape[-1]
    normed = x.float() * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype)


def swappable(module: Any) -> bool:
    """Whether ``module`` is an RMSNorm of the form :func:`fixed_order_rms_norm` computes."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and getattr(weight, "dim", lambda: 0)() == 1
        and "Gemma" not in type(module).__name__  # ``(1 + weight)``: another formula
    )


@contextlib.contextmanager
def fixed_order_norms(model: Any) -> Iterator[int]:
    """While inside, every swappable RMSNorm of ``model`` computes through :func:`fixed_order_rms_norm`
    (its ``forward`` replaced on the instance, removed on exit); yields how many were swapped."""
    norms = [m for m in model.modules() if swappable(m)]
    for module in norms:
        module.forward = _bound(module)
    try:
        yield len(norms)
    finally:
        for module in norms:
            del module.forward


def _bound(module: Any) -> Any:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return fixed_order_rms_norm(hidden_states, module.weight, module.variance_epsilon)

    return forward
