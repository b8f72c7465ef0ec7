"""How much one engine may take in one batch: a budget in tokens that adapts to out-of-memory errors.

Without it the batcher asks for up to ``max_batch_size`` rows every round; when prompts grow turn by turn,
every round can pay for failed prefills before the halving finds a size that fits. A :class:`BatchBudget`
is kept per engine and learns from what happened:

* a batch's cost is ``rows × max(prompt + max_new)`` over its rows (a left-padded batch), in tokens when the
  engine can count them (its optional ``request_tokens(payload)``), else one per row (a budget in rows);
* an out-of-memory error of a batch of several rows at cost ``C`` makes ``C`` a CEILING (no batch at or
  above it is tried again, not even the other half of a split batch: the batcher splits it further
  unasked) and shrinks the limit to the largest cost that has fit (or half of ``C`` when none has); each
  batch that then succeeds raises the limit to what it proved fits (below the ceiling). A single row that
  fails alone says nothing about batches (it may be that row), so it changes nothing, and neither does a
  failure at a cost that has fit before (a batch with a bad row in it, or a passing squeeze: the halving
  isolates it either way);
* a success at or above a ceiling disproves it (the failure was one bad row, not memory): the ceiling lifts
  to the next larger failed cost, or goes, and then nothing limits the engine but ``max_batch_size``;
* after ``grow_after`` successful batches in a row (each using at least half the limit) the limit grows
  half-way to the ceiling, and stops growing when it is within 1/16 of it: it converges on what fits in a
  few steps and never retries a size that failed, so later rounds stop re-hitting the error. A limit
  without a ceiling (a first estimate, e.g. from free device memory: the engine's optional
  ``token_budget()``) grows by a quarter instead, until an error sets a ceiling;
* a ceiling is not forever: memory taken by something else (a second worker on the same GPU, a neighbour's
  process, a transient peak) can make a size fail once that fits for the rest of the run. After
  ``probe_after`` full batches without an out-of-memory error, the ceilings are dropped and the limit grows by
  quarters again (probing upward); an error while probing sets the ceiling again and doubles the quiet spell
  before the next probe, so a ceiling that is real costs one failed batch per doubling spell.
"""

from __future__ import annotations

import bisect

__all__ = ["BatchBudget"]


class BatchBudget:
    """The adaptive per-engine batch budget (see the module docstring). ``limit`` None: no limit."""

    def __init__(self, *, grow_after: int = 4, limit: int | None = None, probe_after: int = 64) -> None:
        if grow_after < 1 or probe_after < 1:
            raise ValueError(
                f"BatchBudget(grow_after={grow_after}, probe_after={probe_after}): both must be >= 1"
            )
        self.grow_after = grow_after
        self.probe_after = probe_after
        self.limit = limit
        self._quiet = 0  # full batches since the last out-of-memory error
        self._probing = False  # the ceilings were dropped after a quiet spell and no error has come since
        self._failed: list[int] = []  # sorted costs of multi-row batches that ran out of memory
        self._streak = 0
        self._fit = 0  # the largest cost that succeeded (below the ceiling)
        self.ooms = 0  # multi-row out-of-memory errors seen (for logs and tests)

    @property
    def ceiling(self) -> int | None:
        """The smallest cost that ran out of memory and was not disproved (None: none)."""
        return self._failed[0] if self._failed else None

    def allows(self, cost: int) -> bool:
        """Whether a batch of ``cost`` may be tried (a batch of one row is always tried by the caller)."""
        ceiling = self.ceiling
        if ceiling is not None and cost >= ceiling:
            return False
        return self.limit is None or cost <= self.limit

    def failed(self, cost: int, *, rows: int) -> None:
        """A batch of ``rows`` rows and ``cost`` ran out of memory."""
        self._streak = 0
        if rows < 2 or cost <= self._fit:
            return
        self.ooms += 1
        self._quiet = 0
        if self._probing:  # the ceiling was real: wait twice as long before the next probe
            self._probing = False
            self.probe_after *= 2
        bisect.insort(self._failed, cost)
        shrunk = self._fit or max(1, cost // 2)
        self.limit = shrunk if self.limit is None else min(self.limit, shrunk)

    def succeeded(self, cost: int) -> None:
        """A batch of ``cost`` ran to the end."""
        self._fit = max(self._fit, cost)
        cut = bisect.bisect_right(self._failed, cost)
        if cut:  # the failures at or below this cost were not about memory
            del self._failed[:cut]
            if not self._failed:
                self.limit = None
                return
        if self.limit is not None and cost > self.limit:
            self.limit = cost  # proven to fit, and below the ceiling (or it would have been cut above)
        if self.limit is not None and 2 * cost < self.limit:
            return  # a small batch says nothing about whether a bigger limit would fit
        self._quiet += 1
        if self._failed and self._quiet >= self.probe_after:
            self._failed.clear()  # a quiet spell: the limit grows by quarters again (see the docstring)
            self._probing = True
            self._quiet = 0
        self._streak += 1
        if self._streak >= self.grow_after:
            self._streak = 0
            self._grow()

    def _grow(self) -> None:
        ceiling = self.ceiling
        if self.limit is None:
            return
        if ceiling is None:  # an estimate nothing has contradicted yet
            self.limit += max(1, self.limit // 4)
            return
        gap = ceiling - 1 - self.limit
        if gap > max(1, ceiling // 16):
            self.limit += (gap + 1) // 2
