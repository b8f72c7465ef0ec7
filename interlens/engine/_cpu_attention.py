"""Decode-step attention on the CPU: two batched matrix products instead of SDPA's CPU kernel.

A decode step feeds one token per row, so each row's attention is a (heads × 1) query against its cached
keys: a few thousand multiply-adds per head, nothing a fused kernel can win on. PyTorch's CPU SDPA kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which transformers' ``sdpa`` reaches with a padding mask)
spends its time on setup and blocking instead: on SmolLM2-135M in bfloat16 (2 cores, AMD EPYC with
AVX512-BF16, 16 rows, ~360 cached tokens) it took 0.53 ms of a 39 ms step per layer, 40 % of the step.
Here each key/value head's query group is one small matrix, ``scores = keys · queriesᵀ`` and
``out = softmax(scores) · values`` run as two ``bmm`` calls (softmax in float32, as transformers' ``eager``
does). The model's step ran 1.12× (1.09–1.13) faster at 16 rows and 1.29× (1.25–1.44) at 64 over 351-token
prompts, 1.01× and 1.07× over 30-token ones, but 0.94× at one row (``benchmarks/bench_decode_step.py
--attention [--context 350]``; results in ``benchmarks/RESULTS.md``), hence :data:`FEWEST_ROWS`. Both products
read the cache's keys row by row: the narrowed window of a static cache (``_narrow_cache``) is a view whose
rows are contiguous, and ``keys · queriesᵀ`` costs less on it than ``queries · keysᵀ`` (the matrix library
still copies the window: a cost that grows with rows × context).

Only decode steps on the CPU take this path; a prefill (several query tokens), a GPU, dropout, an additive
position bias, logit soft-capping or attention sinks all go to transformers' own ``sdpa`` function
unchanged. It is installed only on a model whose attention is transformers' ``sdpa`` (the default), on the
CPU, by :func:`use_cpu_decode_attention`; a model loaded with an ``attn_implementation`` the user named in
``load_kwargs`` (even ``"sdpa"``) keeps that one (``_model_cache``). The mask is transformers' SDPA mask
(boolean, True = attend); a row with no key to attend (never a real decode row) gets a uniform average
instead of NaN.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CPU_DECODE_ATTENTION",
    "FEWEST_ROWS",
    "GROUPED_DECODE_ATTENTION",
    "at_any_row_count",
    "use_cpu_decode_attention",
    "use_grouped_decode_attention",
]

#: The attention implementation's registered name (``model.config._attn_implementation``).
CPU_DECODE_ATTENTION = "interlens_cpu_decode"

#: The same products for a one-token step on any device and at any row count: what the static decode step
#: uses on CUDA (``_static_decode``), where transformers' ``sdpa`` with a mask copies every layer's keys and
#: values ``repeat_kv`` times a step for a grouped-query model; the products read them in place (a pool
#: view's rows fold into one batch dimension without a copy).
GROUPED_DECODE_ATTENTION = "interlens_grouped_decode"

#: Steps of fewer rows keep SDPA: at one row this path ran at 0.94x of SDPA's step (SmolLM2-135M, bf16, AMD
#: EPYC, 2 cores), where two extra small products and a softmax cost more than SDPA's setup. Not within
#: :func:`at_any_row_count`.
FEWEST_ROWS = 8

_ANY_ROW_COUNT: contextvars.ContextVar[bool] = contextvars.ContextVar("any_row_count", default=False)


#: The attribute :func:`at_any_row_count` sets on a model's modules: read where the attention function is
#: called (its ``module``), so a ``torch.compile`` of a step sees a module attribute (a context variable
#: breaks Dynamo's graph) and another engine's model in another thread is not affected.
_ANY_ROWS_ATTR = "_interlens_any_row_count"


@contextlib.contextmanager
def at_any_row_count(model: Any = None) -> Iterator[None]:
    """Within it, decode steps take this module's path at every row count, not only from
    :data:`FEWEST_ROWS` rows: a deterministic row must be computed the same way alone and co-stepped
    (``_slot_rows``, whose self-test compares them bit for bit). With ``model``, said on its modules too
    (what a compiled step reads); without, in this context only."""
    token = _ANY_ROW_COUNT.set(True)
    modules = list(model.modules()) if model is not None else []
    for module in modules:
        setattr(module, _ANY_ROWS_ATTR, True)
    try:
        yield
    finally:
        for module in modules:
            with contextlib.suppress(AttributeError):
                delattr(module, _ANY_ROWS_ATTR)
        _ANY_ROW_COUNT.reset(token)


def use_cpu_decode_attention(model: Any) -> bool:
    """Give ``model`` the decode-step attention of this module where it runs transformers' ``sdpa`` on the
    CPU; returns whether it now does."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == CPU_DECODE_ATTENTION:
        return True
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    _register()
    model.set_attn_implementation(CPU_DECODE_ATTENTION)
    return True


def use_grouped_decode_attention(model: Any) -> bool:
    """Give ``model`` :data:`GROUPED_DECODE_ATTENTION` where it runs transformers' ``sdpa`` (on any device);
    returns whether it now does. A prefill, dropout, a position bias, softcap or sinks still take ``sdpa``."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == GROUPED_DECODE_ATTENTION:
        return True
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    model.set_attn_implementation(GROUPED_DECODE_ATTENTION)
    return True


@functools.cache
def _register() -> None:
    """Register the functions and their mask (transformers builds no mask for an unknown name) once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_DECODE_ATTENTION, _attention)
    AttentionMaskInterface.register(CPU_DECODE_ATTENTION, sdpa_mask)
    AttentionInterface.register(GROUPED_DECODE_ATTENTION, _grouped_attention)
    AttentionMaskInterface.register(GROUPED_DECODE_ATTENTION, sdpa_mask)


def _grouped_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> Any:
    """:data:`GROUPED_DECODE_ATTENTION`: :func:`_attention` at every row count and on every device."""
    return _attention(module, query, key, value, attention_mask, any_device=True, any_rows=True, **kwargs)


def _attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: Any = None,
    any_device: bool = False,
    any_rows: bool = False,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-function contract: ``query`` (batch, heads, q_len, dim), ``key``/``value``
    (batch, kv_heads, length, dim); returns (batch, q_len, heads, dim) and no weights."""
    import torch

    if (
        query.shape[2] != 1
        or (
            query.shape[0] < FEWEST_ROWS
            and not (any_rows or getattr(module, _ANY_ROWS_ATTR, False) or _ANY_ROW_COUNT.get())
        )
        or (query.device.type != "cpu" and not any_device)
        or dropout
        or position_bias is not None
        or kwargs.get("softcap") is not None
        or getattr(module, "sinks", None) is not None
    ):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            position_bias=position_bias,
            **kwargs,
        )
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    queries = query.reshape(batch * kv_heads, group, dim)
    keys = key.reshape(batch * kv_heads, length, dim)
    # keys · queriesᵀ, not queries · keysᵀ: a narrowed cache's keys are a view, and only this order reads it
    # without a copy (the module docstring)
    scores = torch.bmm(keys, queries.transpose(1, 2)).transpose(1, 2).float()
    scores = scores.reshape(batch, kv_heads, group, length)  # a fresh product: ours to change in place
    scores.mul_(scaling if scaling is not None else dim**-0.5)
    if attention_mask is not None:
        mask = attention_mask[..., -1:, :]  # (batch or 1, 1, 1, length): one query position
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
        else:
            scores.add_(mask.float())
    weights = torch.softmax(scores, dim=-1).to(value.dtype).view(batch * kv_heads, group, length)
    out = torch.bmm(weights, value.reshape(batch * kv_heads, length, dim))
    return out.view(batch, 1, heads, dim), None
