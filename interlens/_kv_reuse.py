"""KV reuse across turns: a stream keeps its KV cache, so its next turn prefills only what is new.

A conversation's prompt grows turn by turn by a suffix (the other speaker's answer, the template's headers),
so re-prefilling it from scratch each turn is quadratic work. A single-row request with a ``reuse_key`` keeps
its cache in a small LRU table (``kv_reuse_capacity`` streams) and the next turn of that stream crops the
cache to the common prefix and feeds the rest. Reuse streams use a ``DynamicCache``, because they must grow
past any preallocated length on the next turn. Never in deterministic mode: a reused cache gives logits a
few ulps off a fresh prefill.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from interlens._decode import ModelRunner, Row, raise_if_cancelled, stop_window
from interlens._generation_types import GenerationRequest, GenerationResult

__all__ = ["KVReuse", "common_prefix"]


class KVReuse(ModelRunner):
    """The reuse-stream path of ``LocalEngine``."""

    kv_reuse_capacity: int  # set by LocalEngine.__init__
    _reuse: OrderedDict[Hashable, tuple[list[int], Any]]

    def _generate_reusing(
        self, request: GenerationRequest, cancelled: threading.Event | None
    ) -> GenerationResult | Exception:
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
            common = common_prefix(old_ids, prompt)
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
        raise_if_cancelled(cancelled)
        suffix = torch.tensor([prompt[reused:]], dtype=torch.long, device=self.device)
        positions = torch.arange(reused, len(prompt), dtype=torch.long, device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=suffix, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        row = Row(request, stop_window=stop_window(request.stop))
        start_pos = torch.tensor([len(prompt)], dtype=torch.long, device=self.device)
        self._decode(
            [row], out.logits[:, -1, :], cache, start_pos, None, len(prompt), cancelled, static=False
        )
        if row.failure is not None:  # non-finite logits: its error, and no cache kept for the stream
            return row.failure
        # The last sampled token was never fed, so the cache holds the prompt and all but the last token.
        self._reuse[key] = (prompt + row.tokens[:-1], cache)
        while len(self._reuse) > self.kv_reuse_capacity:
            self._reuse.popitem(last=False)
        seconds = time.perf_counter() - started
        return self._result(row, seconds=seconds, batch_size=1, shared=False, reused=reused)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
