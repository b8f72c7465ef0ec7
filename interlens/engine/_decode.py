"""The model runner: the model calls and THE decode loop every generation path shares.

Why a hand-written loop rather than ``model.generate``: ``generate`` cannot honour per-row temperature / top-p
/ max_new_tokens / stop strings, cannot drop finished rows, and draws every row from one RNG stream. Here
each step samples every active row at once (``_sampler.Sampler``: a seeded row from its own stream), checks
end-of-turn ids, stop strings and token caps per row, and drops finished rows from the batch (their KV rows
removed, once enough have finished to pay for the copy), so long rows do not drag short ones along.

Non-finite logits (fp16 overflow, a broken checkpoint) never reach a sampled token: each step reduces each
row's logits to one float32 sum on the device (NaN/inf iff a logit is) and folds the verdict into the chosen
tokens (-1 for a bad row), so the one host sync the loop already makes (the chosen tokens) brings it along.
A bad row stops with a :class:`~interlens.GenerationError` (``Row.failure``, returned in place of its
result) and is dropped like a finished row, so its garbage token is never fed; the other rows carry on. On
CUDA a NaN fed onward would end in a device-side assert that poisons the whole process.

The paths that prepare a cache (``_prefill.PlainBatch``: one batch from scratch;
``_kv_reuse.ReusedPrefixBatch``: streams' kept caches laid out; ``_slot_rows.SlotLayout``: deterministic
rows; ``_interp_rows.HookedRow``: a hooked row) each hold their engine's one runner and all end in
:meth:`ModelRunner.decode`. No path subclasses the runner; a test or a benchmark may, to observe the model
calls (``LocalEngine._runner_type``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from interlens.scheduler import BatchCancelled

from .._core import GenerationError
from ._cpu_attention import use_cpu_decode_attention
from ._generation_types import FINISH_REASONS, GenerationRequest, GenerationResult
from ._sampler import Sampler
from ._sampling import eos_ids, pad_id

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from ._kv_pool import KVPool

__all__ = ["ModelRunner", "Row", "StaticDecode", "hand_out", "left_pad", "raise_if_cancelled", "stop_window"]

#: Finished rows stay in the batch (fed an ignored token) until they are at least 1/_COMPACT_SHARE of it:
#: dropping them copies the whole KV cache (every layer, every position), which at a row leaving on most
#: steps cost more per step than the rows' own share of the forward pass (benchmarks/bench_decode_step.py).
_COMPACT_SHARE = 8


@dataclass
class Row:
    """Mutable per-row decode state."""

    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    stop_window: int = 0  # how many trailing tokens can hold a stop string (0: row has no stop strings)
    failure: GenerationError | None = None  # set instead of ``finish`` when the row's logits went bad
    # Where the row's prompt KV lies in the batch cache when its layout has holes (a shared prefix, a kept
    # cache laid out); None: the ``len(prompt)`` slots right before the first generated token's.
    prompt_slots: list[int] | None = None
    # per generated token, (model, sampling) log-probabilities, when the request records them
    logprobs: list[tuple[float, float]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish is not None or self.failure is not None


class StaticDecode(Protocol):
    """What :meth:`ModelRunner.decode` hands a batch to when it serves it (``_static_decode.StaticDecoder``:
    the loop of static-shape steps, replayed as graphs on CUDA); kept abstract here so this module does not
    import it."""

    #: the engine's one KV pool, which a batch's prefill writes into where :meth:`layout` says so
    pool: KVPool

    def serves(self, rows: list[Row], cache: Any, static: bool, kv_len: int) -> bool: ...

    def layout(self, rows: int, need: int) -> int | None: ...

    def chunks(self, prompts: list[int], caps: list[int]) -> list[list[int]]: ...

    def release(self) -> None: ...

    def decode(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        cache: Any,
        positions: torch.Tensor,
        attn: torch.Tensor | None,
        kv_len: int,
        cancelled: threading.Event | None,
        *,
        on_leave: Callable[[list[int], list[Row], Any, int], None] | None = None,
    ) -> None: ...


class ModelRunner:
    """A loaded causal LM and its tokenizer on one device, with the special ids decoding needs.

    ``eos_ids`` end a row's turn; ``pad_id`` fills left padding (its KV is masked, so any id in the
    vocabulary would do); ``vocab_size`` bounds the ids a request may carry. ``mask_free_steps``: decode
    steps of a batch with no padded row attend over exactly the written slots with no mask
    (``_narrow_cache``): on CUDA, where SDPA's flash kernel takes no mask; not on the CPU, where the same
    steps ran at 0.82x of the masked, rounded window (SmolLM2-135M, bf16, 16 rows, AMD EPYC with AVX512-BF16:
    ``bench_cache_window.py --same``). ``decode_attention``: on the CPU, a model on transformers' ``sdpa``
    gets interlens' decode-step attention (``_cpu_attention``); False leaves the model's attention alone.
    """

    def __init__(self, model: Any, tokenizer: Any, *, device: str, decode_attention: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.mask_free_steps = device.startswith("cuda")
        if device == "cpu" and decode_attention:
            use_cpu_decode_attention(model)  # decode steps without SDPA's CPU kernel (``_cpu_attention``)
        self.eos_ids: frozenset[int] = eos_ids(model, tokenizer)
        self.pad_id: int = pad_id(model, tokenizer, self.eos_ids)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        #: decode through static-shape steps (graphs on CUDA: ``_static_decode``) where it serves a batch;
        #: None: the eager loop for every batch. The engine sets it (``static_decoder_for``).
        self.static_decode: StaticDecode | None = None

    def pool_layout(self, rows: int, need: int) -> tuple[KVPool, int] | None:
        """Where a batch of ``rows`` rows needing ``need`` slots prefills: the static decoder's KV pool and
        the length bucket of the batch's layout in it (``StaticDecoder.layout``), or None (its own cache)."""
        decoder = self.static_decode
        length = decoder.layout(rows, need) if decoder is not None else None
        return None if decoder is None or length is None else (decoder.pool, length)

    # ------------------------------------------------------------------ model calls

    def forward(self, ids: list[list[int]], mask: list[list[int]], cache: Any) -> torch.Tensor:
        """Prefill a left-padded block; returns the last position's logits, shape (rows, vocab)."""
        import torch

        device = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        attention = torch.tensor(mask, dtype=torch.long, device=device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        has_pad = not bool(attention.all())
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention if has_pad else None,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def forward_part(self, ids: list[list[int]], mask: torch.Tensor, cache: Any, offset: int) -> torch.Tensor:
        """Prefill a block of suffixes after ``offset`` cached prefix tokens; ``mask`` spans prefix + block
        (the holes of shorter suffixes masked). Returns the last position's logits, shape (rows, vocab)."""
        import torch

        positions = (mask.cumsum(-1)[:, offset:] - 1).clamp(min=0)
        out = self.model(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            attention_mask=None if bool(mask.all()) else mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attn: torch.Tensor | None,
        cache: Any,
        kv_len: int,
        static: bool,
    ) -> torch.Tensor:
        """Feed one token per row; ``kv_len`` is the KV length after this step.

        ``attn`` is the full-length 2-D padding mask (or None): a static cache takes it whole (its KV is
        preallocated to that length), a dynamic cache takes the first ``kv_len`` columns, a view, no copy.
        A slot cache (``_slot_rows``) pads the rows and builds the mask itself (``feed``); only the given
        rows' logits are returned.
        """
        rows = tokens.shape[0]
        feed = getattr(cache, "feed", None)
        if feed is not None:
            tokens, position_ids, attn = feed(tokens, positions)
        else:
            position_ids = positions.unsqueeze(1)
            if attn is not None and not static:
                attn = attn[:, :kv_len]
            narrow = getattr(cache, "narrow", None)
            if narrow is not None:  # a static cache: attend over the slots written so far (``_narrow_cache``)
                narrow(kv_len, exact=attn is None and self.mask_free_steps)
        out = self.model(
            input_ids=tokens,
            attention_mask=attn,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        return out.logits[:rows, -1, :]

    # ------------------------------------------------------------------ the decode loop

    def decode(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        cache: Any,
        positions: torch.Tensor,
        attn: torch.Tensor | None,
        kv_len: int,
        cancelled: threading.Event | None,
        *,
        static: bool,
        on_leave: Callable[[list[int], list[Row], Any, int], None] | None = None,
    ) -> None:
        """Sample until every row is finished, dropping finished rows from the batch (in bunches: see
        ``_COMPACT_SHARE``).

        ``on_leave(indices, rows, cache, gen_start)`` is told about rows as they leave the batch (dropped
        when finished, or at the end): their indices in the batch as it is then, the rows, the cache and the
        KV slot where the first generated token was written, so the caller can copy a row's KV out before
        it is gone (``_kv_reuse`` keeps it for the stream's next turn).

        ``positions`` holds each active row's position of the NEXT token to feed; ``attn`` is the full-length
        2-D mask (None when no row is padded); ``kv_len`` the KV length already in the cache. Each row's last
        sampled token is never fed.
        """
        import torch

        static_decode = self.static_decode
        if static_decode is not None and static_decode.serves(rows, cache, static, kv_len):
            static_decode.decode(rows, logits, cache, positions, attn, kv_len, cancelled, on_leave=on_leave)
            return
        gen_start = kv_len
        active = list(rows)
        record = any(r.request.record_logprobs for r in rows)
        sampler = Sampler([r.request.sampling for r in active], self.device, record=record)
        # the recorded log-probabilities stay on the device until the rows are done: one read at the end
        recorded: list[tuple[list[tuple[int, Row]], torch.Tensor]] = []
        while True:
            # the sampler's row maxima say which rows' logits went NaN / +inf, on the device, no sync of
            # their own and no extra pass over rows × vocab
            choice = sampler.choose(logits)
            chosen = torch.where(choice.finite, choice.tokens, -1)
            took = self.take_tokens(active, chosen.tolist())
            # rows of ``active`` that are finished (or failed) but not yet dropped from the batch
            dead = sum(row.done for row in active)
            if choice.logprobs is not None and took:
                recorded.append((took, choice.logprobs))
            if dead == len(active):
                hand_out(recorded)
                if on_leave is not None:
                    on_leave(list(range(len(active))), active, cache, gen_start)
                return
            raise_if_cancelled(cancelled)
            if dead and dead * _COMPACT_SHARE >= len(active):
                keep = [j for j, row in enumerate(active) if not row.done]
                if on_leave is not None:
                    gone = [j for j, row in enumerate(active) if row.done]
                    on_leave(gone, [active[j] for j in gone], cache, gen_start)
                keep_t = torch.tensor(keep, dtype=torch.long, device=chosen.device)
                cache.reorder_cache(keep_t)  # index_select on the batch dim, for static and dynamic layers
                chosen = chosen.index_select(0, keep_t)
                positions = positions.index_select(0, keep_t)
                if attn is not None:
                    attn = attn.index_select(0, keep_t)
                    if bool(attn.all()):
                        attn = None  # the padded rows are gone: let attention skip the mask
                active = [active[j] for j in keep]
                sampler = sampler.select(keep)
            elif dead:
                chosen = chosen.clamp(min=0)  # a failed row still in the batch is fed a valid (ignored) id
            kv_len += 1
            logits = self.step(chosen.unsqueeze(1), positions, attn, cache, kv_len, static)
            positions = positions + 1

    def take_tokens(self, active: list[Row], chosen: list[int]) -> list[tuple[int, Row]]:
        """The host's checks of one step: each unfinished row of ``active`` takes its token of ``chosen``
        (-1: its logits went non-finite, the row fails) and ends at an end-of-turn id, a stop string or its
        token cap. Returns the rows that took a token, by their index in the step. Finished rows still in
        the batch are skipped (their draws are ignored)."""
        eos = self.eos_ids
        took: list[tuple[int, Row]] = []
        for k, (row, token) in enumerate(zip(active, chosen, strict=True)):
            if row.done:
                continue
            if token < 0:
                row.failure = self._non_finite(row)
                continue
            row.tokens.append(token)
            took.append((k, row))
            if token in eos:
                row.finish = "eos"
            elif row.stop_window and self._hit_stop(row):
                row.finish = "stop"
            elif len(row.tokens) >= row.request.sampling.max_new_tokens:
                row.finish = "length"
        return took

    def _non_finite(self, row: Row) -> GenerationError:
        name = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        dtype = str(getattr(self.model, "dtype", "unknown")).removeprefix("torch.")
        return GenerationError(
            f"model {name!r} ({dtype} on {self.device}) produced non-finite logits (NaN or inf) for this "
            f"row at generated token {len(row.tokens) + 1} (prompt of {len(row.request.prompt_ids)} "
            "tokens); the row was stopped before sampling. Likely cause: float16 overflow or a broken "
            "checkpoint (NaN weights). Fix: load the model with dtype='bfloat16' (or 'float32'), or check "
            "the checkpoint's weights."
        )

    def _hit_stop(self, row: Row) -> bool:
        # Only the tail can hold a NEW match (older text was checked on earlier steps), so decode just that.
        tail = self.tokenizer.decode(row.tokens[-row.stop_window :], skip_special_tokens=True)
        return any(s in tail for s in row.request.sampling.stop)

    def result(
        self, row: Row, *, seconds: float, batch_size: int, shared: int, reused: int
    ) -> GenerationResult:
        """The row's result. ``shared``: its leading prompt tokens prefilled once for several rows;
        ``reused``: its prompt tokens whose KV came from its stream's kept cache."""
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        if row.finish == "stop":
            cuts = [i for i in (text.find(s) for s in row.request.sampling.stop) if i >= 0]
            if cuts:
                text = text[: min(cuts)]
        assert row.finish in FINISH_REASONS
        recorded = row.request.record_logprobs
        return GenerationResult(
            token_ids=list(row.tokens),
            text=text,
            n_tokens=len(row.tokens),
            finish_reason=row.finish,
            prompt_tokens=len(row.request.prompt_ids),
            seconds=seconds,
            batch_size=batch_size,
            shared_prefix_tokens=shared,
            kv_reused_tokens=reused,
            model_logprobs=[m for m, _ in row.logprobs] if recorded else None,
            sampling_logprobs=[s for _, s in row.logprobs] if recorded else None,
            prompt_ids=row.request.prompt_ids if recorded else None,
        )


def hand_out(recorded: list[tuple[list[tuple[int, Row]], torch.Tensor]]) -> None:
    """Give each row its tokens' log-probabilities, read from the device in one go: per step, the rows
    that took a token there, by their index in that step's (rows, 2) tensor."""
    import torch

    if not recorded:
        return
    values = torch.cat([lps for _, lps in recorded]).tolist()
    start = 0
    for took, lps in recorded:
        for k, row in took:
            model, sampling = values[start + k]
            row.logprobs.append((model, sampling))
        start += lps.shape[0]


def left_pad(
    prompts: Sequence[Sequence[int]], width: int, pad_id: int
) -> tuple[list[list[int]], list[list[int]]]:
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


def stop_window(stops: tuple[str, ...]) -> int:
    """Trailing tokens that can hold a stop string: a byte-level token may carry a single byte of a char."""
    return 4 * max(len(s) for s in stops) + 4 if stops else 0


def raise_if_cancelled(cancelled: threading.Event | None) -> None:
    if cancelled is not None and cancelled.is_set():
        raise BatchCancelled("generation cancelled")
