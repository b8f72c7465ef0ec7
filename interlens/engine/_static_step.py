"""A decode step of static shapes over static buffers: what a CUDA graph (or a ``torch.compile`` frame)
can capture once per bucket and replay every step.

The engine's eager step (``_decode.ModelRunner.decode``) allocates as it goes: ``positions + 1``, a window
narrowed per step, a sampler whose tensors change size with the batch's mix of settings. A captured graph
replays fixed kernels over fixed addresses, so :class:`StaticDecodeStep` is built for one key (row bucket,
length bucket, sampler variant, recording on/off: ``_buckets``) and owns every tensor a step touches,
allocated once:

* inputs: the tokens fed (rows, 1), their positions (rows, 1), the 2-D attention mask over the length
  bucket's full width (rows, length), and per row its uniform, temperature, top-p and greedy flag;
* outputs: the chosen tokens (-1 where a row's logits were not usable, so one host read brings both),
  whether each row's logits were usable (``finite``), and with recording the chosen tokens'
  log-probabilities under the model's and the sampling distribution (rows, 2);
* its static KV cache: views of the engine's one ``_kv_pool.KVPool`` (``pool``; every row bucket of one
  length bucket lays a row's slots at the same address), or a ``StaticCache`` of its own initialised to
  rows x length up front; its layers keep their write position in a tensor (``cumulative_length``)
  advanced in place by the forward itself. Every layer is full-length, a sliding-window layer's too
  (gemma2, gemma3): the model builds that layer's mask itself, inside the step, from the write position
  (its window counted back in slots, which is in positions here: a batch's rows all write the same slot
  a step, and each row's tokens lie in consecutive slots; ``_kv_pool``).

:meth:`StaticDecodeStep._forward_and_sample` is the one function a graph holds: the model's forward for one
token per row, the sampler over the batched tensors (``_static_sampler.sample_rows``, the parts' own math
with per-row settings as tensors), the outputs written in place, and the next step's inputs advanced in
place (the chosen tokens fed, positions + 1). No ``.item()``, ``.tolist()`` or Python branching on a tensor's
value: it runs eagerly (the CPU's path), under ``torch.compile(fullgraph=True)``, or captured.

The host's part of a step is :meth:`StaticDecodeStep.step`: this step's uniforms copied into their buffer
(seeded rows' from each row's own stream, drawn on the host in blocks by the eager sampler's
``_RowUniforms``: the seed rule is the sampler's, unchanged), then the function run. The host reads the
chosen tokens afterwards, once a step (its end-of-turn, stop-string and length checks), as the eager loop
does.

Rows past the real ones up to the bucket are dummies: greedy, fed the pad id over a mask of ones; their
outputs are never read. Every operation of the step is row-wise, so a real row's tokens do not depend on
them (``tests/test_static_step.py`` checks bucket 2 against bucket 8).

At a bucket edge :meth:`StaticDecodeStep.hand_over` carries the live rows on in another step (fewer rows,
a longer length bucket) or compacts them in place, their uniform streams included (``Sampler.select``).

The sampler's buffers and the sample-and-store tail are :class:`~._sampled_step.SampledStep`'s, shared with
the deterministic rows' step (``_slot_step``). The engine drives it from ``_static_decode.StaticDecoder``
(steps kept per key over one pool, the pipelined loop of ``_step_loop``, when to hand over) and captures
:attr:`StaticDecodeStep.run` as a CUDA graph in ``_decode_graphs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._core import ConfigurationError
from ._sampled_step import SAMPLER_BUFFERS, SampledStep
from ._sampler import Choice, Sampler
from ._sampling import SamplingSettings

if TYPE_CHECKING:
    import torch

    from ._kv_pool import KVPool

__all__ = ["StaticDecodeStep", "static_cache"]


def static_cache(model: Any, *, rows: int, length: int) -> Any:
    """A transformers ``StaticCache`` for ``model`` of ``rows`` x ``length`` slots, every layer's storage
    allocated now (not at its first write), so its addresses are fixed before anything is captured. Every
    layer is full-length, a sliding-window one too (its window is in the model's mask, as in the engine's
    pool: ``_kv_pool``)."""
    import torch
    from transformers import StaticCache

    from ._kv_pool import full_length_layers

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cache = StaticCache(config=config, max_cache_len=length)
    cache.layers = full_length_layers(cache, length)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device = next(model.parameters()).device
    cache.early_initialization(rows, heads, head_dim, model.dtype, torch.device(device))
    return cache


class StaticDecodeStep(SampledStep):
    """One decode step's static buffers and its capturable function, for one bucket key (module docstring).

    ``model``: a causal LM (``from_pretrained``); ``rows`` and ``length``: the row and length bucket (the
    cache and mask are this wide); ``variant``: the sampler variant (``_static_sampler.VARIANTS``: the
    cheapest one serving the batch's settings is :func:`~._static_sampler.variant_for`); ``record``: the
    chosen tokens' log-probabilities are written too; ``pad_id``: the token dummy rows are fed.

    Use: :meth:`begin` with a batch's settings, its prefilled KV and its prefill logits (the first tokens
    are drawn there), then :meth:`step` per token, reading :attr:`tokens` / :attr:`finite` /
    :attr:`logprobs` after each. :attr:`run` is the function a step runs: :meth:`_forward_and_sample`
    itself, or what compiled or captured it (a test or the engine sets it).
    """

    def __init__(
        self,
        model: Any,
        *,
        rows: int,
        length: int,
        variant: str,
        record: bool,
        pad_id: int = 0,
        pool: KVPool | None = None,
    ) -> None:
        super().__init__(model, rows=rows, length=length, variant=variant, record=record, fed=pad_id)
        self.pad_id = pad_id
        #: the pool this step's cache is a view of (None: the step owns its cache)
        self.pool = pool
        self.cache = (
            pool.views(rows, length) if pool is not None else static_cache(model, rows=rows, length=length)
        )
        self.generation = pool.generation if pool is not None else 0  # after views(), which may grow it
        self.vocab = int(model.get_input_embeddings().weight.shape[0])
        self._slot = length  # the next cache slot a step writes (host-side count; no device read)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every static tensor a step reads or writes, by name: inputs, outputs, and each cache layer's
        keys, values and write position. A captured graph holds these addresses: none may ever move."""
        return self._buffers(SAMPLER_BUFFERS, self.cache)

    @property
    def slots_left(self) -> int:
        """Steps this bucket can still take before its cache is full (the engine moves to the next length
        bucket, or stops, there)."""
        return self.length - self._slot

    # ------------------------------------------------------------------ the host's part

    def begin(
        self,
        settings: Sequence[SamplingSettings],
        *,
        kv: Any,
        prompt_mask: torch.Tensor,
        logits: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> Choice:
        """Start a batch of ``len(settings)`` real rows (at most :attr:`rows`): ``kv`` a cache prefilled
        with their left-padded prompts (any transformers cache whose layers have ``keys`` / ``values`` of
        ``prompt_mask``'s width, batch-first; where it is this step's own pool region, as the engine's
        prefills write it, nothing is copied), ``prompt_mask`` (real rows x prompt width, 1 = a prompt token)
        and ``logits`` (real rows x vocab): the prefill's last-position logits. Every buffer is filled in
        place (nothing is allocated that a step reads); the first tokens are drawn from ``logits`` by the
        eager sampler (whose uniform streams the steps carry on) and returned as its :class:`Choice`."""
        import torch

        n, width = prompt_mask.shape
        self._check(settings, n, width)
        with torch.no_grad():
            for src, dst in zip(kv.layers, self.cache.layers, strict=True):
                if src.keys.data_ptr() != dst.keys.data_ptr():  # not prefilled in place already
                    dst.keys[:n, :, :width].copy_(src.keys[:n, :, :width])
                    dst.values[:n, :, :width].copy_(src.values[:n, :, :width])
                dst.cumulative_length.fill_(width)
            self.mask.fill_(1)
            self.mask[:n, :width].copy_(prompt_mask)
            self.positions.zero_()
            self.positions[:n, 0].copy_(prompt_mask.sum(dim=-1) if positions is None else positions)
            self.input_ids.fill_(self.pad_id)
            self._settings_into(settings)
            sampler = Sampler(settings, self.device, record=self.record)
            choice = sampler.choose(logits)
            fed = torch.where(choice.finite, choice.tokens, 0)
            self.input_ids[:n, 0].copy_(fed)
        self._start(sampler, n)
        self._slot = width
        return choice

    def step(self) -> None:
        """One decode step: this step's uniforms into their buffer (one copy), then :attr:`run`. The outputs
        are in :attr:`tokens`, :attr:`finite` and :attr:`logprobs`; nothing is read back here."""
        if self._sampler is None:
            raise ConfigurationError(
                "StaticDecodeStep.step(): no batch begun; call begin(settings, kv=..., prompt_mask=..., "
                "logits=...) first"
            )
        if self._slot >= self.length:
            raise ConfigurationError(
                f"StaticDecodeStep.step(): the length bucket of {self.length} slots is full; "
                "move the batch to the next length bucket (or end it) before this step"
            )
        self._next_uniforms(self._sampler)
        self.run()
        self._slot += 1

    def hand_over(self, keep: Sequence[int], to: StaticDecodeStep) -> None:
        """Carry the real rows ``keep`` (indices among this batch's rows, in order) on in ``to``: a step of
        a smaller row bucket at a bucket edge (finished rows dropped), of a longer length bucket when this
        one's slots run out, or this step itself (compacted in place). Their KV, mask, positions, next
        tokens and settings are copied into ``to``'s buffers in place (none of ``to``'s tensors moves: a
        graph captured on it stays valid), and each row's uniform stream carries on where it was
        (``Sampler.select``), so a row's tokens are the same across the hand-over. Off the hot path: once
        per bucket edge."""
        import torch

        sampler = self._begun_keeping(keep)
        settings = [sampler.settings[j] for j in keep]
        to._check(settings, len(keep), self._slot, who="hand_over")
        if self.record and not to.record:
            raise ConfigurationError(
                "StaticDecodeStep.hand_over(): this batch records log-probabilities and the step it is "
                "handed to does not; hand it to a step built with record=True"
            )
        k, slot = len(keep), self._slot
        index = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        with torch.no_grad():
            # Rows already where they go (the front rows of one pool's layout: every row bucket of one
            # length bucket lays a row's slots at the same address) do not move; others are gathered
            # first (index_select copies), so a step handing over within its own storage reads before it
            # writes, then index_copy_'d into the front rows.
            in_place = list(keep) == list(range(k)) and all(
                a.keys.data_ptr() == b.keys.data_ptr() and a.keys.stride() == b.keys.stride()
                for a, b in zip(self.cache.layers, to.cache.layers, strict=True)
            )
            front = torch.arange(k, dtype=torch.long, device=self.device)
            kv = (
                []
                if in_place
                else [
                    (
                        src.keys[:, :, :slot].index_select(0, index),
                        src.values[:, :, :slot].index_select(0, index),
                    )
                    for src in self.cache.layers
                ]
            )
            state = {
                name: getattr(self, name).index_select(0, index)
                for name in ("positions", "input_ids", "temperature", "top_p", "greedy")
            }
            mask = self.mask.index_select(0, index)[:, :slot]
            for (keys, values), dst in zip(kv, to.cache.layers, strict=False):
                dst.keys[:, :, :slot].index_copy_(0, front, keys)
                dst.values[:, :, :slot].index_copy_(0, front, values)
            for dst in to.cache.layers:
                dst.cumulative_length.fill_(slot)
            to.mask.fill_(1)
            to.mask[:k, :slot].copy_(mask)
            for name, fill in (
                ("positions", 0),
                ("input_ids", to.pad_id),
                ("temperature", 1.0),
                ("top_p", 1.0),
            ):
                buffer = getattr(to, name)
                buffer.fill_(fill)
                buffer[:k].copy_(state[name])
            to.greedy.fill_(True)
            to.greedy[:k].copy_(state["greedy"])
            to.uniforms.fill_(0.5)
        carried = sampler.select(list(keep))  # each kept row's uniform stream, where it was
        self._sampler = None
        to._start(carried, k)
        to._slot = slot

    def _check(self, settings: Sequence[SamplingSettings], n: int, width: int, *, who: str = "begin") -> None:
        """Refuse a batch this step cannot serve (``who``: the method to name)."""
        if not 1 <= n <= self.rows or len(settings) != n:
            raise ConfigurationError(
                f"StaticDecodeStep.{who}(): {len(settings)} settings for {n} prompt rows in a bucket of "
                f"{self.rows} rows; give one setting per prompt row, at most {self.rows} rows"
            )
        if width >= self.length:
            raise ConfigurationError(
                f"StaticDecodeStep.{who}(): the {width} slots already written leave no slot of the "
                f"length bucket ({self.length}); build the step for a larger length bucket"
            )
        self._check_variant(settings, who)

    # ------------------------------------------------------------------ the captured part

    def _forward_and_sample(self) -> None:
        """The step a graph holds: forward one token per row over the static cache, sample every row, write
        the outputs and advance the inputs, all in place over the static buffers."""
        import torch

        with torch.no_grad():
            self._forward_and_sample_into()
            self.positions.add_(1)
