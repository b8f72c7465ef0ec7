"""The plain batch path: one batch from scratch. Build its KV cache, prefill it well, then run the shared
decode loop (``_decode.ModelRunner.decode``).

Batching is where the throughput is (12-25x over one row at a time on CPU), and on CPU the prefill is most
of a short turn's cost, so this module is about prefilling a batch of heterogeneous rows cheaply:

* one left-padded batch (positions from the attention mask), prefilled once;
* identical prompts (n samples of one scenario) are prefilled ONCE and their KV cache expanded to the rows;
* rows that share a long token prefix (a data rollout: system block + shared context before the per-row
  field) prefill that prefix ONCE, then only their own suffixes (:meth:`PlainBatch.prefill_parts`: the
  layout);
* prompts of very different lengths are prefilled in length-sorted groups (less padding) and laid into one
  left-padded cache for a single decode loop.

A preallocated ``StaticCache`` is used for batches: a ``DynamicCache`` re-concatenates the whole KV every
step, which is up to a third of a decode step at batch 64 on CPU. An architecture without static cache
layers falls back to a ``DynamicCache`` (:attr:`PlainBatch.batch_cache` remembers it; tests and the benchmark
may set it to ``"dynamic"`` to compare). The reused-prefix path (``_kv_reuse``) builds its batch caches here
too, so a fallback found by either path holds for every batch of the engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._decode import ModelRunner, Row, left_pad, raise_if_cancelled, stop_window
from ._generation_types import GenerationRequest, GenerationResult
from ._narrow_cache import narrowed_layer_type, narrowed_static_cache
from ._pool_prefill import prefill_block, prefill_parts, prefill_twins

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from ._kv_pool import KVPool

__all__ = ["Decoded", "PlainBatch", "padded_tokens", "plain_static", "prefill_groups", "prefix_groups"]

#: A common prefix is prefilled once only when it is at least this many tokens and at least two rows share
#: it: below that, a second forward call (the prefix alone, then the suffixes) costs more than it saves.
MIN_SHARED_PREFIX = 32


@dataclass
class Decoded:
    """A finished batch: its rows and how they were prefilled (what ``ModelRunner.result`` records)."""

    rows: list[Row]
    shared_tokens: list[int]  # per row: leading prompt tokens prefilled once for several rows (0: none)
    started: float  # perf_counter when the batch began
    cache: Any  # the batch's KV cache after decoding (each row's last sampled token not fed)
    static: bool


class PlainBatch:
    """The plain batch path over one model runner (see the module docstring).

    ``shared_prefill``: identical prompts, and long prefixes several rows share, are prefilled once (False:
    every row is prefilled in the one left-padded block, or in length groups; tests and benchmarks compare).
    """

    def __init__(self, runner: ModelRunner, *, shared_prefill: bool = True) -> None:
        self.runner = runner
        self.shared_prefill = shared_prefill
        #: "static" (preallocated) or "dynamic": the kind of every batch cache; "dynamic" once the model
        #: turned out to have no static cache layers
        self.batch_cache = "static"

    def generate(
        self, requests: list[GenerationRequest], cancelled: threading.Event | None
    ) -> list[GenerationResult | Exception]:
        """One left-padded batch; identical prompts, and long prefixes several rows share, are prefilled
        once. A row whose logits went non-finite gets its ``GenerationError`` in place of a result."""
        done = self.prefill_and_decode(requests, cancelled)
        seconds = time.perf_counter() - done.started
        return [
            row.failure
            if row.failure is not None
            else self.runner.result(row, seconds=seconds, batch_size=len(done.rows), shared=shared, reused=0)
            for row, shared in zip(done.rows, done.shared_tokens, strict=True)
        ]

    def prefill_and_decode(
        self,
        requests: list[GenerationRequest],
        cancelled: threading.Event | None,
        *,
        on_leave: Callable[[list[int], list[Row], Any, int], None] | None = None,
    ) -> Decoded:
        """Prefill the batch (shared, grouped or in one block: see the module docstring) and decode it;
        ``on_leave`` as in :meth:`ModelRunner.decode` (the reused-prefix path keeps each row's KV)."""
        import torch

        runner = self.runner
        started = time.perf_counter()
        device = runner.device
        lengths = [len(r.prompt_ids) for r in requests]
        max_new = max(r.sampling.max_new_tokens for r in requests)
        unique: dict[tuple[int, ...], int] = {}
        row_to_unique = [unique.setdefault(r.prompt_ids, len(unique)) for r in requests]
        sharing = self.shared_prefill and len(requests) > 1
        shared = sharing and len(unique) < len(requests) and min(lengths) >= 2
        raise_if_cancelled(cancelled)
        prompt_len = max(lengths)
        pooled = (
            runner.pool_layout(len(requests), prompt_len + max_new) if self.batch_cache == "static" else None
        )
        if pooled is not None:  # a static batch: prefilled straight into the engine's KV pool
            return self._pooled(requests, pooled, sharing, shared, cancelled, on_leave, started)
        cache, static = self.new_cache(prompt_len + max_new)
        prefixes = prefix_groups([r.prompt_ids for r in requests]) if sharing and static else []
        if prefixes and not plain_static(cache):
            prefixes = []  # sliding-window layers count slots, and the shared layout has masked holes

        if prefixes:
            # Rows sharing a long prefix: the prefix once, then the suffixes; the other rows in length groups.
            grouped = {r for _, members in prefixes for r in members}
            rest = [r for r in range(len(requests)) if r not in grouped]
            parts = list(prefixes)
            if rest:
                for group in prefill_groups([lengths[r] for r in rest]):
                    parts.append((0, [rest[i] for i in group]))
            logits, mask = self.prefill_parts(requests, parts, cache, prompt_len)
            full_mask = torch.cat([mask, torch.ones(len(requests), max_new, dtype=torch.long)], dim=1)
            positions = torch.tensor(lengths, dtype=torch.long, device=device)
            attn = None if bool(full_mask.all()) else full_mask.to(device)
            kv_len = prompt_len
            shared_tokens = [0] * len(requests)
            for p, members in prefixes:
                for r in members:
                    shared_tokens[r] = p
        elif shared:
            # Prefill every distinct prompt minus its last token ONCE, copy the KV rows out to the batch rows,
            # then feed each row its last prompt token: the first decode step yields the first logits.
            # (Caching the whole prompt and feeding it again would duplicate the KV: pitfall 1 in the notes.)
            prompts = list(unique)
            prefix_len = prompt_len - 1
            ids, pad_mask = left_pad([p[:-1] for p in prompts], prefix_len, runner.pad_id)
            runner.forward(ids, pad_mask, cache)
            index = torch.tensor(row_to_unique, dtype=torch.long, device=device)
            cache.reorder_cache(index)  # index_select on the batch dim: U rows -> B rows
            row_mask = torch.tensor(pad_mask, dtype=torch.long)[torch.tensor(row_to_unique)]
            full_mask = torch.cat([row_mask, torch.ones(len(requests), 1 + max_new, dtype=torch.long)], dim=1)
            last = torch.tensor([[r.prompt_ids[-1]] for r in requests], dtype=torch.long, device=device)
            positions = torch.tensor(lengths, dtype=torch.long, device=device) - 1
            attn = None if bool(full_mask.all()) else full_mask.to(device)
            logits = runner.step(last, positions, attn, cache, prefix_len + 1, static)
            positions = positions + 1
            kv_len = prefix_len + 1
            counts: dict[int, int] = {}
            for u in row_to_unique:
                counts[u] = counts.get(u, 0) + 1
            shared_tokens = [lengths[i] - 1 if counts[u] > 1 else 0 for i, u in enumerate(row_to_unique)]
        else:
            ids, pad_mask = left_pad([r.prompt_ids for r in requests], prompt_len, runner.pad_id)
            groups = prefill_groups(lengths) if static else []
            if len(groups) > 1 and plain_static(cache):
                logits, _ = self.prefill_parts(requests, [(0, g) for g in groups], cache, prompt_len)
            else:
                logits = runner.forward(ids, pad_mask, cache)
            full_mask = torch.cat(
                [
                    torch.tensor(pad_mask, dtype=torch.long),
                    torch.ones(len(requests), max_new, dtype=torch.long),
                ],
                dim=1,
            )
            positions = torch.tensor(lengths, dtype=torch.long, device=device)
            attn = None if min(lengths) == prompt_len else full_mask.to(device)
            kv_len = prompt_len
            shared_tokens = [0] * len(requests)

        rows = [Row(r, stop_window=stop_window(r.sampling.stop)) for r in requests]
        if prefixes:  # holes between a shared prefix and a row's suffix: say where the prompt lies
            for row, row_mask in zip(rows, mask, strict=True):
                row.prompt_slots = row_mask.nonzero().flatten().tolist()
        runner.decode(
            rows, logits, cache, positions, attn, kv_len, cancelled, static=static, on_leave=on_leave
        )
        return Decoded(rows, shared_tokens, started, cache, static)

    def _pooled(
        self,
        requests: list[GenerationRequest],
        pooled: tuple[KVPool, int],
        sharing: bool,
        shared: bool,
        cancelled: threading.Event | None,
        on_leave: Callable[[list[int], list[Row], Any, int], None] | None,
        started: float,
    ) -> Decoded:
        """:meth:`prefill_and_decode`'s prefill choices, each written into the pool (``_pool_prefill``),
        then the decode; the rows come back in the requests' order."""
        pool, length = pooled
        prompts = [r.prompt_ids for r in requests]
        lengths = [len(p) for p in prompts]
        max_new = max(r.sampling.max_new_tokens for r in requests)
        # a shared prefix leaves holes before each suffix, which a sliding layer's window (counted in slots)
        # would count: models with sliding-window layers prefill every row whole, as the eager path does
        prefixes = prefix_groups(prompts) if sharing and pool.window is None else []
        shared_tokens = [0] * len(requests)
        if prefixes:
            grouped = {r for _, members in prefixes for r in members}
            rest = [r for r in range(len(requests)) if r not in grouped]
            parts = list(prefixes)
            if rest:
                parts += [(0, [rest[i] for i in g]) for g in prefill_groups([lengths[r] for r in rest])]
            done = prefill_parts(self.runner, pool, prompts, parts, length=length, max_new=max_new)
            for p, members in prefixes:
                for r in members:
                    shared_tokens[r] = p
        elif shared:
            unique: dict[tuple[int, ...], int] = {}
            to_unique = [unique.setdefault(p, len(unique)) for p in prompts]
            done = prefill_twins(self.runner, pool, prompts, to_unique, length=length, max_new=max_new)
            counts = [to_unique.count(u) for u in to_unique]
            shared_tokens = [n - 1 if c > 1 else 0 for n, c in zip(lengths, counts, strict=True)]
        elif len(groups := prefill_groups(lengths)) > 1:
            parts = [(0, g) for g in groups]
            done = prefill_parts(self.runner, pool, prompts, parts, length=length, max_new=max_new)
        else:
            done = prefill_block(self.runner, pool, prompts, length=length, max_new=max_new)
        rows = [
            Row(
                requests[r],
                stop_window=stop_window(requests[r].sampling.stop),
                prompt_slots=None if done.prompt_slots is None else done.prompt_slots[k],
            )
            for k, r in enumerate(done.order)
        ]
        cache = done.cache
        self.runner.decode(
            rows,
            done.logits,
            cache,
            done.positions,
            done.attn,
            done.kv_len,
            cancelled,
            static=True,
            on_leave=on_leave,
        )
        by_request = [rows[k] for k in sorted(range(len(rows)), key=done.order.__getitem__)]
        return Decoded(by_request, shared_tokens, started, cache, True)

    def prefill_tokens(self, prompts: list[tuple[int, ...]]) -> int:
        """The token rows this path would feed the model to prefill ``prompts`` (padding included, a shared
        prefix counted once): the reused-prefix path weighs its own layout against it. The cases are
        :meth:`prefill_and_decode`'s, in its order: long shared prefixes, else identical prompts (the
        distinct ones once, less their last token, then a step of every row), else length groups."""
        lengths = [len(p) for p in prompts]
        sharing = self.shared_prefill and len(prompts) > 1
        static = self.batch_cache == "static"
        prefixes = prefix_groups(prompts) if sharing and static else []
        if not prefixes and sharing and len(set(prompts)) < len(prompts) and min(lengths) >= 2:
            return len(set(prompts)) * (max(lengths) - 1) + len(prompts)
        grouped = {r for _, members in prefixes for r in members}
        rest = [lengths[r] for r in range(len(prompts)) if r not in grouped]
        tokens = sum(p + len(rows) * (max(lengths[r] for r in rows) - p) for p, rows in prefixes)
        return tokens + padded_tokens(rest, grouped=static)

    def new_cache(self, max_len: int) -> tuple[Any, bool]:
        """A cache for one batch, and whether it is static (preallocated to ``max_len``)."""
        from transformers import DynamicCache

        config = self.runner.model.config
        if self.batch_cache == "static":
            try:
                return narrowed_static_cache(config, max_len), True
            except (TypeError, ValueError, KeyError, NotImplementedError):
                self.batch_cache = "dynamic"  # an architecture without static cache layers
        return DynamicCache(config=config), False

    def prefill_parts(
        self,
        requests: list[GenerationRequest],
        parts: list[tuple[int, list[int]]],
        cache: Any,
        prompt_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the batch part by part into small caches, laying each into the batch cache; returns the
        last prompt position's logits (rows, vocab) and the batch's 2-D prompt mask (rows, ``prompt_len``).

        A part is ``(p, rows)``. With ``p == 0`` its rows are a length group: one left-padded block at the
        group's own width (one left-padded prefill of mixed lengths can be half padding, and on CPU the
        prefill is most of a turn's cost). With ``p > 0`` the rows share their first ``p`` tokens: those are
        prefilled ONCE (a batch of one), expanded to the rows, and then only each row's suffix is prefilled
        (positions ``p`` onward). The suffixes have different lengths and the prefix must stay where it is,
        so a part's layout is ``[prefix][masked hole][suffix]``, the suffix right-aligned; the causal mask is
        by slot and positions are explicit, so a hole is just masked padding. Each part's cache goes to the
        right end of the batch cache (``[pad][part]``), so every row's last prompt token sits at the same slot
        and the shared decode loop runs unchanged. Only for caches of plain static layers (a sliding window
        would count the hole's slots).

        Each part's small cache is copied into the batch cache as soon as it is filled and dropped before the
        next part runs: the batch cache plus ONE small cache is the peak, not the batch cache plus all.
        """
        import torch
        from transformers import StaticCache

        runner = self.runner
        device = runner.device
        batch = len(requests)
        logits: torch.Tensor | None = None
        mask = torch.zeros(batch, prompt_len, dtype=torch.long)
        for p, rows in parts:
            prompts = [requests[r].prompt_ids for r in rows]
            width = max(len(q) for q in prompts)
            small: Any = StaticCache(config=runner.model.config, max_cache_len=width)
            if p:
                runner.forward([list(prompts[0][:p])], [[1] * p], small)
                small.reorder_cache(torch.zeros(len(rows), dtype=torch.long, device=device))
            suffix_ids, suffix_mask = left_pad([q[p:] for q in prompts], width - p, runner.pad_id)
            part_mask = torch.tensor([[1] * p + m for m in suffix_mask], dtype=torch.long)
            part = runner.forward_part(suffix_ids, part_mask, small, p)
            # the row index on each tensor's own device: a model split over GPUs keeps each layer's KV, and
            # its logits, on the device of the layer that made them
            index = torch.tensor(rows, dtype=torch.long)
            on_device = {part.device: index.to(part.device)}
            if logits is None:
                logits = part.new_empty((batch, part.shape[-1]))
            logits[on_device[part.device]] = part
            mask[index, prompt_len - width :] = part_mask
            for layer, src in zip(cache.layers, small.layers, strict=True):
                if not layer.is_initialized:
                    layer.lazy_initialization(
                        src.keys.new_empty((batch, src.keys.shape[1], 1, src.keys.shape[3])),
                        src.values.new_empty((batch, src.values.shape[1], 1, src.values.shape[3])),
                    )
                here = on_device.setdefault(src.keys.device, index.to(src.keys.device))
                layer.keys[here, :, prompt_len - width : prompt_len] = src.keys
                layer.values[here, :, prompt_len - width : prompt_len] = src.values
            # Copied: drop this part's cache before the next part's is allocated (one alive at a time).
            del small, part, src
        assert logits is not None
        for layer in cache.layers:
            layer.cumulative_length.fill_(prompt_len)
        return logits, mask


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


def padded_tokens(lengths: list[int], *, grouped: bool) -> int:
    """The token rows a left-padded prefill of rows of these lengths feeds: in length groups
    (:func:`prefill_groups`) or as one block."""
    if not lengths:
        return 0
    groups = prefill_groups(lengths) if grouped else [list(range(len(lengths)))]
    return sum(len(group) * max(lengths[i] for i in group) for group in groups)


def plain_static(cache: Any) -> bool:
    """Whether every layer is a plain full-attention StaticLayer (whose storage layout we rely on)."""
    from transformers.cache_utils import StaticLayer

    return all(type(layer) in (StaticLayer, narrowed_layer_type()) for layer in cache.layers)


def prefix_groups(
    prompts: list[tuple[int, ...]], *, min_tokens: int = MIN_SHARED_PREFIX
) -> list[tuple[int, list[int]]]:
    """Rows worth prefilling a common prefix for: ``(prefix length, rows)`` per group, rows not in any group
    left out. A group has ≥ 2 rows and a prefix of ≥ ``min_tokens`` tokens, shorter than each of its prompts
    (every row keeps a suffix of at least one token, whose logits start its decoding).

    Prompts are sorted, so rows sharing a prefix are neighbours and a group's common prefix is its first
    and last prompts' one. A group grows greedily while that does not lower the tokens it saves, (rows − 1)
    × prefix; a row that shares more than twice the group's prefix with its next neighbour starts a group of
    its own with it (the two save more than the extra prefix forward costs).
    """

    def common(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
        n = 0
        while n < limit and a[n] == b[n]:
            n += 1
        return n

    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    groups: list[tuple[int, list[int]]] = []
    i = 0
    while i < len(order):
        first = prompts[order[i]]
        members, p = [order[i]], len(first) - 1
        for k in range(i + 1, len(order)):
            other = prompts[order[k]]
            q = common(first, other, min(p, len(other) - 1))
            if q < min_tokens or len(members) * q < (len(members) - 1) * p:
                break
            if len(members) > 1 and k + 1 < len(order):
                after = prompts[order[k + 1]]
                if common(other, after, min(len(other), len(after)) - 1) > 2 * q:
                    break
            members.append(order[k])
            p = q
        if len(members) >= 2 and p >= min_tokens:
            groups.append((p, sorted(members)))
        i += len(members)
    return groups
