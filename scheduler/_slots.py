"""``Slots``: a worker's placement bookkeeping, written once for every kind of worker.

Placement (``_run_jobs``) sends a job to the least-loaded worker with a free slot; it needs each worker's
``capacity`` (how many jobs may be live on it at once) and ``load`` (how many are), and tells it when a job
is ``admit``-ted and when it ``leave``-s. The in-process worker, the process worker and (through it) the Ray
actor all count the same way, so they inherit this instead of spelling the four members again.
"""

from __future__ import annotations

__all__ = ["Slots"]


class Slots:
    """``capacity``, ``load``, ``admit`` and ``leave`` of a :class:`~._worker.Worker`.

    A subclass that must react when its load changes (the in-process worker wakes its batcher's quiescence
    check) overrides :meth:`_load_changed`.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._live = 0

    @property
    def capacity(self) -> int:
        """How many jobs may be live on this worker at once."""
        return self._capacity

    @property
    def load(self) -> int:
        """How many jobs are live on this worker now (admitted and not yet left)."""
        return self._live

    def admit(self) -> None:
        self._live += 1
        self._load_changed()

    def leave(self) -> None:
        self._live -= 1
        self._load_changed()

    def _load_changed(self) -> None:
        """Called after each ``admit``/``leave``; nothing by default."""
