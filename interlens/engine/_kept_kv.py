"""The kept-KV store: each reuse stream's KV cache between its turns, bounded in streams and in bytes.

A stream's next turn prefills only what is past the longest common prefix of its kept ids and its new
prompt (``_kv_reuse``), so the kept caches are worth keeping, but they are device memory the next batch may
need. The store is an LRU bounded by ``capacity`` streams and ``budget`` bytes (by default a quarter of the
device's free memory: CUDA ``mem_get_info``, CPU available RAM, measured when the first cache is kept);
whatever does not fit is evicted, least recently used first, and an evicted stream simply prefills in full
next time. An entry larger than the whole budget is not kept at all (it would evict everything and still
not fit).

An entry in use is TAKEN out of the store (:meth:`KeptKV.take`) and kept again only after its turn
succeeded, so an error or a cancellation never leaves a half-updated cache behind. Reading the store
(``key in store``, ``store[key]``, iteration in least- to most-recently-used order) changes nothing.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ._device_memory import usable_cuda_bytes

__all__ = ["BUDGET_SHARE", "Kept", "KeptKV", "default_kv_budget"]

#: The share of the device's free memory kept caches may hold by default.
BUDGET_SHARE = 0.25


@dataclass
class Kept:
    """One stream's kept KV: the ids it holds and, per layer, (keys, values) shaped [kv heads, tokens, dim]
    (or, on the single-row sliding-window path, the row's own ``DynamicCache``)."""

    ids: list[int]
    kv: Any
    nbytes: int


class KeptKV(Mapping[Hashable, Kept]):
    """The kept caches by reuse stream: an LRU bounded by ``capacity`` streams and ``budget`` bytes.

    ``budget`` None: :data:`BUDGET_SHARE` of the device's free memory, measured on the first :meth:`keep`
    (not at construction: the model's own weights are on the device by then). ``capacity`` or ``budget`` 0
    turns reuse off (:attr:`enabled`). Not thread-safe: the engine's lock guards it.
    """

    def __init__(self, *, capacity: int, budget: int | None, device: str) -> None:
        self.capacity = capacity
        self.budget = budget
        self.device = device
        self._entries: OrderedDict[Hashable, Kept] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._limit: int | None = None  # the byte bound in force, once measured

    @property
    def enabled(self) -> bool:
        """Whether anything can be kept at all (neither bound is 0)."""
        return self.capacity > 0 and self.budget != 0

    def kept_bytes(self) -> int:
        """Bytes the kept caches hold now."""
        return self._bytes

    def byte_limit(self) -> int:
        """The byte bound: ``budget``, or the default measured now if not yet measured."""
        if self._limit is None:
            self._limit = self.budget if self.budget is not None else default_kv_budget(self.device)
        return self._limit

    # ------------------------------------------------------------------ changes

    def take(self, key: Hashable | None) -> Kept | None:
        """A stream's entry, taken OUT of the store while in use (None: no such stream, or ``key`` None):
        put it back with :meth:`keep` only after success."""
        entry = self._entries.pop(key, None) if key is not None else None
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry

    def keep(self, key: Hashable, entry: Kept) -> None:
        """Keep ``entry`` as the most recently used (replacing the stream's old one), evicting the least
        recently used while over either bound; an entry larger than the whole budget is dropped instead."""
        self.take(key)
        limit = self.byte_limit()
        if entry.nbytes > limit or self.capacity == 0:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while len(self._entries) > self.capacity or self._bytes > limit:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes

    def drop(self, key: Hashable) -> None:
        """Forget one stream's kept cache (nothing if it has none)."""
        self.take(key)

    def clear(self) -> None:
        """Forget every kept cache."""
        self._entries.clear()
        self._bytes = 0

    # ------------------------------------------------------------------ reading (changes no order)

    def __getitem__(self, key: Hashable) -> Kept:
        return self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"KeptKV({len(self)} streams, {self._bytes} bytes)"


def default_kv_budget(device: str) -> int:
    """``BUDGET_SHARE`` of the device's free memory, in bytes: CUDA's ``mem_get_info``, else available RAM
    (psutil if installed, else ``os.sysconf``; 1 GiB when neither can tell)."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():  # a group ("cuda:0,cuda:1") counts every member
            return int(usable_cuda_bytes(device) * BUDGET_SHARE)
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 4 << 30
    return int(available * BUDGET_SHARE)
