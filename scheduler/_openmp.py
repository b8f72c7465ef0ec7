"""Give back the calling thread's OpenMP thread pool before CPU generation runs in another thread.

Why: PyTorch's CPU kernels run their parallel regions on GNU OpenMP (libgomp), and libgomp keeps a thread
pool per thread that ever started a parallel region. Once the caller's thread has run one (a notebook cell
that added two large tensors, a matmul in a script), its pool stays; libgomp then manages more threads than
the machine has CPUs and shortens how long idle threads spin, so every parallel region of the thread that
generates pays a futex wake-up. Measured (``benchmarks/bench_main_thread.py``): a decode-like loop in another
thread ran 15 % (2-core AMD EPYC) to 30 % (2-core Xeon) slower for the rest of the process. The OpenMP 5.0
call ``omp_pause_resource_all`` makes libgomp free the CALLING thread's pool (its threads exit; another
parallel region there builds a new one), which gives the generating thread its speed back.

So the thread that hands generation to a worker thread calls :func:`release_openmp_pool` first:
``run_in_thread`` (the event loop's thread, every in-process engine call) and ``run_sync`` (the caller's
thread, before it blocks on the helper thread's loop). Only libgomp is paused (the runtime measured; LLVM's
and Intel's runtimes pause process-wide); elsewhere, and before torch is imported, this does nothing.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["release_openmp_pool"]

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: soft pause (the runtime may keep what it can rebuild)
_LOOKUP = threading.Lock()
_LIBGOMPS: list[Any] | None = None  # every libgomp the process had loaded when first asked


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP thread pool, if torch has loaded libgomp; True when it did."""
    global _LIBGOMPS
    if "torch" not in sys.modules:
        return False  # nothing has run a parallel region through torch yet
    with _LOOKUP:
        if _LIBGOMPS is None:
            _LIBGOMPS = _loaded_libgomps()
    # each copy keeps its own pools (torch's wheels bundle one; numpy or a conda torch may use the system's)
    return bool(_LIBGOMPS) and all(lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0 for lib in _LIBGOMPS)


def _loaded_libgomps() -> list[Any]:
    """The copies of libgomp this process has loaded, as ctypes libraries."""
    import ctypes  # here: ``import interlens`` stays cheap

    maps = Path("/proc/self/maps")
    if not maps.exists():  # not Linux: macOS builds use LLVM's runtime
        return []
    paths = {fields[-1] for fields in map(str.split, maps.read_text().splitlines()) if len(fields) >= 6}
    found = []
    for path in sorted(p for p in paths if Path(p).name.startswith("libgomp")):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(library, "omp_pause_resource_all"):
            found.append(library)
    return found
