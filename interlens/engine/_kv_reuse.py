"""The reused-prefix batch path: a stream keeps its KV cache, so its next turn prefills only what is new.

A conversation's prompt grows turn by turn (the other speaker's answer, the template's headers), so
re-prefilling it from scratch each round is quadratic work: an 8-turn debate spends most of its prefill
re-encoding history. A row with a ``reuse_key`` keeps its KV after its turn (prompt + generated tokens but
the last, which was never fed), and the stream's next turn reuses the LONGEST COMMON TOKEN PREFIX of the kept
ids and the new prompt and prefills only the rest. Not "exact extension": decoded text need not re-encode to
the same ids (always so on random-weight models, often on real ones), and the common prefix still holds most
of the history (``../shared/notes/kv_reuse.md``, the measured prototype).

Co-stepped batches (the normal batched rollout) reuse too, rows with different kept lengths in ONE batch.
transformers keeps one length per cache, so the batch is laid out per row as
``[hole | kept prefix] [hole | new suffix] [generated ...]``: kept prefixes left-padded to the longest, ``U``,
suffixes left-padded after them, holes masked in the 2-D attention mask, positions from the mask's cumsum
(omitting them is silently wrong). A row without a usable kept cache (a new job, an evicted stream) joins
the same decode loop: if its prompt fits in the suffix region it is a suffix after a ``U``-long hole;
if longer, it is prefilled apart at its own width and its KV copied in next to the others, since widening
every row's suffix to it would cost more prefill than the kept prefixes save (measured:
``bench_long_debate.py --mixed``). A batch where nothing is reused takes the plain path (``_prefill``: static
cache, shared and grouped prefill) and only copies each row's KV out as it leaves. So does a batch whose
kept prefixes would save little (:meth:`ReusedPrefixBatch.reuse_pays`): the plain path prefills a prefix the
rows share once (a debate's system prompt, identical greedy rows), so a short kept prefix can save less than
the layout's copies, holes and wider cache cost.

Kept KV is copied out of the batch cache per row (its real slots only, gathered), so a stream's memory is its
own tokens. The kept caches live in the engine's ``_kept_kv.KeptKV`` store (an LRU bounded in streams and
bytes); this path takes a stream's entry out for its turn and keeps the new one after it.

Models with sliding-window layers (gemma2) cannot be laid out this way: a sliding layer keeps only its window
and its window is index-based, so it would count holes. Their batches prefill in full; a single row on its
stream still reuses its own ``DynamicCache`` (cropped to the common prefix; a crop past the window starts
fresh). Never in deterministic mode: a reused cache gives logits a few ulps off a fresh prefill.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._decode import ModelRunner, Row, left_pad, raise_if_cancelled, stop_window
from ._generation_types import GenerationRequest, GenerationResult
from ._kept_kv import Kept, KeptKV
from ._narrow_cache import narrowed_layer_type
from ._prefill import PlainBatch, padded_tokens, plain_static, prefill_groups

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    import torch

__all__ = ["REUSE_AT_MOST", "ReusedPrefixBatch", "common_prefix"]

#: A batch lays kept prefixes out only when its prefill then feeds at most this share of the token rows the
#: plain path would (measured: ``bench_long_debate.py --decision``).
REUSE_AT_MOST = 0.9


class ReusedPrefixBatch:
    """The reused-prefix batch path (see the module docstring): over the engine's runner, its plain batch
    path (for batches where nothing is reused, and for the batch caches) and its kept-KV store."""

    def __init__(self, runner: ModelRunner, *, plain: PlainBatch, kept: KeptKV) -> None:
        self.runner = runner
        self.plain = plain
        self.kept = kept
        #: Rows without a kept prefix, longer than the suffixes, prefilled apart (True) or joining the layout
        #: with a hole (False): the benchmark (``bench_long_debate.py --mixed``) compares the two.
        self.split_fresh_rows = True
        #: Lay kept prefixes out whenever any row has one (True), or only where that prefills well under
        #: what the plain path would (False, the default: :meth:`reuse_pays`). Tests and the benchmark
        #: (``bench_long_debate.py --decision``) force it to compare.
        self.always_reuse = False
        self._plain_kv: bool | None = None  # whether the model's cache layers can be laid out (checked once)

    def plain_kv_layers(self) -> bool:
        """Whether every layer of this model's cache is plain full attention (rows can be laid out)."""
        if self._plain_kv is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer

            layers = DynamicCache(config=self.runner.model.config).layers
            self._plain_kv = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
        return self._plain_kv

    def generate(
        self, requests: list[GenerationRequest], cancelled: threading.Event | None
    ) -> list[GenerationResult | Exception]:
        """A batched (non-deterministic) batch with at least one reuse stream: see the module docstring."""
        if not self.plain_kv_layers():
            if len(requests) == 1:
                return [self._generate_single_dynamic(requests[0], cancelled)]
            return self.plain.generate(requests, cancelled)
        started = time.perf_counter()
        entries = [self.kept.take(r.reuse_key) for r in requests]
        reused = [_usable(entry, r.prompt_ids) for entry, r in zip(entries, requests, strict=True)]
        if any(reused) and not self.always_reuse and not self.reuse_pays(requests, reused):
            reused = [0] * len(requests)  # prefilled in full; each row's new KV is still kept after
        collector = _Collector(self.kept.keep)
        if not any(reused):
            done = self.plain.prefill_and_decode(requests, cancelled, on_leave=collector)
            rows, shared = done.rows, done.shared_tokens
            del done
        else:
            # the batch cache's rows shortest suffix first: each length group of the suffixes' prefill is then
            # a range of them (``_prefill_kept``); the rows come back in the requests' order
            order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids) - reused[i])
            rows = self._decode_in_order(order, requests, entries, reused, cancelled, collector)
            shared = [0] * len(rows)
        del entries
        seconds = time.perf_counter() - started
        return [
            row.failure
            if row.failure is not None
            else self.runner.result(row, seconds=seconds, batch_size=len(rows), shared=s, reused=n)
            for row, s, n in zip(rows, shared, reused, strict=True)
        ]

    def reuse_pays(self, requests: list[GenerationRequest], reused: list[int]) -> bool:
        """Whether laying the kept prefixes out prefills well under the plain path (:data:`REUSE_AT_MOST` of
        its token rows). The plain path shares a long common prefix once (a debate's system prompt) and
        groups lengths, so a short kept prefix may save little; the layout then still costs its copies
        (every kept prefix into the batch cache), masked holes in every decode step and a cache as wide as
        the longest kept prefix plus the widest suffix."""
        prompts = [r.prompt_ids for r in requests]
        kept = [len(prompts[i]) - n for i, n in enumerate(reused) if n]  # the kept rows' suffixes
        fresh = [len(p) for p, n in zip(prompts, reused, strict=True) if not n]
        static = self.plain.batch_cache == "static"
        if fresh and self.split_fresh_rows and max(fresh) > max(kept) and static:
            laid = padded_tokens(kept, grouped=True) + len(fresh) * max(fresh)
        else:
            laid = padded_tokens([*kept, *fresh], grouped=static)
        return laid <= REUSE_AT_MOST * self.plain.prefill_tokens(prompts)

    def _decode_in_order(
        self,
        order: list[int],
        requests: list[GenerationRequest],
        entries: list[Kept | None],
        reused: list[int],
        cancelled: threading.Event | None,
        collector: _Collector,
    ) -> list[Row]:
        """:meth:`_decode_laid_out` over the requests taken in ``order`` (the batch cache's row order a
        layout needs), the rows given back in the requests' own order."""
        laid = self._decode_laid_out(
            [requests[i] for i in order],
            [entries[i] for i in order],
            [reused[i] for i in order],
            cancelled,
            collector,
        )
        return [row for _, row in sorted(zip(order, laid, strict=True), key=lambda pair: pair[0])]

    def _decode_laid_out(
        self,
        requests: list[GenerationRequest],
        entries: list[Kept | None],
        reused: list[int],
        cancelled: threading.Event | None,
        collector: _Collector,
    ) -> list[Row]:
        """Lay kept prefixes and new suffixes into one batch cache, prefill the suffixes, decode together.

        A row without a kept prefix that is no longer than the suffixes joins them (a hole where a kept
        prefix would be). A longer one would widen every row's suffix to its length, costing more prefill
        than the kept prefixes save, so with a static cache such rows are prefilled apart, left-padded at
        their own width as a plain batch would, and their KV copied into the batch cache next to the others.
        """
        import torch

        runner = self.runner
        device = runner.device
        batch = len(requests)
        prompts = [r.prompt_ids for r in requests]
        kept = [i for i in range(batch) if reused[i]]
        fresh = [i for i in range(batch) if not reused[i]]
        suffixes = [p[n:] for p, n in zip(prompts, reused, strict=True)]
        width = max(len(suffixes[i]) for i in kept)  # S: the suffix region's width
        fresh_width = max((len(prompts[i]) for i in fresh), default=0)
        split = self.split_fresh_rows and fresh_width > width and self.plain.batch_cache == "static"
        if split:
            end = max(max(reused) + width, fresh_width)
        else:
            width = max(width, fresh_width)
            end = max(reused) + width
        held = end - width  # U: the kept region's width (at least the longest kept prefix)
        max_new = max(r.sampling.max_new_tokens for r in requests)
        static_batch = self.plain.batch_cache == "static"
        pooled = runner.pool_layout(batch, end + max_new) if static_batch else None
        if pooled is not None and split and kept != list(range(len(kept))):
            # in the pool, the kept rows and the fresh ones are each one range of rows (one view each)
            return self._decode_in_order(kept + fresh, requests, entries, reused, cancelled, collector)
        if pooled is not None:  # a static batch: laid out straight into the engine's KV pool
            pool, length = pooled
            cache, static = pool.span(0, batch, length=length, width=end), True
        else:
            cache, static = self.plain.new_cache(end + max_new)
        if split and not (static and plain_static(cache)):  # no layout to copy into: join instead
            self.plain.batch_cache = "dynamic"
            return self._decode_laid_out(requests, entries, reused, cancelled, collector)
        together = kept if split else list(range(batch))
        slots: dict[int, list[int]] = {}  # where each row's prompt KV lies in the batch cache
        mask = [[0] * (end - len(p)) + [1] * len(p) for p in prompts]  # fresh rows, split: left-padded
        for i in together:
            n, s = reused[i], suffixes[i]
            mask[i] = [0] * (held - n) + [1] * n + [0] * (width - len(s)) + [1] * len(s)
            slots[i] = list(range(held - n, held)) + list(range(end - len(s), end))
        for i in fresh if split else []:
            slots[i] = list(range(end - len(prompts[i]), end))
        if split and pooled is not None:
            pool, length = pooled
            kept_view = pool.span(0, len(kept), length=length, width=end)
            kept_logits = self._prefill_kept(kept, kept_view, entries, reused, suffixes, mask, held, width)
            raise_if_cancelled(cancelled)
            ids, fresh_mask = left_pad([prompts[i] for i in fresh], fresh_width, runner.pad_id)
            fresh_view = pool.span(
                len(kept), batch, length=length, offset=end - fresh_width, width=fresh_width
            )
            fresh_logits = runner.forward(ids, fresh_mask, fresh_view)
            logits = torch.cat([kept_logits, fresh_logits.to(kept_logits.device)])
            for layer in cache.layers:
                layer.cumulative_length.fill_(end)
            del kept_view, fresh_view, kept_logits, fresh_logits
        elif split:
            from transformers import StaticCache

            part: Any = StaticCache(config=runner.model.config, max_cache_len=end)
            kept_logits = self._prefill_kept(kept, part, entries, reused, suffixes, mask, held, width)
            raise_if_cancelled(cancelled)
            ids, fresh_mask = left_pad([prompts[i] for i in fresh], fresh_width, runner.pad_id)
            small: Any = StaticCache(config=runner.model.config, max_cache_len=fresh_width)
            fresh_logits = runner.forward(ids, fresh_mask, small)
            logits = kept_logits.new_empty((batch, kept_logits.shape[-1]))
            logits[torch.tensor(kept, device=logits.device)] = kept_logits  # the LM head's device
            logits[torch.tensor(fresh, device=logits.device)] = fresh_logits
            _lay_into(cache, [(kept, part, 0), (fresh, small, end - fresh_width)], batch, end)
            del part, small, kept_logits, fresh_logits
        else:
            logits = self._prefill_kept(together, cache, entries, reused, suffixes, mask, held, width)
        mask_t = torch.tensor(mask, dtype=torch.long, device=device)
        full = torch.cat([mask_t, torch.ones(batch, max_new, dtype=torch.long, device=device)], dim=1)
        attn = None if bool(full.all()) else full
        rows = [
            Row(r, stop_window=stop_window(r.sampling.stop), prompt_slots=slots.get(i))
            for i, r in enumerate(requests)
        ]
        next_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        runner.decode(rows, logits, cache, next_pos, attn, end, cancelled, static=static, on_leave=collector)
        return rows

    def _prefill_kept(
        self,
        rows: list[int],
        cache: Any,
        entries: list[Kept | None],
        reused: list[int],
        suffixes: Sequence[Sequence[int]],
        mask: list[list[int]],
        held: int,
        width: int,
    ) -> torch.Tensor:
        """Write ``rows``' kept prefixes into ``cache`` (slots ``[U - n, U)``), then prefill their suffixes
        (slots ``[U + S - len, U + S)``); returns the last position's logits, one row per row.

        ``rows`` come in the cache's row order, shortest suffix first. Where the suffixes' lengths differ
        enough (``prefill_groups``: a debate's answers end at different lengths, and one left-padded block
        of them was a quarter padding), a static cache's suffixes are prefilled in length groups, each at its
        own width: a group is a range of the cache's rows, so it writes into the batch cache through views
        (:func:`_row_range`), with no copy."""
        import torch

        runner = self.runner
        donor = next(i for i in rows if reused[i])
        # a static cache whose storage is there already (the engine's KV pool): each kept prefix written
        # into its row directly, no batch-wide copy of them first
        direct = plain_static(cache) and all(layer.is_initialized for layer in cache.layers)
        for index, layer in enumerate(cache.layers):
            if direct:
                for at, i in enumerate(rows):
                    if reused[i]:
                        k, v = entries[i].kv[index]  # type: ignore[union-attr]
                        layer.keys[at, :, held - reused[i] : held] = k[:, : reused[i]]
                        layer.values[at, :, held - reused[i] : held] = v[:, : reused[i]]
                layer.cumulative_length.fill_(held)
                continue
            ref_k, ref_v = entries[donor].kv[index]  # type: ignore[union-attr]
            keys = ref_k.new_zeros((len(rows), ref_k.shape[0], held, ref_k.shape[2]))
            values = ref_v.new_zeros((len(rows), ref_v.shape[0], held, ref_v.shape[2]))
            for at, i in enumerate(rows):
                if reused[i]:
                    k, v = entries[i].kv[index]  # type: ignore[union-attr]
                    keys[at, :, held - reused[i] :] = k[:, : reused[i]]
                    values[at, :, held - reused[i] :] = v[:, : reused[i]]
            layer.update(keys, values)  # static: written at slots [0, U); dynamic: the first U slots
            del keys, values
        lengths = [len(suffixes[i]) for i in rows]
        groups = prefill_groups(lengths) if plain_static(cache) else []
        if len(groups) <= 1:
            return self._prefill_suffixes(rows, cache, suffixes, mask, held, width)
        parts = []
        for group in groups:
            start, stop = min(group), max(group) + 1
            assert group == list(range(start, stop)), "rows must come shortest suffix first"
            part = max(lengths[k] for k in group)  # the group's width; its block ends where the suffixes do
            offset = held + width - part
            view = _row_range(cache, start, stop, written=offset, config=runner.model.config)
            parts.append(self._prefill_suffixes(rows[start:stop], view, suffixes, mask, offset, part))
            del view
        for layer in cache.layers:
            layer.cumulative_length.fill_(held + width)
        return torch.cat([p.to(parts[0].device) for p in parts])

    def _prefill_suffixes(
        self,
        rows: list[int],
        cache: Any,
        suffixes: Sequence[Sequence[int]],
        mask: list[list[int]],
        offset: int,
        width: int,
    ) -> torch.Tensor:
        """Prefill ``rows``' suffixes, left-padded to ``width``, at slots ``[offset, offset + width)`` of
        ``cache`` (one row each, in its order), attending over the rows' masks; the last position's logits."""
        import torch

        ids = [[self.runner.pad_id] * (width - len(suffixes[i])) + list(suffixes[i]) for i in rows]
        spans = torch.tensor([mask[i][: offset + width] for i in rows], dtype=torch.long)
        return self.runner.forward_part(ids, spans, cache, offset)

    def _generate_single_dynamic(
        self, request: GenerationRequest, cancelled: threading.Event | None
    ) -> GenerationResult | Exception:
        """A single row on its stream of a model with sliding-window layers: its own ``DynamicCache``,
        cropped to the common prefix (a sliding layer past its window cannot crop: start fresh)."""
        import torch
        from transformers import DynamicCache

        runner = self.runner
        started = time.perf_counter()
        prompt = list(request.prompt_ids)
        key = request.reuse_key
        entry = self.kept.take(key)
        cache: Any = None
        reused = 0
        if entry is not None and not isinstance(entry.kv, list):
            old_ids, old_cache = entry.ids, entry.kv
            keep = min(common_prefix(old_ids, prompt), len(prompt) - 1)  # feed >= 1 token to get logits
            if keep > 0 and old_cache.get_seq_length() == len(old_ids):
                try:
                    if len(old_ids) > keep:
                        old_cache.crop(keep - len(old_ids))
                    cache, reused = old_cache, keep
                except (RuntimeError, ValueError):
                    cache = None  # e.g. a sliding-window layer past its window cannot roll back
        del entry
        if cache is None:
            cache = DynamicCache(config=runner.model.config)
        raise_if_cancelled(cancelled)
        suffix = torch.tensor([prompt[reused:]], dtype=torch.long, device=runner.device)
        positions = torch.arange(reused, len(prompt), dtype=torch.long, device=runner.device).unsqueeze(0)
        out = runner.model(
            input_ids=suffix, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        row = Row(request, stop_window=stop_window(request.sampling.stop))
        start_pos = torch.tensor([len(prompt)], dtype=torch.long, device=runner.device)
        runner.decode(
            [row], out.logits[:, -1, :], cache, start_pos, None, len(prompt), cancelled, static=False
        )
        if row.failure is not None:  # non-finite logits: its error, and no cache kept for the stream
            return row.failure
        if key is not None:
            nbytes = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
            self.kept.keep(key, Kept(prompt + row.tokens[:-1], cache, nbytes))
        seconds = time.perf_counter() - started
        return runner.result(row, seconds=seconds, batch_size=1, shared=0, reused=reused)


class _Collector:
    """The decode loop's ``on_leave``: copies each leaving row's real KV slots out for its stream.

    A row's prompt lies at its ``Row.prompt_slots`` (a laid-out batch, a shared prefix) or else at the
    ``len(prompt)`` slots before the first generated one; its generated tokens but the last follow from
    ``gen_start``. Finished rows that stayed in the batch were fed ignored tokens after their end: those
    slots are never copied.
    """

    def __init__(self, keep: Callable[[Hashable, Kept], None]) -> None:
        self._keep = keep

    def __call__(self, indices: list[int], rows: list[Row], cache: Any, gen_start: int) -> None:
        import torch
        from transformers.cache_utils import DynamicLayer, StaticLayer

        for j, row in zip(indices, rows, strict=True):
            key = row.request.reuse_key
            if key is None or row.failure is not None or not row.tokens:
                continue
            layers = cache.layers
            if not all(type(layer) in (StaticLayer, narrowed_layer_type(), DynamicLayer) for layer in layers):
                return
            prompt = list(row.request.prompt_ids)
            slots = (
                row.prompt_slots
                if row.prompt_slots is not None
                else list(range(gen_start - len(prompt), gen_start))
            ) + list(range(gen_start, gen_start + len(row.tokens) - 1))
            where = torch.tensor(slots, dtype=torch.long)
            on_device: dict[Any, torch.Tensor] = {}  # the slots on each layer's own device (a split model)
            kv = []
            for layer in layers:
                here = on_device.setdefault(layer.keys.device, where.to(layer.keys.device))
                kv.append((layer.keys[j].index_select(1, here), layer.values[j].index_select(1, here)))
            nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
            self._keep(key, Kept(prompt + row.tokens[:-1], kv, nbytes))


def _lay_into(cache: Any, parts: list[tuple[list[int], Any, int]], batch: int, end: int) -> None:
    """Copy each part's KV (rows ``index`` of the batch, from slot ``offset``) into a plain static batch
    cache, which then holds ``end`` slots."""
    import torch

    for at, layer in enumerate(cache.layers):
        for index, small, offset in parts:
            src = small.layers[at]
            if not layer.is_initialized:
                layer.lazy_initialization(
                    src.keys.new_empty((batch, src.keys.shape[1], 1, src.keys.shape[3])),
                    src.values.new_empty((batch, src.values.shape[1], 1, src.values.shape[3])),
                )
            rows = torch.tensor(index, dtype=torch.long, device=src.keys.device)
            width = src.keys.shape[2]
            layer.keys[rows, :, offset : offset + width] = src.keys
            layer.values[rows, :, offset : offset + width] = src.values
        layer.cumulative_length.fill_(end)


def _row_range(cache: Any, start: int, stop: int, *, written: int, config: Any) -> Any:
    """A static cache over rows ``[start, stop)`` of ``cache``'s storage, its first ``written`` slots
    counted as filled: its layers are views, so a forward through it writes straight into ``cache``. For
    caches of plain static layers only (``plain_static``)."""
    import torch
    from transformers import StaticCache

    view: Any = StaticCache(config=config, max_cache_len=cache.layers[0].max_cache_len)
    for mine, theirs in zip(view.layers, cache.layers, strict=True):
        mine.max_cache_len = theirs.max_cache_len
        mine.keys = theirs.keys[start:stop]
        mine.values = theirs.values[start:stop]
        mine.device = theirs.keys.device
        mine.cumulative_length = torch.tensor(written, dtype=torch.long, device=mine.device)
        mine.is_initialized = True
    return view


def _usable(entry: Kept | None, prompt: Sequence[int]) -> int:
    """How many prompt tokens a kept entry can give (at least one prompt token must be fed for logits)."""
    if entry is None or not isinstance(entry.kv, list):
        return 0
    return max(0, min(common_prefix(entry.ids, prompt), len(prompt) - 1))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
