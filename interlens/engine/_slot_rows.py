"""Deterministic rows in a batch-invariant layout: each row's arithmetic is the same alone and in any batch.

A deterministic row samples from its own seeded stream, so its tokens follow from its own logits. If those
are bitwise the same whatever rows share its batch, deterministic turns can co-step at batched speed and
still be token-identical to running alone. The plain left-padded batch (``_prefill``) is not that, even on
CPU with stock kernels (measured with MKL, torch 2.13, AVX-512):

* a matmul of 1-3 rows takes another kernel, with another reduction order, than one of 4 or more, and with
  several threads the rows each thread gets decide it too: a 1-row decode step and a 6-row one round apart;
* left padding moves a row's keys to other cache slots, so the attention's reductions over keys put them in
  other vector lanes and blocks; a longer cache (a batch mate asking for more tokens) moves block edges.

So every deterministic batch, of one row or many, is laid out the same way here:

* all but the last token of each distinct prompt are prefilled in one batch padded on the RIGHT to a width
  that is a multiple of :data:`PREFILL_BLOCK`: row token *i* is at slot *i* (slot == position), whatever
  the other rows; rows with the same prompt share its prefill (the same arithmetic); the prefill is fed a
  block of ``PREFILL_BLOCK`` tokens at a time, so a block's KV depends on its token prefix alone and an
  earlier turn's blocks are loaded instead of recomputed (``_slot_prefix``: a deterministic turn re-read
  the whole conversation, the one cost the batched path's kept caches avoid);
* each row's last prompt token, then each generated token, is fed as a decode step and its KV written at
  the row's own slot (:func:`slot_cache`); the mask covers the slots up to the row's position (and, for a
  sliding-window layer, back to its window from that position);
* the cache length is a multiple of :data:`SLOT_BLOCK` slots, so the key reductions' lanes and blocks fall
  on the same positions whatever the length, and the slots past a row's position add exact zeros;
* the rows of a step are padded to a multiple of :data:`ROW_BLOCK` with copies of the last row (their
  logits are dropped), so every matmul has a row count the BLAS serves with one kernel.

Where that is not enough, every linear layer can also be computed in chunks of a fixed number of rows
(:attr:`SlotLayout.fixed_linear_rows`): measured on an Intel AMX CPU, whose float32 GEMM picks another kernel
for 4 rows than for 8 or 16 (by ``K``), the slot layout failed the self-test in float32 and passes it with
every linear layer done in chunks of ``PREFILL_CHUNK_ROWS`` rows (the prefill: whole blocks of tokens) or
``DECODE_CHUNK_ROWS`` rows (the decode steps): one matrix shape, one kernel, whatever the batch. It costs
one call per chunk, so the engine turns it on only where the stock kernels fail the self-test.

That removes the sources measured here; it proves nothing about other kernels (another BLAS, a GPU), so the
engine co-steps rows on this layout only after its self-test (``_batch_invariance``) ran probe rows alone and
together through this very path and found every submodule output bitwise equal. Only for models whose
layers are full or sliding-window attention (:meth:`SlotLayout.supported`); others run deterministic rows
alone through the plain batch path.

The decode steps here (``SlotCache.feed``, ``reorder_cache``) pad, mask and compact with new tensors every
step. Where :attr:`SlotLayout.decoder` is set (on CUDA; ``_slot_decode``) the same layout's steps run as
static shapes over the engine's KV pool instead, replayed as CUDA graphs, and :meth:`SlotLayout.fill` writes
the prefill straight into the pool's view of the batch's layout (no KV tensor allocated); the self-test then
probes those.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._core import ConfigurationError
from ..interp import text_config
from ._buckets import ROW_BUCKETS, row_bucket
from ._cpu_attention import at_any_row_count
from ._decode import ModelRunner, Row, raise_if_cancelled, stop_window
from ._generation_types import GenerationRequest, GenerationResult
from ._invariant_norm import fixed_order_norms
from ._slot_prefix import PrefixStore

if TYPE_CHECKING:
    import torch

    from ._kv_pool import KVPool

__all__ = [
    "DECODE_CHUNK_ROWS",
    "PREFILL_BLOCK",
    "PREFILL_CHUNK_ROWS",
    "ROW_BLOCK",
    "SLOT_BLOCK",
    "SlotLayout",
    "SlotSteps",
    "padded_rows",
    "slot_cache",
]

#: Rows of every decode step are padded to a multiple of this (MKL: 1-3 rows take another kernel than 4 or
#: more; every multiple of 4 measured invariant with 1 to 8 threads). A padding row costs a row of KV cache.
ROW_BLOCK = 4
#: Cache lengths are a multiple of this many slots: vector lanes x unrolled accumulators of the reductions.
SLOT_BLOCK = 64
#: Prefill widths are a multiple of this many tokens (a smaller block than the cache's: the prefill is most of
#: a deterministic turn's extra work, and 32 keeps every matmul's rows and attention block edges aligned).
PREFILL_BLOCK = 32
#: Where linear layers run in fixed-row chunks (``fixed_linear_rows``), the rows of a chunk: at decode steps,
#: and at the prefill (four prefill blocks). Larger chunks are fewer calls, each reading the weights once:
#: SmolLM2-135M co-stepped 8 debates at 71 tok/s with 8 and 128 where 4 and 32 gave 42 (bfloat16, Intel AMX;
#: the stock batched path 94), and both pass the self-test in float32 and bfloat16 there.
DECODE_CHUNK_ROWS = 8
PREFILL_CHUNK_ROWS = 4 * PREFILL_BLOCK


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _shared_blocks(prompts: list[tuple[int, ...]]) -> int:
    """How many full ``PREFILL_BLOCK`` blocks of prefill (all but each prompt's last token) every one of
    ``prompts`` starts with."""
    first = prompts[0]
    shared = min(len(p) - 1 for p in prompts) // PREFILL_BLOCK
    while shared and any(p[: shared * PREFILL_BLOCK] != first[: shared * PREFILL_BLOCK] for p in prompts):
        shared -= 1
    return shared


def padded_rows(n: int, *, buckets: bool) -> int:
    """The rows a step of ``n`` real rows runs at: a multiple of ``ROW_BLOCK``, or with ``buckets`` (on
    CUDA) the row bucket holding ``n`` (``_buckets.row_bucket``, at least ``ROW_BLOCK``), so every batch of
    a bucket is one shape: one captured graph, and the shape the self-test probed for that bucket (kernels
    are picked by the shape). Past the largest bucket: a multiple of ``ROW_BLOCK``."""
    if buckets and n <= ROW_BUCKETS[-1]:
        return _round_up(max(n, row_bucket(n)), ROW_BLOCK)
    return _round_up(n, ROW_BLOCK)


class SlotSteps(Protocol):
    """What :meth:`SlotLayout.generate` hands its decode steps to when it serves the layout
    (``_slot_decode.SlotDecoder``: static-shape steps over a KV pool, replayed as graphs on CUDA); kept
    abstract here so this module does not import it."""

    #: the engine's KV pool, the batched rows' decoder's too (the engine's memory figures count it once)
    pool: KVPool

    def serves(self, layout: SlotLayout) -> bool: ...

    def place(self, layout: SlotLayout, rows: int, need: int) -> int | None: ...

    def chunks(self, prompts: list[int], caps: list[int], *, buckets: bool) -> list[list[int]]: ...

    def release(self) -> None: ...

    def decode(
        self,
        rows: list[Row],
        prefill: Any,
        index: Sequence[int],
        cancelled: threading.Event | None,
        *,
        buckets: bool,
    ) -> None: ...


class SlotLayout:
    """The deterministic path on the batch-invariant layout, over one model runner (see the module
    docstring). :meth:`fill` and :meth:`first` (or the :attr:`decoder`'s steps) are the calls the self-test
    (``_batch_invariance``) probes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        #: Compute every linear layer in fixed-row chunks on this layout (set by the engine when the stock
        #: kernels fail the self-test and the chunked ones pass it).
        self.fixed_linear_rows = False
        #: Compute every swappable RMSNorm in a fixed order (``_invariant_norm``) on this layout: on CUDA,
        #: whose reduction kernels pick their blocking by the row count; not on the CPU, whose stock norms
        #: pass the self-test and cost less.
        self.fixed_norms = runner.device.startswith("cuda")
        #: Pad a step's rows to its row bucket (on CUDA: one shape, one graph, one probe per bucket) instead
        #: of a multiple of ``ROW_BLOCK`` (on the CPU: fewer padding rows).
        self.buckets = runner.device.startswith("cuda")
        self._supported: bool | None = (
            None  # whether the model's cache layers allow the layout (checked once)
        )
        #: Prompt blocks' KV kept by their tokens (``_slot_prefix``): what a later turn need not prefill.
        self.prefixes = PrefixStore(block=PREFILL_BLOCK)
        #: The decode steps as static shapes over a KV pool (graphs on CUDA: ``_slot_decode``); None: the
        #: eager slot steps below. The engine sets it (``slot_decoder_for``); the self-test probes the one
        #: set.
        self.decoder: SlotSteps | None = None

    def static_steps(self) -> bool:
        """Whether this model's decode steps run through :attr:`decoder` (what the self-test must probe)."""
        return self.decoder is not None and self.decoder.serves(self)

    def supported(self) -> bool:
        """Whether every layer of the model is full or sliding-window attention over a plain static cache
        (the layout keeps both as full-length static layers and builds a sliding layer's window into its
        mask). Chunked attention, linear attention and state-space layers are not: their masks or states
        would need their own per-row rules, so such models run deterministic rows alone."""
        if self._supported is None:
            from transformers import StaticCache
            from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

            config = self.runner.model.config
            types = set(getattr(text_config(config), "layer_types", None) or ("full_attention",))
            try:
                probe = StaticCache(config=config, max_cache_len=SLOT_BLOCK)
            except (TypeError, ValueError, KeyError, NotImplementedError):
                self._supported = False
            else:
                kinds = {type(layer) for layer in probe.layers}
                self._supported = (
                    bool(kinds)
                    and kinds <= {StaticLayer, StaticSlidingWindowLayer}
                    and types <= {"full_attention", "sliding_attention"}
                )
        return self._supported

    def generate(
        self, requests: list[GenerationRequest], cancelled: threading.Event | None
    ) -> list[GenerationResult | Exception]:
        """Prefill the distinct prompts in one batch, then decode every row in one slot-cache batch."""
        import torch

        runner = self.runner
        started = time.perf_counter()
        raise_if_cancelled(cancelled)
        prompts = [r.prompt_ids for r in requests]
        length = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
        distinct = list(dict.fromkeys(prompts))
        rows = [Row(r, stop_window=stop_window(r.sampling.stop)) for r in requests]
        # the decoder's slot length: the longest prompt and the largest cap (as its steps count them)
        need = max(len(p) for p in prompts) + max(r.sampling.max_new_tokens for r in requests)
        place = None if self.decoder is None else self.decoder.place(self, len(rows), need)
        if self.decoder is not None and place is not None:
            # prefilled straight into the pool, at the slots the decode steps read (padded rows x place)
            cache = self.fill(distinct, place, reuse=True, pool=self.decoder.pool)
            index = {p: i for i, p in enumerate(distinct)}
            with self.invariant_kernels(DECODE_CHUNK_ROWS):
                self.decoder.decode(rows, cache, [index[p] for p in prompts], cancelled, buckets=self.buckets)
        else:
            cache = self.fill(distinct, length, reuse=True)
            logits = self.first(prompts, distinct, cache)
            positions = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=runner.device)
            with self.invariant_kernels(DECODE_CHUNK_ROWS):
                runner.decode(rows, logits, cache, positions, None, 0, cancelled, static=True)
        seconds = time.perf_counter() - started
        uses = {p: prompts.count(p) for p in set(prompts)}
        return [
            row.failure
            if row.failure is not None
            else runner.result(
                row,
                seconds=seconds,
                batch_size=len(rows),
                shared=len(row.request.prompt_ids) - 1 if uses[row.request.prompt_ids] > 1 else 0,
                reused=0,
            )
            for row in rows
        ]

    def fill(
        self, distinct: list[tuple[int, ...]], length: int, *, reuse: bool = False, pool: KVPool | None = None
    ) -> Any:
        """A new slot cache (at least ``length`` slots) with all but the last token of each distinct prompt
        prefilled at slots ``0 .. len-2``: in one batch padded on the RIGHT to a multiple of
        ``PREFILL_BLOCK`` tokens (slot == position; so a multiple of ``ROW_BLOCK`` matmul rows), fed one
        block of ``PREFILL_BLOCK`` tokens at a time (block ``k`` attends to blocks ``0 .. k-1`` in the
        cache): so a block's KV depends on the tokens up to its end alone, and with ``reuse`` the blocks
        every prompt has in :attr:`prefixes` are loaded instead of computed (``_slot_prefix``).

        With ``pool`` (the static decoder's: ``SlotDecoder.place`` made it hold the batch's layout of
        ``length`` slots, a multiple of ``SLOT_BLOCK``) the cache is the pool's view of that layout's first
        rows (``KVPool.span``): the prefill writes straight into the slots the decode steps read, and no KV
        tensor is allocated (``SlotDecodeStep.begin`` expands the distinct prompts to their rows there).

        No padding mask is needed: a real token never attends to a later slot, so pads are seen only by pad
        queries, and a row's decode steps overwrite its pad slots before its mask reaches them. Unmasked,
        every pad query attends to something, so the pad slots hold finite values (a fully masked query
        would leave NaN there, and ``0 * NaN`` in ``probs @ V`` would reach the real rows)."""
        import torch

        model, device = self.runner.model, self.runner.device
        width = _round_up(max(len(p) for p in distinct) - 1, PREFILL_BLOCK)
        if pool is not None:
            if length % SLOT_BLOCK or width > length:
                raise ConfigurationError(
                    f"SlotLayout.fill(length={length}, pool=...): a pool layout's slots must be a multiple "
                    f"of SLOT_BLOCK ({SLOT_BLOCK}) holding the {width}-slot prefill; ask SlotDecoder.place"
                )
            cache = pool.span(0, len(distinct), length=length)
            cache.slot_layers = cache.layers  # what the prefix store reads and writes
        else:
            cache = slot_cache(
                model.config,
                rows=len(distinct),
                length=max(length, width),
                dtype=model.dtype,
                buckets=self.buckets,
            )
        if not width:  # every prompt is one token: nothing before its last
            return cache
        start = 0
        if reuse:
            self.prefixes.use_kernels(self.kernels())
            shared = _shared_blocks(distinct)
            if len(distinct) > 1 and shared > self.prefixes.kept(distinct, width):
                # the blocks every prompt starts with (a system prompt), prefilled once in a row of their
                # own and kept: then loaded for every row below (the same bits as each row computing them)
                self.fill([distinct[0][: shared * PREFILL_BLOCK + 1]], length, reuse=True, pool=pool)
            start = self.prefixes.kept(distinct, width) * PREFILL_BLOCK
            if start:
                self.prefixes.load(cache, distinct, start // PREFILL_BLOCK)
        ids = torch.tensor(
            [list(p[:-1]) + [self.runner.pad_id] * (width - len(p) + 1) for p in distinct],
            dtype=torch.long,
            device=device,
        )
        with self.invariant_kernels(PREFILL_CHUNK_ROWS):
            for begin in range(start, width, PREFILL_BLOCK):
                end = begin + PREFILL_BLOCK
                model(
                    input_ids=ids[:, begin:end],
                    position_ids=torch.arange(begin, end, device=device).expand(len(distinct), PREFILL_BLOCK),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        if reuse:
            self.prefixes.keep(cache, distinct, start // PREFILL_BLOCK)
        return cache

    def kernels(self) -> tuple[bool, ...]:
        """The kernel choices a prefill's arithmetic depends on (kept blocks are keyed by them)."""
        return (self.fixed_linear_rows, self.fixed_norms)

    def first(
        self, prompts: list[tuple[int, ...]], distinct: list[tuple[int, ...]], cache: Any
    ) -> torch.Tensor:
        """Give each row its prompt's prefilled slots in ``cache`` (from :meth:`fill` of ``distinct``; rows
        with one prompt share them: the same arithmetic), then feed each row its last prompt token as a
        decode step: the logits of its first generated token (rows, vocab)."""
        import torch

        device = self.runner.device
        index = {p: i for i, p in enumerate(distinct)}
        cache.reorder_cache(torch.tensor([index[p] for p in prompts], dtype=torch.long, device=device))
        last = torch.tensor([[p[-1]] for p in prompts], dtype=torch.long, device=device)
        positions = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=device)
        with self.invariant_kernels(DECODE_CHUNK_ROWS):
            return self.runner.step(last, positions, None, cache, 0, True)

    @contextlib.contextmanager
    def invariant_kernels(self, rows: int) -> Iterator[None]:
        """Within it, a row is computed the same way whatever the batch's size: the CPU decode-step attention
        at every row count (``_cpu_attention.at_any_row_count``), and every linear layer of the model in
        chunks of ``rows`` rows when :attr:`fixed_linear_rows` is set, and every swappable RMSNorm in a fixed
        order when :attr:`fixed_norms` is set. The prefill, the decode steps and the
        self-test's steps run in one."""
        model = self.runner.model
        with contextlib.ExitStack() as stack:
            stack.enter_context(at_any_row_count(model))
            if self.fixed_norms:
                stack.enter_context(fixed_order_norms(model))
            if self.fixed_linear_rows:
                stack.enter_context(_fixed_row_linears(model, rows))
            yield


@contextlib.contextmanager
def _fixed_row_linears(model: Any, rows: int) -> Iterator[None]:
    """Every ``nn.Linear`` of ``model`` computes in chunks of ``rows`` rows while inside: its ``forward``
    replaced on the instance, so only this model's linear layers change (the engine's lock keeps other
    calls off it meanwhile) and no other op pays for it (a torch function mode sees every op of the forward
    pass in Python: ~5% slower on a 135M model, measured; the chunk sizes were the real cost). Subclasses of
    ``nn.Linear`` (quantized layers) keep their own forward; if their kernels are not invariant the self-test
    says so."""
    import torch

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for module in linears:
        module.forward = functools.partial(_chunked_linear, module, rows)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in linears:
            del module.forward


def _chunked_linear(module: Any, rows: int, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` in chunks of ``rows`` rows, the last padded with copies of its last row: one matrix
    shape, hence one kernel, whatever the batch."""
    import torch

    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    if count == rows:  # exactly one chunk (a decode step of a full block of rows): the plain call
        return torch.nn.functional.linear(x, module.weight, module.bias)
    pad = -count % rows
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad, -1)])
    linear = torch.nn.functional.linear
    out = torch.cat([linear(chunk, module.weight, module.bias) for chunk in flat.split(rows)])
    return out[:count].reshape(*x.shape[:-1], module.weight.shape[0])


@functools.cache
def _slot_cache_class() -> type:
    """The cache class, built on first use (``import interlens`` does not import transformers)."""
    import torch
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    from transformers.masking_utils import create_causal_mask

    class SlotCache(StaticCache):
        """A static cache whose decode steps write each row's token at that row's own slot (its position).

        ``feed`` pads a step's rows to the cache's row count, says where each writes and builds the masks;
        ``reorder_cache`` keeps the row count a multiple of ``ROW_BLOCK`` when finished rows leave. Every
        layer is a full-length static layer, sliding-window ones included (their window is in their mask:
        a ring buffer would put a row's keys at slots that depend on its length).
        """

        def __init__(
            self, config: Any, *, rows: int, length: int, dtype: torch.dtype, buckets: bool = False
        ) -> None:
            self.buckets = buckets
            self.length = _round_up(length, SLOT_BLOCK)
            super().__init__(config=config, max_cache_len=self.length)
            self.slot_layers: list[Any] = [StaticLayer(self.length) for _ in self.layers]
            self.layers = self.slot_layers
            self.config, self.dtype = config, dtype
            text = text_config(config)
            types = getattr(text, "layer_types", None) or ()
            self.window = text.sliding_window if "sliding_attention" in types else None
            self.rows = padded_rows(rows, buckets=buckets)  # rows of the stored KV, padding included
            # per stored row: the slot the current step writes (None until the first step: the prefill)
            self.slots: torch.Tensor | None = None

        def feed(
            self, tokens: torch.Tensor, positions: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, Any]:
            """Pad one step's ``tokens`` (rows, 1) and ``positions`` (rows,) to the stored rows with copies
            of the last row; returns them with the attention mask: the 2-D mask of the slots up to each
            row's position, or for a model with sliding-window layers the model's 4-D masks per layer type
            (the window counted back from each row's own position, not from the batch's furthest)."""
            pad = self.rows - tokens.shape[0]
            if pad:
                tokens = torch.cat([tokens, tokens[-1:].expand(pad, -1)])
                positions = torch.cat([positions, positions[-1:].expand(pad)])
            self.slots = positions
            top = positions.max()  # stays on the device: reading it would be a host sync every step
            for layer in self.slot_layers:
                layer.cumulative_length.copy_(top)  # the causal mask's query offset: the furthest row
            slots = torch.arange(self.length, device=positions.device)
            mask = (slots.unsqueeze(0) <= positions.unsqueeze(1)).long()
            ids = positions.unsqueeze(1)
            if self.window is None:
                return tokens, ids, mask
            window = self.window
            shape = torch.empty((self.rows, 1, 1), dtype=self.dtype, device=positions.device)
            masks = {
                kind: create_causal_mask(
                    config=self.config,
                    inputs_embeds=shape,
                    attention_mask=mask,
                    cache=self,
                    position_ids=ids,
                    and_mask_function=within,
                )
                for kind, within in (
                    ("full_attention", None),
                    ("sliding_attention", lambda b, h, q, kv: kv > positions[b] - window),
                )
            }
            return tokens, ids, masks

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if self.slots is None:  # the prefill, before any step: slots 0 .. width-1 of every row
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            layer = self.slot_layers[layer_idx]
            if not layer.is_initialized:  # every prompt was one token: nothing was prefilled
                layer.lazy_initialization(key_states, value_states)
            device = key_states.device  # a model split over devices keeps each layer's cache on its own
            rows = torch.arange(key_states.shape[0], device=device)
            slots = self.slots.to(device)
            layer.keys[rows, :, slots] = key_states[:, :, 0]
            layer.values[rows, :, slots] = value_states[:, :, 0]
            return layer.keys, layer.values

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            keep = beam_idx.tolist()
            self.rows = padded_rows(len(keep), buckets=self.buckets)
            keep += keep[-1:] * (self.rows - len(keep))
            index: Any = torch.tensor(keep, dtype=torch.long, device=beam_idx.device)
            super().reorder_cache(index)

    return SlotCache


def slot_cache(config: Any, *, rows: int, length: int, dtype: Any, buckets: bool = False) -> Any:
    """A new slot cache for ``rows`` rows (stored padded: :func:`padded_rows`) and at least ``length``
    slots (a multiple of ``SLOT_BLOCK``), for a model computing in ``dtype``."""
    return _slot_cache_class()(config, rows=rows, length=length, dtype=dtype, buckets=buckets)
