"""Which loaded engines the rest of a run can still need, so the others leave the devices.

Why: a sweep over several 7-8B models, one lineup each, must not pile them up on one GPU. Each lineup says
which engines its jobs use (``LineupSpec.engine_keys``); a lineup is finished once its jobs are all pulled
and every one of them has ended. An engine whose lineups are all finished, and that no lineup still to run
names, is evicted from every device worker (its engine cache drops it and calls its ``evict()``). A lineup
that does not say (``engine_keys=None``) keeps everything loaded while it remains, since its jobs may use
any engine. Nothing is evicted when the run has nothing left: the engines stay for the next run in this
process (a notebook re-running a rollout does not reload its model), and worker processes exit anyway.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ._protocols import LineupSpec

__all__ = ["EngineNeeds"]


class EngineNeeds:
    """Counts each lineup's jobs that are pulled and not ended; says which engines just became unneeded."""

    def __init__(self, lineups: Sequence[LineupSpec]) -> None:
        self._keys: dict[str, frozenset[Hashable] | None] = {}
        for lineup in lineups:
            keys = lineup.engine_keys
            self._keys[lineup.name] = None if keys is None else frozenset(keys)
        self._open = dict.fromkeys(self._keys, 0)
        self._exhausted: set[str] = set()
        self._finished: set[str] = set()
        self._evicted: set[Hashable] = set()

    def pulled(self, lineup: str) -> None:
        """A job of ``lineup`` was pulled (it will run)."""
        self._open[lineup] += 1

    def exhausted(self, lineup: str) -> frozenset[Hashable]:
        """Every job of ``lineup`` has been pulled; returns the engine keys to evict now."""
        self._exhausted.add(lineup)
        return self._settle(lineup)

    def ended(self, lineup: str) -> frozenset[Hashable]:
        """A pulled job of ``lineup`` ended; returns the engine keys to evict now."""
        self._open[lineup] -= 1
        return self._settle(lineup)

    def _settle(self, lineup: str) -> frozenset[Hashable]:
        if lineup not in self._exhausted or self._open[lineup] > 0 or lineup in self._finished:
            return frozenset()
        self._finished.add(lineup)
        remaining = [keys for name, keys in self._keys.items() if name not in self._finished]
        if not remaining:
            return frozenset()
        needed: set[Hashable] = set()
        for keys in remaining:
            if keys is None:
                return frozenset()
            needed |= keys
        done: set[Hashable] = set()
        for name in self._finished:  # an earlier lineup's engines too, kept while an unknown one remained
            done |= self._keys[name] or frozenset()
        evict = frozenset(done - needed - self._evicted)
        self._evicted |= evict
        return evict
