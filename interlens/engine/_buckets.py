"""The shapes a captured decode step is built for: rows padded up to a row bucket, the attended length up to
a length bucket.

A CUDA graph (or a ``torch.compile`` frame) replays one set of shapes. A decode batch whose row count and
cache length changed every step (the engine's exact and 64-slot windows, ``_narrow_cache``) would need a
graph per step; padded to buckets, a step's shapes stay the same until a bucket edge, so a handful of graphs
serve every batch. The row buckets follow vLLM's capture sizes (1, 2, 4, 8, 16, then steps of 8, 16 and 32
rows: ~1.33-1.5x apart), so padding costs at most 1.5x rows above 4 rows (2x only at the smallest); the
length buckets are multiples of a quantum (256 slots: a step's attention over 256 unused slots is small next
to its weights' read on a GPU).

Pure arithmetic (no torch): the engine asks for a batch's buckets before it allocates anything.
"""

from __future__ import annotations

from .._core import ConfigurationError, check_int

__all__ = ["LENGTH_QUANTUM", "ROW_BUCKETS", "length_bucket", "row_bucket"]

#: The row counts a decode step is built for, ascending: a batch of ``n`` rows runs in the first >= n.
ROW_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

#: Length buckets are multiples of this many cache slots (tests pass a smaller ``quantum``).
LENGTH_QUANTUM = 256


def row_bucket(n: int, *, buckets: tuple[int, ...] = ROW_BUCKETS) -> int:
    """The smallest bucket of ``buckets`` (ascending) holding ``n`` rows (>= 1). A batch larger than the
    largest bucket is refused: the engine splits it first (its OOM splitter already cuts batches)."""
    check_int(n, what=f"row_bucket(n={n!r}): n", low=1, fix="the batch's number of rows, at least 1")
    for bucket in buckets:
        if bucket >= n:
            return bucket
    raise ConfigurationError(
        f"row_bucket(n={n}): n is more rows than the largest bucket ({buckets[-1]}); "
        f"split the batch into batches of at most {buckets[-1]} rows"
    )


def length_bucket(n: int, *, quantum: int = LENGTH_QUANTUM) -> int:
    """``n`` cache slots (>= 1) rounded up to a multiple of ``quantum`` (>= 1): the length a step's static
    cache and attention mask are built for."""
    check_int(quantum, what=f"length_bucket(quantum={quantum!r}): quantum", low=1, fix="e.g. 256")
    check_int(n, what=f"length_bucket(n={n!r}): n", low=1, fix="the slots a batch needs, at least 1")
    return -(-n // quantum) * quantum
