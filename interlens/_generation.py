"""Batched text generation for a local HuggingFace causal LM: the engine behind every local-model turn.

The scheduler coalesces the turn requests that are pending for one model on one device and hands them to
:meth:`LocalEngine.generate_batch` as ONE call, in a worker thread. Batching is where the throughput is
(12-25x over one row at a time on CPU), so this module is about running a batch of heterogeneous rows well:

* one left-padded batch (positions from the attention mask), prefilled once, then a hand-written decode loop.
  ``model.generate`` cannot honour per-row temperature / top-p / max_new_tokens / stop strings, cannot drop
  finished rows, and draws every row from one RNG stream;
* finished rows are dropped from the batch (their KV rows removed), so long rows do not drag short ones along;
* a row with a ``seed`` samples from its own random stream, all rows in one vectorised step (``_sampling``):
  its tokens do not depend on its batch mates' draws (rows without a seed draw from torch's global RNG);
* identical prompts (n samples of one scenario) are prefilled ONCE and their KV cache expanded to the rows;
* prompts of very different lengths are prefilled in length-sorted groups (less padding: on CPU the prefill
  is most of a short turn's cost) and laid into one left-padded cache for a single decode loop;
* a single-row request with a ``reuse_key`` keeps its KV cache for that stream's next turn, which then only
  prefills what is new (a conversation's prompt grows turn by turn by a suffix); not in deterministic mode.

A preallocated ``StaticCache`` is used for batches: a ``DynamicCache`` re-concatenates the whole KV every
step, which is up to a third of a decode step at batch 64 on CPU. Reuse streams use a ``DynamicCache``
because they must grow past any preallocated length on the next turn.

Out-of-memory errors are deliberately NOT caught: the scheduler splits a batch that ran out of memory in
halves and retries (after :meth:`LocalEngine.release_memory`). A request that is bad on its own (a token id
outside the vocabulary) is returned in place as an exception instance, so it fails only its own caller (see
``interlens.scheduler.Engine``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from interlens._exceptions import ConfigurationError
from interlens._sampling import Sampler, SamplingSettings, eos_ids, pad_id
from interlens.scheduler import BatchCancelled, ExecutionMode

if TYPE_CHECKING:
    import torch

__all__ = ["GenerationRequest", "GenerationResult", "LocalEngine", "SamplingSettings"]

_FINISH_REASONS = ("eos", "length", "stop")


@dataclass(frozen=True, init=False)
class GenerationRequest:
    """One row of a batched generate: a tokenized prompt and how to continue it (``sampling=``, as
    ``ChatEngine`` passes the participant's on, or the settings as keywords). Validated on construction, so
    a bad value fails in the participant that built it, not deep inside a batch shared with others.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingSettings
    reuse_key: Hashable | None  # KV reuse stream across turns (single-row requests); None = no reuse

    def __init__(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        reuse_key: Hashable | None = None,
        *,
        sampling: SamplingSettings | None = None,
    ) -> None:
        if sampling is None:  # a missing max_new_tokens fails check() below: it must be an int >= 1
            sampling = SamplingSettings(max_new_tokens, temperature, top_p, stop, seed)  # type: ignore[arg-type]
        # Accept any sequence of prompt ids (a list is the natural thing to pass), store a tuple.
        object.__setattr__(self, "prompt_ids", tuple(prompt_ids))
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "reuse_key", reuse_key)
        if not self.prompt_ids:
            raise ConfigurationError(
                "GenerationRequest(prompt_ids=()): the prompt is empty; pass at least one token id "
                "(render the conversation with the chat template first)."
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prompt_ids):
            raise ConfigurationError(
                "GenerationRequest(prompt_ids=...): every prompt id must be a non-negative int; "
                "pass the token ids the tokenizer returned (e.g. tokenizer(text).input_ids)."
            )
        sampling.check("GenerationRequest")
        if self.reuse_key is not None:
            try:
                hash(self.reuse_key)
            except TypeError:
                raise ConfigurationError(
                    f"GenerationRequest(reuse_key={self.reuse_key!r}): reuse_key must be hashable "
                    "(a string or a tuple such as (job_id, participant))."
                ) from None

    @property  # what the sampler and the decode loop read (``_sampling._Settings``)
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop

    @property
    def seed(self) -> int | None:
        return self.sampling.seed


@dataclass
class GenerationResult:
    """What one row produced, plus how it was produced (recorded in the turn's metadata)."""

    token_ids: list[int]  # generated tokens, including the end-of-turn token when one was produced
    text: str  # decoded, special tokens skipped, cut BEFORE a matched stop string
    n_tokens: int  # == len(token_ids): tokens actually generated for this row
    finish_reason: str  # "eos" | "length" | "stop"
    prompt_tokens: int
    seconds: float  # wall time of the batched call this row was part of
    batch_size: int  # rows in that batched call
    shared_prefill: bool  # the prompt was prefilled once for several identical rows
    reused_prefix_tokens: int  # prompt tokens whose KV came from this stream's previous turn (0 if none)


@dataclass
class _Row:
    """Mutable per-row decode state."""

    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    stop_window: int = 0  # how many trailing tokens can hold a stop string (0: row has no stop strings)


class LocalEngine:
    """A loaded causal LM plus its tokenizer on one device; satisfies ``interlens.scheduler.Engine``.

    ``generate_batch`` runs one batch at a time (a lock), because live use may call it from several threads
    and the model, the RNG streams and the KV-reuse entries are shared state.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str,
        kv_reuse_capacity: int = 4,
        shared_prefill: bool = True,
    ) -> None:
        if kv_reuse_capacity < 0:
            raise ConfigurationError(f"LocalEngine(kv_reuse_capacity={kv_reuse_capacity}): must be >= 0.")
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.kv_reuse_capacity = kv_reuse_capacity
        self.shared_prefill = shared_prefill
        self._lock = threading.Lock()
        self._reuse: OrderedDict[Hashable, tuple[list[int], Any]] = OrderedDict()
        self._eos_ids = eos_ids(model, tokenizer)
        self._pad_id = pad_id(model, tokenizer, self._eos_ids)
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        # "static" for batches (see the module docstring); tests and the benchmark may compare "dynamic".
        self._batch_cache = "static"

    def __repr__(self) -> str:
        name = getattr(self.model.config, "_name_or_path", type(self.model).__name__)
        return f"LocalEngine({name!r}, device={self.device!r})"

    # ------------------------------------------------------------------ public face

    def generate_batch(
        self,
        requests: Sequence[GenerationRequest],
        *,
        mode: ExecutionMode = ExecutionMode.BATCHED,
        cancelled: threading.Event | None = None,
    ) -> list[GenerationResult | Exception]:
        """Generate one result per request, in order, as one batched call (see the module docstring).

        In ``ExecutionMode.DETERMINISTIC`` every request runs alone and from scratch (``reuse_key`` ignored:
        a reused KV cache gives logits a few ulps off a fresh prefill, and whether a stream's cache is still
        there depends on what else ran), so a seeded row is token-identical on the same hardware whatever
        else ran with or before it. When ``cancelled`` is set, generation stops within one decode step and
        :class:`interlens.scheduler.BatchCancelled` is raised.
        """
        import torch

        requests = list(requests)
        for request in requests:
            if not isinstance(request, GenerationRequest):
                kind = type(request).__name__
                raise TypeError(f"LocalEngine.generate_batch expects GenerationRequest objects, got {kind}.")
        out: list[GenerationResult | Exception | None] = [None] * len(requests)
        valid: list[int] = []
        for i, request in enumerate(requests):
            problem = self._check(request)
            if problem is None:
                valid.append(i)
            else:
                out[i] = problem
        alone = mode is ExecutionMode.DETERMINISTIC
        groups = [[i] for i in valid] if alone else ([valid] if valid else [])
        reuse = self.kv_reuse_capacity > 0 and not alone
        with self._lock, torch.inference_mode():
            for group in groups:
                batch = [requests[i] for i in group]
                if reuse and len(batch) == 1 and batch[0].reuse_key is not None:
                    results = [self._generate_reusing(batch[0], cancelled)]
                else:
                    results = self._generate_rows(batch, cancelled)
                for i, result in zip(group, results, strict=True):
                    out[i] = result
        return [r for r in out if r is not None]

    def release(self, reuse_key: Hashable) -> None:
        """Free the KV cache kept for ``reuse_key`` (e.g. when its conversation is over)."""
        with self._lock:
            self._reuse.pop(reuse_key, None)

    def clear_reuse(self) -> None:
        """Free every kept KV cache."""
        with self._lock:
            self._reuse.clear()

    def release_memory(self) -> None:
        """Before an out-of-memory retry: collect garbage cycles, return CUDA's cached blocks."""
        import gc

        import torch

        gc.collect()
        if self.device.startswith("cuda") and torch.cuda.is_available():
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()

    # ------------------------------------------------------------------ validation

    def _check(self, request: GenerationRequest) -> Exception | None:
        """Problems only this engine can see (the request validated itself); returned in place, not raised."""
        highest = max(request.prompt_ids)
        if highest >= self._vocab_size:
            return ConfigurationError(
                f"prompt token id {highest} is outside this model's vocabulary (size {self._vocab_size}); "
                "tokenize the prompt with this model's own tokenizer."
            )
        return None

    # ------------------------------------------------------------------ batched path

    def _generate_rows(
        self, requests: list[GenerationRequest], cancelled: threading.Event | None
    ) -> list[GenerationResult]:
        """One left-padded batch; identical prompts are prefilled once and their KV cache expanded."""
        import torch

        started = time.perf_counter()
        device = self.device
        lengths = [len(r.prompt_ids) for r in requests]
        max_new = max(r.max_new_tokens for r in requests)
        unique: dict[tuple[int, ...], int] = {}
        row_to_unique = [unique.setdefault(r.prompt_ids, len(unique)) for r in requests]
        shared = (
            self.shared_prefill and len(requests) > 1 and len(unique) < len(requests) and min(lengths) >= 2
        )
        _raise_if_cancelled(cancelled)

        if shared:
            # Prefill every distinct prompt minus its last token ONCE, copy the KV rows out to the batch rows,
            # then feed each row its last prompt token: the first decode step yields the first logits.
            # (Caching the whole prompt and feeding it again would duplicate the KV: pitfall 1 in the notes.)
            prompts = list(unique)
            prefix_len = max(len(p) for p in prompts) - 1
            ids, mask = _left_pad([p[:-1] for p in prompts], prefix_len, self._pad_id)
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
            ids, mask = _left_pad([r.prompt_ids for r in requests], prompt_len, self._pad_id)
            cache, static = self._new_batch_cache(prompt_len + max_new)
            groups = _prefill_groups(lengths) if static else []
            if len(groups) > 1 and _plain_static(cache):
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

        rows = [_Row(r, stop_window=_stop_window(r.stop)) for r in requests]
        self._decode(rows, logits, cache, positions, attn, kv_len, cancelled, static=static)
        seconds = time.perf_counter() - started
        return [
            self._result(row, seconds=seconds, batch_size=len(rows), shared=s, reused=0)
            for row, s in zip(rows, shared_rows, strict=True)
        ]

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
        """
        import torch
        from transformers import StaticCache

        device = self.device
        logits: torch.Tensor | None = None
        parts: list[tuple[torch.Tensor, int, Any]] = []
        for rows in groups:
            width = max(len(requests[r].prompt_ids) for r in rows)
            ids, mask = _left_pad([requests[r].prompt_ids for r in rows], width, self._pad_id)
            small = StaticCache(config=self.model.config, max_cache_len=width)
            part = self._forward(ids, mask, small, device)
            index = torch.tensor(rows, dtype=torch.long, device=device)
            if logits is None:
                logits = part.new_empty((len(requests), part.shape[-1]))
            logits[index] = part
            parts.append((index, width, small))
        assert logits is not None
        for i, layer in enumerate(cache.layers):
            keys, values = parts[0][2].layers[i].keys, parts[0][2].layers[i].values
            batch = len(requests)
            layer.lazy_initialization(
                keys.new_empty((batch, keys.shape[1], 1, keys.shape[3])),
                values.new_empty((batch, values.shape[1], 1, values.shape[3])),
            )
            for index, width, small in parts:
                layer.keys[index, :, prompt_len - width : prompt_len] = small.layers[i].keys
                layer.values[index, :, prompt_len - width : prompt_len] = small.layers[i].values
            layer.cumulative_length.fill_(prompt_len)
        return logits

    def _forward(self, ids: list[list[int]], mask: list[list[int]], cache: Any, device: str) -> torch.Tensor:
        """Prefill a left-padded block; returns the last position's logits, shape (rows, vocab)."""
        import torch

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

    def _step(
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
        """
        if attn is not None and not static:
            attn = attn[:, :kv_len]
        out = self.model(
            input_ids=tokens,
            attention_mask=attn,
            position_ids=positions.unsqueeze(1),
            cache=cache,
            use_cache=True,
        )
        return out.logits[:, -1, :]

    # ------------------------------------------------------------------ the decode loop

    def _decode(
        self,
        rows: list[_Row],
        logits: torch.Tensor,
        cache: Any,
        positions: torch.Tensor,
        attn: torch.Tensor | None,
        kv_len: int,
        cancelled: threading.Event | None,
        *,
        static: bool,
    ) -> None:
        """Sample until every row is finished, dropping finished rows from the batch as they finish.

        ``positions`` holds each active row's position of the NEXT token to feed; ``attn`` is the full-length
        2-D mask (None when no row is padded); ``kv_len`` the KV length already in the cache.
        """
        import torch

        eos = self._eos_ids
        active = list(rows)
        sampler = Sampler([r.request for r in active], self.device)
        while True:
            chosen = sampler(logits)
            finished: list[int] = []
            for j, (row, token) in enumerate(zip(active, chosen.tolist(), strict=True)):
                row.tokens.append(token)
                if token in eos:
                    row.finish = "eos"
                elif row.stop_window and self._hit_stop(row):
                    row.finish = "stop"
                elif len(row.tokens) >= row.request.max_new_tokens:
                    row.finish = "length"
                if row.finish is not None:
                    finished.append(j)
            if len(finished) == len(active):
                return
            _raise_if_cancelled(cancelled)
            if finished:
                gone = set(finished)
                keep = [j for j in range(len(active)) if j not in gone]
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
            kv_len += 1
            logits = self._step(chosen.unsqueeze(1), positions, attn, cache, kv_len, static)
            positions = positions + 1

    def _hit_stop(self, row: _Row) -> bool:
        # Only the tail can hold a NEW match (older text was checked on earlier steps), so decode just that.
        tail = self.tokenizer.decode(row.tokens[-row.stop_window :], skip_special_tokens=True)
        return any(s in tail for s in row.request.stop)

    def _result(
        self, row: _Row, *, seconds: float, batch_size: int, shared: bool, reused: int
    ) -> GenerationResult:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        if row.finish == "stop":
            cuts = [i for i in (text.find(s) for s in row.request.stop) if i >= 0]
            if cuts:
                text = text[: min(cuts)]
        assert row.finish in _FINISH_REASONS
        return GenerationResult(
            token_ids=list(row.tokens),
            text=text,
            n_tokens=len(row.tokens),
            finish_reason=row.finish,
            prompt_tokens=len(row.request.prompt_ids),
            seconds=seconds,
            batch_size=batch_size,
            shared_prefill=shared,
            reused_prefix_tokens=reused,
        )

    # ------------------------------------------------------------------ KV reuse across turns

    def _generate_reusing(
        self, request: GenerationRequest, cancelled: threading.Event | None
    ) -> GenerationResult:
        """A single row on its reuse stream: prefill only what the stream's cache does not hold yet.

        The entry is taken OUT of the table while in use and put back only after success, so an error or a
        cancellation never leaves a half-updated cache behind.
        """
        import torch
        from transformers import DynamicCache

        started = time.perf_counter()
        prompt = list(request.prompt_ids)
        key = request.reuse_key
        entry = self._reuse.pop(key, None)
        cache: Any = None
        reused = 0
        if entry is not None:
            old_ids, old_cache = entry
            common = _common_prefix(old_ids, prompt)
            keep = min(common, len(prompt) - 1)  # at least one prompt token must be fed to get logits
            if keep > 0 and old_cache.get_seq_length() == len(old_ids):
                try:
                    if len(old_ids) > keep:
                        old_cache.crop(keep - len(old_ids))
                    cache, reused = old_cache, keep
                except (RuntimeError, ValueError):
                    cache = None  # e.g. a sliding-window layer past its window cannot roll back: start fresh
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        _raise_if_cancelled(cancelled)
        suffix = torch.tensor([prompt[reused:]], dtype=torch.long, device=self.device)
        positions = torch.arange(reused, len(prompt), dtype=torch.long, device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=suffix, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        row = _Row(request, stop_window=_stop_window(request.stop))
        start_pos = torch.tensor([len(prompt)], dtype=torch.long, device=self.device)
        self._decode(
            [row], out.logits[:, -1, :], cache, start_pos, None, len(prompt), cancelled, static=False
        )
        # The last sampled token was never fed, so the cache holds the prompt and all but the last token.
        self._reuse[key] = (prompt + row.tokens[:-1], cache)
        while len(self._reuse) > self.kv_reuse_capacity:
            self._reuse.popitem(last=False)
        seconds = time.perf_counter() - started
        return self._result(row, seconds=seconds, batch_size=1, shared=False, reused=reused)


def _left_pad(
    prompts: Sequence[Sequence[int]], width: int, pad_id: int
) -> tuple[list[list[int]], list[list[int]]]:
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


def _prefill_groups(lengths: list[int]) -> list[list[int]]:
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


def _plain_static(cache: Any) -> bool:
    """Whether every layer is a plain full-attention StaticLayer (whose storage layout we rely on)."""
    from transformers.cache_utils import StaticLayer

    return all(type(layer) is StaticLayer for layer in cache.layers)


def _stop_window(stops: tuple[str, ...]) -> int:
    """Trailing tokens that can hold a stop string: a byte-level token may carry a single byte of a char."""
    return 4 * max(len(s) for s in stops) + 4 if stops else 0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _raise_if_cancelled(cancelled: threading.Event | None) -> None:
    if cancelled is not None and cancelled.is_set():
        raise BatchCancelled("generation cancelled")
