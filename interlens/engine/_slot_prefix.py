"""Prompt blocks' KV kept by their tokens, so a deterministic turn prefills only what no earlier one did.

Why: on the slot layout (``_slot_rows``) every deterministic turn prefilled its whole prompt, the whole
conversation so far, while the batched path reuses each stream's kept cache and prefills only the new
turn. Profiled on SmolLM2-135M (bfloat16, 16 debates x 4 turns x 24 tokens, AMD EPYC): the decode steps
cost the same on both paths (~51 ms a 16-row step), and the whole gap was the deterministic re-prefill
(3.2 s of an 8.4 s rollout against 1.6 s of the batched path's prefills).

The batched path's reuse cannot serve a deterministic row: whether a stream's cache is still kept depends
on what else ran, and a cache extended by decode steps holds other arithmetic than a fresh prefill. This
store is content-addressed instead. The slot layout prefills a prompt in blocks of ``PREFILL_BLOCK``
tokens (block ``k`` fed with blocks ``0 .. k-1`` in the cache), so a block's KV is a function of the
tokens up to its end alone, bitwise the same in any batch (what the self-test checks: it runs this very
block prefill). Each full block of real tokens is kept under the whole token prefix it ends (the key is
the tuple of those token ids, compared whole: no digest to collide), and a later prompt starting with
that prefix loads the block instead of computing it: the same bits either way, so a row's tokens do not
depend on what the store holds. A batch skips the blocks every one of its rows has (rows are prefilled
together, block by block), so the saving is the rows' shortest kept prefix.

Bounded by bytes (:data:`STORE_BYTES`, least recently used first out); emptied when the kernels that
computed its blocks change (``kernels``: the fixed-row linear layers or norms switched on or off).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["STORE_BYTES", "PrefixStore"]

#: Most bytes of kept blocks per engine (SmolLM2-135M: ~0.74 MB a 32-token block; 16 rows of 1,000 tokens
#: keep ~370 MB).
STORE_BYTES = 512 << 20


class PrefixStore:
    """Per-block KV of prompts' full blocks, keyed by the token prefix each block ends (module docstring)."""

    def __init__(self, *, block: int, capacity: int = STORE_BYTES) -> None:
        self.block = block
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._bytes = 0
        self._kernels: Hashable = None
        #: Blocks served from the store and blocks computed, since the engine started (for figures, tests).
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def nbytes(self) -> int:
        """Bytes the kept blocks hold now."""
        return self._bytes

    def room(self) -> int:
        """Bytes the store may still take before it evicts (what the engine's batch budget leaves it)."""
        return max(0, self.capacity - self._bytes)

    def clear(self) -> None:
        """Drop every kept block (``LocalEngine.clear_reuse``, and so before an out-of-memory retry)."""
        self._blocks.clear()
        self._bytes = 0

    def use_kernels(self, kernels: Hashable) -> None:
        """Empty the store if its blocks were computed by other kernels than ``kernels`` now selects."""
        if kernels != self._kernels:
            self.clear()
            self._kernels = kernels

    def kept(self, prompts: list[tuple[int, ...]], width: int) -> int:
        """How many leading blocks of a ``width``-token prefill every one of ``prompts`` has kept: the
        blocks a batch of them can load instead of computing."""
        shortest = width // self.block
        for prompt in prompts:
            blocks = 0
            while blocks < shortest and prompt[: (blocks + 1) * self.block] in self._blocks:
                blocks += 1
            shortest = blocks
        return shortest

    def load(self, cache: Any, prompts: list[tuple[int, ...]], blocks: int) -> None:
        """Write the first ``blocks`` kept blocks of each of ``prompts`` (the cache's rows, in order) into the
        fresh slot ``cache`` (a cache of its own, or the KV pool's view: ``SlotLayout.fill``), each row's
        blocks concatenated straight into its slots (nothing allocated), and move its write position past
        them."""
        import torch

        slots = blocks * self.block
        for layer_idx, layer in enumerate(cache.slot_layers):
            if not layer.is_initialized:  # a cache of its own: allocated as the prefill's first write would
                keys, values = self._blocks[prompts[0][: self.block]][layer_idx]
                rows = (len(prompts), -1, -1, -1)
                layer.lazy_initialization(keys.unsqueeze(0).expand(rows), values.unsqueeze(0).expand(rows))
            for row, prompt in enumerate(prompts):
                parts = [self._blocks[prompt[: (b + 1) * self.block]][layer_idx] for b in range(blocks)]
                # at slots 0 .. blocks*block-1, as the prefill would write them
                torch.cat([k for k, _ in parts], dim=1, out=layer.keys[row, :, :slots])
                torch.cat([v for _, v in parts], dim=1, out=layer.values[row, :, :slots])
            layer.cumulative_length.add_(slots)
        for b in range(blocks):  # recently used
            for prompt in prompts:
                self._blocks.move_to_end(prompt[: (b + 1) * self.block])
        self.hits += blocks * len(prompts)

    def keep(self, cache: Any, prompts: list[tuple[int, ...]], start: int) -> None:
        """Keep each full block of real tokens of ``prompts`` (the cache's rows) from block ``start`` on,
        as the prefill just wrote it; the least recently used blocks go past :attr:`capacity`."""
        for row, prompt in enumerate(prompts):
            full = (len(prompt) - 1) // self.block  # the last prompt token is fed as a decode step
            for b in range(start, full):
                key = prompt[: (b + 1) * self.block]
                if key in self._blocks:
                    continue
                span = slice(b * self.block, (b + 1) * self.block)
                kv = [
                    (layer.keys[row, :, span].clone(), layer.values[row, :, span].clone())
                    for layer in cache.slot_layers
                ]
                self._blocks[key] = kv
                self._bytes += sum(k.nbytes + v.nbytes for k, v in kv)
            self.misses += max(0, full - start)
        while self._bytes > self.capacity and self._blocks:
            _, kv = self._blocks.popitem(last=False)
            self._bytes -= sum(k.nbytes + v.nbytes for k, v in kv)
