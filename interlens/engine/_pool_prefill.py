"""The plain path's prefills written straight into the engine's KV pool: a static batch allocates no KV.

Where the static decoder serves a batch (``_static_decode``; graphs on CUDA), its decode steps read the
batch's KV from views of the engine's one ``_kv_pool.KVPool``. Prefilling into a cache of the batch's own
and copying it into the pool would write every prompt's KV twice and allocate a batch-sized tensor inside
every batch; here each prefill forward writes through a :meth:`KVPool.span` view at the very slots the
steps read (the batch's layout: its rows x its length bucket), so ``StaticDecodeStep.begin`` finds the KV in
place and copies nothing. The prefill's layouts are ``_prefill``'s, unchanged:

* :func:`prefill_block`: one left-padded block;
* :func:`prefill_twins`: identical prompts, the distinct ones prefilled once (less their last token) into
  the front rows, expanded to every row inside the pool, then a step of every row's last token;
* :func:`prefill_parts`: rows sharing a long prefix (the prefix once, into the part's first row, copied to
  its other rows, then the suffixes) and length groups, each part at the right end of the prompt region
  (``[pad][part]``). A part must be a range of the batch's rows to be written through one view, so the batch
  is laid out part by part: :attr:`PoolPrefill.order` says which request each cache row holds.

Each returns what the decode loop takes (:class:`PoolPrefill`). The only transient the pool path allocates is
the identical prompts' expansion (a gather of the distinct rows' prefix, copied back into the pool at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._decode import ModelRunner, left_pad

if TYPE_CHECKING:
    import torch

    from ._kv_pool import KVPool

__all__ = ["PoolPrefill", "prefill_block", "prefill_parts", "prefill_twins"]


@dataclass
class PoolPrefill:
    """A batch prefilled in the pool, in the decode loop's terms: cache row ``k`` holds request ``order[k]``;
    ``logits`` its last prompt position's (rows, vocab), in cache order; ``cache`` the pool's view of the
    batch's prompt region (``kv_len`` slots, filled); ``positions`` each row's next position; ``attn`` the
    full-length 2-D mask (None: no row padded); ``prompt_slots`` where each row's prompt lies when the
    layout has holes (None: right before the first generated slot)."""

    order: list[int]
    logits: torch.Tensor
    cache: Any
    positions: torch.Tensor
    attn: torch.Tensor | None
    kv_len: int
    prompt_slots: list[list[int]] | None = None


def prefill_block(
    runner: ModelRunner, pool: KVPool, prompts: list[tuple[int, ...]], *, length: int, max_new: int
) -> PoolPrefill:
    """One left-padded block of every row, written into the pool's rows ``[0, rows)``."""
    import torch

    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids, mask = left_pad(prompts, width, runner.pad_id)
    cache = pool.span(0, len(prompts), length=length, width=width)
    logits = runner.forward(ids, mask, cache)
    full = torch.cat(
        [torch.tensor(mask, dtype=torch.long), torch.ones(len(prompts), max_new, dtype=torch.long)], 1
    )
    attn = None if min(lengths) == width else full.to(runner.device)
    positions = torch.tensor(lengths, dtype=torch.long, device=runner.device)
    return PoolPrefill(list(range(len(prompts))), logits, cache, positions, attn, width)


def prefill_twins(
    runner: ModelRunner,
    pool: KVPool,
    prompts: list[tuple[int, ...]],
    row_to_unique: list[int],
    *,
    length: int,
    max_new: int,
) -> PoolPrefill:
    """Identical prompts: the distinct ones less their last token, prefilled once into the pool's front
    rows, expanded to every row in place (each row then holds its prompt's KV), then one step of every
    row's last prompt token, whose logits start the decoding (feeding the whole prompt again would write
    its KV twice)."""
    import torch

    device = runner.device
    unique = list(dict.fromkeys(prompts))
    rows = len(prompts)
    lengths = [len(p) for p in prompts]
    prefix = max(lengths) - 1
    ids, pad_mask = left_pad([p[:-1] for p in unique], prefix, runner.pad_id)
    runner.forward(ids, pad_mask, pool.span(0, len(unique), length=length, width=prefix))
    cache = pool.span(0, rows, length=length, width=prefix + 1, written=prefix)
    if list(range(rows)) != row_to_unique:
        index = torch.tensor(row_to_unique, dtype=torch.long, device=device)
        for layer in cache.layers:  # gathered first: a row may be written before it is read otherwise
            for storage in (layer.keys, layer.values):
                storage[:, :, :prefix].copy_(storage[: len(unique), :, :prefix].index_select(0, index))
    row_mask = torch.tensor(pad_mask, dtype=torch.long)[torch.tensor(row_to_unique)]
    full = torch.cat([row_mask, torch.ones(rows, 1 + max_new, dtype=torch.long)], dim=1)
    attn = None if bool(full.all()) else full.to(device)
    last = torch.tensor([[p[-1]] for p in prompts], dtype=torch.long, device=device)
    positions = torch.tensor(lengths, dtype=torch.long, device=device) - 1
    step_mask = None if attn is None else attn[:, : prefix + 1]
    logits = runner.step(last, positions, step_mask, cache, prefix + 1, True)
    return PoolPrefill(list(range(rows)), logits, cache, positions + 1, attn, prefix + 1)


def prefill_parts(
    runner: ModelRunner,
    pool: KVPool,
    prompts: list[tuple[int, ...]],
    parts: list[tuple[int, list[int]]],
    *,
    length: int,
    max_new: int,
) -> PoolPrefill:
    """``PlainBatch.prefill_parts``'s layout written into the pool: part ``(p, rows)`` is a range of the
    batch's rows (cache row order: the parts' rows in turn), at slots ``[width - part width, width)``; with
    ``p > 0`` its first ``p`` tokens are prefilled once, into the part's first row, and copied to its other
    rows (a broadcast copy, nothing allocated), then each row's suffix is prefilled after them."""
    import torch

    device = runner.device
    order = [r for _, rows in parts for r in rows]
    lengths = [len(prompts[r]) for r in order]
    width = max(lengths)
    mask = torch.zeros(len(order), width, dtype=torch.long)
    logits: list[torch.Tensor] = []
    start = 0
    for p, rows in parts:
        stop = start + len(rows)
        part_prompts = [prompts[r] for r in rows]
        part = max(len(q) for q in part_prompts)
        offset = width - part
        if p:
            head = pool.span(start, start + 1, length=length, offset=offset, width=p)
            runner.forward([list(part_prompts[0][:p])], [[1] * p], head)
            if stop - start > 1:
                rest = pool.span(start + 1, stop, length=length, offset=offset, width=p)
                for mine, first in zip(rest.layers, head.layers, strict=True):
                    mine.keys.copy_(first.keys.expand_as(mine.keys))
                    mine.values.copy_(first.values.expand_as(mine.values))
        suffix_ids, suffix_mask = left_pad([q[p:] for q in part_prompts], part - p, runner.pad_id)
        part_mask = torch.tensor([[1] * p + m for m in suffix_mask], dtype=torch.long)
        view = pool.span(start, stop, length=length, offset=offset, width=part, written=p)
        logits.append(runner.forward_part(suffix_ids, part_mask, view, p))
        mask[start:stop, offset:] = part_mask
        start = stop
    cache = pool.span(0, len(order), length=length, width=width, written=width)
    full = torch.cat([mask, torch.ones(len(order), max_new, dtype=torch.long)], dim=1)
    attn = None if bool(full.all()) else full.to(device)
    positions = torch.tensor(lengths, dtype=torch.long, device=device)
    slots = [m.nonzero().flatten().tolist() for m in mask] if any(p for p, _ in parts) else None
    joined = torch.cat([x.to(logits[0].device) for x in logits])
    return PoolPrefill(order, joined, cache, positions, attn, width, slots)
