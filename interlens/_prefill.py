"""One batch from scratch: build its KV cache, prefill it well, then run the shared decode loop.

Batching is where the throughput is (12-25x over one row at a time on CPU), and on CPU the prefill is most
of a short turn's cost, so this module is about prefilling a batch of heterogeneous rows cheaply:

* one left-padded batch (positions from the attention mask), prefilled once;
* identical prompts (n samples of one scenario) are prefilled ONCE and their KV cache expanded to the rows;
* prompts of very different lengths are prefilled in length-sorted groups (less padding) and laid into one
  left-padded cache for a single decode loop.

A preallocated ``StaticCache`` is used for batches: a ``DynamicCache`` re-concatenates the whole KV every
step, which is up to a third of a decode step at batch 64 on CPU. An architecture without static cache
layers falls back to a ``DynamicCache`` (``_batch_cache`` remembers it; tests and the benchmark may set it to
``"dynamic"`` to compare).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from interlens._decode import ModelRunner, Row, left_pad, raise_if_cancelled, stop_window
from interlens._generation_types import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

__all__ = ["BatchPrefill", "Decoded", "plain_static", "prefill_groups"]


@dataclass
class Decoded:
    """A finished batch: its rows and how they were prefilled (what ``_result`` records)."""

    rows: list[Row]
    shared_rows: list[bool]
    started: float  # perf_counter when the batch began
    cache: Any  # the batch's KV cache after decoding (each row's last sampled token not fed)
    static: bool


class BatchPrefill(ModelRunner):
    """The from-scratch batch path of ``LocalEngine`` (see the module docstring)."""

    shared_prefill: bool  # set by LocalEngine.__init__
    _batch_cache: str  # "static" | "dynamic"

    def _generate_rows(
        self, requests: list[GenerationRequest], cancelled: threading.Event | None, *, plain: bool = False
    ) -> list[GenerationResult | Exception]:
        """One left-padded batch; identical prompts are prefilled once and their KV cache expanded, unless
        ``plain`` (deterministic co-stepping: only the path the batch-invariance self-test covers).

        A row whose logits went non-finite gets its ``GenerationError`` in place of a result.
        """
        done = self._prefill_and_decode(requests, cancelled, plain=plain)
        seconds = time.perf_counter() - done.started
        return [
            row.failure
            if row.failure is not None
            else self._result(row, seconds=seconds, batch_size=len(done.rows), shared=s, reused=0)
            for row, s in zip(done.rows, done.shared_rows, strict=True)
        ]

    def _prefill_and_decode(
        self,
        requests: list[GenerationRequest],
        cancelled: threading.Event | None,
        *,
        plain: bool = False,
        on_leave: Callable[[list[int], list[Row], Any, int], None] | None = None,
    ) -> Decoded:
        import torch

        started = time.perf_counter()
        device = self.device
        lengths = [len(r.prompt_ids) for r in requests]
        max_new = max(r.max_new_tokens for r in requests)
        unique: dict[tuple[int, ...], int] = {}
        row_to_unique = [unique.setdefault(r.prompt_ids, len(unique)) for r in requests]
        shared = (
            self.shared_prefill
            and not plain
            and len(requests) > 1
            and len(unique) < len(requests)
            and min(lengths) >= 2
        )
        raise_if_cancelled(cancelled)

        if shared:
            # Prefill every distinct prompt minus its last token ONCE, copy the KV rows out to the batch rows,
            # then feed each row its last prompt token: the first decode step yields the first logits.
            # (Caching the whole prompt and feeding it again would duplicate the KV: pitfall 1 in the notes.)
            prompts = list(unique)
            prefix_len = max(len(p) for p in prompts) - 1
            ids, mask = left_pad([p[:-1] for p in prompts], prefix_len, self._pad_id)
            cache, static = self._new_batch_cache(prefix_len + 1 + max_new)
            self._forward(ids, mask, cache, device)
            index = torch.tensor(row_to_unique, dtype=torch.long, device=device)
            cache.reorder_cache(index)  # index_select on the batch dim: U rows -> B rows
            row_mask = torch.tensor(mask, dtype=torch.long)[torch.tensor(row_to_unique)]
            full_mask = torch.cat([row_mask, torch.ones(len(requests), 1 + max_new, dtype=torch.long)], dim=1)
            last = torch.tensor([[r.prompt_ids[-1]] for r in requests], dtype=torch.long, device=device)
            positions = torch.tensor(lengths, dtype=torch.long, device=device) - 1
            attn = None if bool(full_mask.all()) else full_mask.to(device)
            logits = self._step(last, positions, attn, cache, prefix_len + 1, static)
            positions = positions + 1
            kv_len = prefix_len + 1
            counts: dict[int, int] = {}
            for u in row_to_unique:
                counts[u] = counts.get(u, 0) + 1
            shared_rows = [counts[u] > 1 for u in row_to_unique]
        else:
            prompt_len = max(lengths)
            ids, mask = left_pad([r.prompt_ids for r in requests], prompt_len, self._pad_id)
            cache, static = self._new_batch_cache(prompt_len + max_new)
            groups = prefill_groups(lengths) if static and not plain else []
            if len(groups) > 1 and plain_static(cache):
                logits = self._prefill_grouped(requests, groups, cache, prompt_len)
            else:
                logits = self._forward(ids, mask, cache, device)
            full_mask = torch.cat(
                [torch.tensor(mask, dtype=torch.long), torch.ones(len(requests), max_new, dtype=torch.long)],
                dim=1,
            )
            positions = torch.tensor(lengths, dtype=torch.long, device=device)
            attn = None if min(lengths) == prompt_len else full_mask.to(device)
            kv_len = prompt_len
            shared_rows = [False] * len(requests)

        rows = [Row(r, stop_window=stop_window(r.stop)) for r in requests]
        self._decode(
            rows, logits, cache, positions, attn, kv_len, cancelled, static=static, on_leave=on_leave
        )
        return Decoded(rows, shared_rows, started, cache, static)

    def _new_batch_cache(self, max_len: int) -> tuple[Any, bool]:
        """A cache for one batch, and whether it is static (preallocated to ``max_len``)."""
        from transformers import DynamicCache, StaticCache

        if self._batch_cache == "static":
            try:
                return StaticCache(config=self.model.config, max_cache_len=max_len), True
            except (TypeError, ValueError, KeyError, NotImplementedError):
                self._batch_cache = "dynamic"  # an architecture without static cache layers
        return DynamicCache(config=self.model.config), False

    def _prefill_grouped(
        self, requests: list[GenerationRequest], groups: list[list[int]], cache: Any, prompt_len: int
    ) -> torch.Tensor:
        """Prefill rows of similar length together, then lay their KV into the batch's left-padded cache.

        One left-padded prefill computes every row at the longest prompt's width; with mixed lengths that
        can be half padding, and on CPU the prefill is most of a turn's cost. Prefilling length-sorted groups
        at their own widths and copying each group's KV to the right end of the batch cache gives the same
        layout (pads stay masked) for a fraction of the compute. Only for caches of plain static layers.

        Each group's small cache is copied into the batch cache as soon as it is filled and dropped before
        the next group runs: the batch cache plus ONE small cache is the peak, not the batch cache plus all.
        """
        import torch
        from transformers import StaticCache

        device = self.device
        batch = len(requests)
        logits: torch.Tensor | None = None
        for rows in groups:
            width = max(len(requests[r].prompt_ids) for r in rows)
            ids, mask = left_pad([requests[r].prompt_ids for r in rows], width, self._pad_id)
            small: Any = StaticCache(config=self.model.config, max_cache_len=width)
            part = self._forward(ids, mask, small, device)
            index = torch.tensor(rows, dtype=torch.long, device=device)
            if logits is None:
                logits = part.new_empty((batch, part.shape[-1]))
            logits[index] = part
            for layer, src in zip(cache.layers, small.layers, strict=True):
                if not layer.is_initialized:
                    layer.lazy_initialization(
                        src.keys.new_empty((batch, src.keys.shape[1], 1, src.keys.shape[3])),
                        src.values.new_empty((batch, src.values.shape[1], 1, src.values.shape[3])),
                    )
                layer.keys[index, :, prompt_len - width : prompt_len] = src.keys
                layer.values[index, :, prompt_len - width : prompt_len] = src.values
            # Copied: drop this group's cache before the next group's is allocated (one alive at a time).
            del small, part, src
        assert logits is not None
        for layer in cache.layers:
            layer.cumulative_length.fill_(prompt_len)
        return logits


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """Split rows into up to 4 length-sorted groups when that saves a good share of padded prefill work."""
    rows = len(lengths)
    padded = rows * max(lengths)
    if rows < 8 or sum(lengths) > 0.8 * padded:
        return [list(range(rows))]
    order = sorted(range(rows), key=lengths.__getitem__)
    k = min(4, rows // 4)
    bounds = [round(i * rows / k) for i in range(k + 1)]
    groups = [order[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    cost = sum(len(g) * max(lengths[r] for r in g) for g in groups)
    return groups if cost < 0.85 * padded else [list(range(rows))]


def plain_static(cache: Any) -> bool:
    """Whether every layer is a plain full-attention StaticLayer (whose storage layout we rely on)."""
    from transformers.cache_utils import StaticLayer

    return all(type(layer) is StaticLayer for layer in cache.layers)
