"""A deterministic (slot layout) decode step of static shapes over static buffers: what a CUDA graph can
capture once per (row bucket, slot-length bucket) and replay every step.

The slot layout's eager step (``_slot_rows.SlotCache.feed``) pads the rows with ``torch.cat``, builds its
mask with a fresh ``arange``, and compacts into new tensors (``reorder_cache``): shapes and addresses change
every step, so it cannot be replayed. :class:`SlotDecodeStep` keeps the layout's arithmetic (every row's KV at
the slot equal to its position, the mask of the slots up to each row's own position, the rows padded with
copies of the last real row, a cache length that is a multiple of ``SLOT_BLOCK``) and owns every tensor a
step touches, allocated once:

* inputs: the tokens fed (rows, 1), each row's position (rows, 1), the row each padding row copies
  (``source``), and per row its uniform, temperature, top-p and greedy flag;
* outputs: the chosen tokens (-1 where a row's logits were not usable), ``finite``, and with recording the
  chosen tokens' log-probabilities (rows, 2): the sampler's buffers, shared with the batched static step
  (``_sampled_step.SampledStep``);
* its cache: views of a persistent ``_kv_pool.KVPool`` (``(rows, heads, slots, head dim)``: row ``r``'s slot
  ``s`` is its position ``s``, the slot layout's own shape), written at each row's own slot; every layer
  full-length, a sliding-window one too;
* for a model with sliding-window layers (gemma2, gemma3: ``KVPool.window``), each row's window as a 2-D
  mask (``windowed``: its slots up to its position, back ``window`` slots from there), from which the step
  builds the model's masks by layer type: the model itself would count a sliding layer's window back from
  the cache's write position, the furthest row's, where the rows here stand at their own positions.

:meth:`SlotDecodeStep._forward_and_sample` is the function a graph holds: the masks from the positions, the
model's forward, the sampler over the batched tensors (``_static_sampler.sample_rows``), the outputs, then
the next inputs advanced in place (the chosen tokens fed, the padding rows given their source row's, the
positions + 1). No host read and no Python branch on a tensor's value.

A batch starts from the slot layout's block prefill (``SlotLayout.fill``, not captured), which on the
engine's path wrote the distinct prompts straight into this step's pool layout (its first rows):
:meth:`SlotDecodeStep.begin` then only fills the rows holding another row's prompt (a repeated prompt, the
padding rows) inside the pool, from a gather of just those rows, and zeroes the slots past the prefill (a
prefill in a cache of its own is copied in instead); the first step feeds each row its last prompt token
(what ``SlotLayout.first`` did eagerly). At a row bucket edge
:meth:`SlotDecodeStep.hand_over` carries the live rows on in a smaller bucket's step over the same pool.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._core import ConfigurationError
from ._sampled_step import SAMPLER_BUFFERS, SampledStep
from ._sampler import Sampler
from ._sampling import SamplingSettings

if TYPE_CHECKING:
    import torch

    from ._kv_pool import KVPool

__all__ = ["SlotDecodeStep"]

#: the buffers a slot step adds to the sampler's: which row a padding row copies, the slots' and rows' ids
_SLOT_BUFFERS = ("source", "slot_ids", "row_ids")
#: the buffers its per-layer-type masks are built from: each row's window, the shape the builder reads
_WINDOW_BUFFERS = ("windowed", "_shape")


class SlotDecodeStep(SampledStep):
    """One slot-layout decode step's static buffers and its capturable function (module docstring).

    ``rows``: the padded row count (``_slot_rows.padded_rows``: a multiple of ``ROW_BLOCK``, or on CUDA a
    row bucket); ``length``: the slots (a multiple of ``SLOT_BLOCK``); ``variant`` / ``record``: as the
    batched step's (``_static_sampler``); ``pool``: the KV pool whose views hold the cache.
    """

    def __init__(self, model: Any, *, rows: int, length: int, variant: str, record: bool, pool: KVPool):
        import torch

        super().__init__(model, rows=rows, length=length, variant=variant, record=record, fed=0)
        self.pool = pool
        self.cache = _pool_slot_cache_class()(model.config, pool.views(rows, length), self)
        self.generation = pool.generation  # after views(), which may have grown the pool
        device = self.input_ids.device
        self.source = torch.arange(rows, dtype=torch.long, device=device)
        self.slot_ids = torch.arange(length, dtype=torch.long, device=device)
        self.row_ids = torch.arange(rows, dtype=torch.long, device=device)
        #: the sliding window of the model's sliding-window layers (None: every layer attends in full)
        self.window = pool.window
        # with a window: the 2-D mask of each row's window (its slots up to its position, back to the window
        # from there) and the shape the mask builder reads (rows, one token, the model's dtype)
        windowed = (rows, length) if self.window is not None else (0, 0)
        self.windowed = torch.zeros(windowed, dtype=torch.long, device=device)
        self._shape = torch.empty((rows, 1, 1), dtype=model.dtype, device=device)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every static tensor a step reads or writes, by name (a captured graph holds these addresses)."""
        window: tuple[str, ...] = _WINDOW_BUFFERS if self.window is not None else ()
        return self._buffers(SAMPLER_BUFFERS + _SLOT_BUFFERS + window, self.cache)

    # ------------------------------------------------------------------ the host's part

    def begin(
        self,
        settings: Sequence[SamplingSettings],
        *,
        prefill: Any,
        index: Sequence[int],
        prompts: Sequence[Sequence[int]],
    ) -> None:
        """Start a batch of ``len(settings)`` real rows: ``prefill`` a slot cache from ``SlotLayout.fill``
        (its rows the distinct prompts), ``index`` each row's row in it, ``prompts`` each row's prompt ids.
        Where the prefill wrote straight into this step's pool layout (:meth:`prefilled_in_place`: the
        engine's path), only the rows that hold another row's prompt (a repeated prompt, the padding rows:
        the last row's) are copied, inside the pool, from a gather of just those rows; otherwise each row's
        prefilled slots are copied into the pool views. The slots past the prefill are zeroed (a masked
        slot must hold a finite value: ``0 * NaN`` would reach the row), and the first step set to feed each
        row its last prompt token. Nothing a step reads is allocated."""
        import torch

        n = len(settings)
        if not 1 <= n <= self.rows or len(index) != n or len(prompts) != n:
            raise ConfigurationError(
                f"SlotDecodeStep.begin(): {n} settings, {len(index)} prefill rows and {len(prompts)} prompts "
                f"in a step of {self.rows} rows; give one of each per row, at most {self.rows} rows"
            )
        if max(len(p) for p in prompts) > self.length:
            raise ConfigurationError(
                f"SlotDecodeStep.begin(): a prompt of {max(len(p) for p in prompts)} tokens does not fit the "
                f"step's {self.length} slots; build the step for a longer slot-length bucket"
            )
        self._check_variant(settings, "begin")
        copies = [min(j, n - 1) for j in range(self.rows)]  # padding rows copy the last real row
        written = max(len(p) for p in prompts) - 1  # slots the prefill wrote (all but each last token)
        device = self.device
        with torch.no_grad():
            gather = torch.tensor([index[j] for j in copies], dtype=torch.long, device=device)
            if self.prefilled_in_place(prefill):
                moved = [j for j in range(self.rows) if index[copies[j]] != j]
                into = torch.tensor(moved, dtype=torch.long, device=device)
                for dst in self.cache.layers:
                    for storage in (dst.keys, dst.values):
                        if written and moved:  # gathered first: a row may be read after it is written
                            region = storage[:, :, :written]
                            region.index_copy_(0, into, region.index_select(0, gather[into]))
                        storage[:, :, written:].zero_()
            else:
                sources = getattr(prefill, "slot_layers", None) or [None] * len(self.cache.layers)
                for src, dst in zip(sources, self.cache.layers, strict=True):
                    if written and src is not None and src.is_initialized:
                        dst.keys[:, :, :written].copy_(src.keys[:, :, :written].index_select(0, gather))
                        dst.values[:, :, :written].copy_(src.values[:, :, :written].index_select(0, gather))
                        dst.keys[:, :, written:].zero_()
                        dst.values[:, :, written:].zero_()
                    else:
                        dst.keys.zero_()
                        dst.values.zero_()
            self.input_ids[:, 0].copy_(torch.tensor([prompts[j][-1] for j in copies]))
            self.positions[:, 0].copy_(torch.tensor([len(prompts[j]) - 1 for j in copies]))
            self.source.copy_(torch.tensor(copies))
            self._settings_into(settings)
        self._sampler = Sampler(settings, device, record=self.record)
        self._start(self._sampler, n)

    def prefilled_in_place(self, prefill: Any) -> bool:
        """Whether ``prefill``'s layers are views of this step's own cache storage at its layout (the same
        first address and strides: the prefill wrote its rows where this step reads them)."""
        layers = getattr(prefill, "slot_layers", None)
        if not layers or len(layers) != len(self.cache.layers):
            return False
        return all(
            getattr(src, "keys", None) is not None
            and src.keys.data_ptr() == dst.keys.data_ptr()
            and src.keys.stride() == dst.keys.stride()
            for src, dst in zip(layers, self.cache.layers, strict=True)
        )

    def step(self) -> None:
        """One decode step: this step's uniforms into their buffer (one copy), then :attr:`run`."""
        if self._sampler is None:
            raise ConfigurationError(
                "SlotDecodeStep.step(): no batch begun; call begin(settings, prefill=..., index=..., "
                "prompts=...) first"
            )
        self._next_uniforms(self._sampler)
        self.run()

    def feed(self, tokens: Sequence[int]) -> None:
        """Feed the real rows ``tokens`` at the next step instead of their chosen tokens (the self-test's
        probe rows: ``_batch_invariance``); padding rows get the last one."""
        import torch

        padded = [tokens[min(j, len(tokens) - 1)] for j in range(self.rows)]
        self.input_ids[:, 0].copy_(torch.tensor(padded))

    def hand_over(self, keep: Sequence[int], to: SlotDecodeStep) -> None:
        """Carry the real rows ``keep`` (ascending indices among this batch's rows) on in ``to`` (a step of
        the same slots, at most as many rows; this step itself compacts in place): each row's KV, position,
        next token and settings copied into ``to``'s buffers in place (none of its tensors moves), its
        padding rows the last kept row's, each row's uniform stream carrying on (``Sampler.select``). Off
        the hot path: once per row bucket edge."""
        import torch

        sampler = self._begun_keeping(keep)
        if len(keep) > to.rows or to.length != self.length or (self.record and not to.record):
            raise ConfigurationError(
                f"SlotDecodeStep.hand_over(): {len(keep)} rows cannot go to a step of {to.rows} rows, "
                f"{to.length} slots, record={to.record} from one of {self.length} slots, "
                f"record={self.record}; build it with room for the rows, the same slots and recording"
            )
        settings = [sampler.settings[j] for j in keep]
        to._check_variant(settings, "hand_over")
        k = len(keep)
        copies = [keep[min(j, k - 1)] for j in range(to.rows)]
        with torch.no_grad():
            gather = torch.tensor(copies, dtype=torch.long, device=self.device)
            # gathered first (index_select copies), so a hand-over within one storage reads before it writes
            kv = [
                (s.keys.index_select(0, gather), s.values.index_select(0, gather)) for s in self.cache.layers
            ]
            state = {name: getattr(self, name).index_select(0, gather) for name in ("positions", "input_ids")}
            kept = {
                name: getattr(self, name).index_select(0, gather[:k])
                for name in ("temperature", "top_p", "greedy")
            }
            for (keys, values), dst in zip(kv, to.cache.layers, strict=True):
                dst.keys.copy_(keys)
                dst.values.copy_(values)
            del kv
            to.positions.copy_(state["positions"])
            to.input_ids.copy_(state["input_ids"])
            to.source.copy_(torch.tensor([min(j, k - 1) for j in range(to.rows)]))
            for name, fill in (("temperature", 1.0), ("top_p", 1.0), ("greedy", True)):
                buffer = getattr(to, name)
                buffer.fill_(fill)
                buffer[:k].copy_(kept[name])
            to.uniforms.fill_(0.5)
        carried = sampler.select(list(keep))  # each kept row's uniform stream, where it was
        self._sampler = None
        to._start(carried, k)

    # ------------------------------------------------------------------ the captured part

    def _forward_and_sample(self) -> None:
        """The step a graph holds (module docstring), in place over the static buffers."""
        import torch

        with torch.no_grad():
            self.mask.copy_(self.slot_ids.unsqueeze(0) <= self.positions)
            top = self.positions.max()  # the causal mask's query offset: the furthest row (no host read)
            for layer in self.cache.layers:
                layer.cumulative_length.copy_(top)
            # the next step feeds this one's tokens, a padding row its source row's; a row past its last
            # slot (a finished row still in the batch) stays there
            self._forward_and_sample_into(source=self.source, attention=self._masks())
            self.positions.add_(1).clamp_(max=self.length - 1)

    def _masks(self) -> dict[str, torch.Tensor] | None:
        """For a model with sliding-window layers, its masks by layer type, built here from each row's own
        position (the model would count a sliding layer's window back from the furthest row's, the cache's
        write position): the full layers' from :attr:`mask`, the sliding layers' from :attr:`windowed`,
        both through transformers' own causal-mask builder (the model's format for its attention). The
        eager slot step's masks (``SlotCache.feed``), value for value. None for a model without one."""
        if self.window is None:
            return None
        from transformers.masking_utils import create_causal_mask

        self.windowed.copy_(self.mask * (self.slot_ids.unsqueeze(0) > self.positions - self.window))
        return {
            kind: create_causal_mask(
                config=self.model.config,
                inputs_embeds=self._shape,
                attention_mask=mask,
                cache=self.cache,
                position_ids=self.positions,
            )
            for kind, mask in (("full_attention", self.mask), ("sliding_attention", self.windowed))
        }


@functools.cache
def _pool_slot_cache_class() -> type:
    """The cache class, built on first use (``import interlens`` does not import transformers)."""
    from transformers import StaticCache

    class PoolSlotCache(StaticCache):
        """A static cache over a pool's views (``KVPool.views``) whose steps write each row's token at that
        row's own slot, its position (the step's ``positions`` buffer)."""

        def __init__(self, config: Any, views: Any, step: SlotDecodeStep) -> None:
            super().__init__(config=config, max_cache_len=step.length)
            self.layers = views.layers
            self.step = step

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            layer: Any = self.layers[layer_idx]
            rows, slots = self.step.row_ids, self.step.positions[:, 0]
            layer.keys[rows, :, slots] = key_states[:, :, 0]
            layer.values[rows, :, slots] = value_states[:, :, 0]
            return layer.keys, layer.values

    return PoolSlotCache
