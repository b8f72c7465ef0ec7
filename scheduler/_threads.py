"""Blocking work (a generate, a model load) in a thread, without making the event loop deaf to Ctrl-C.

Two things go wrong with a bare ``await anyio.to_thread.run_sync(...)``:

- The thread cannot be killed. If we are cancelled, a generate keeps the device busy behind our back. So the
  caller may pass a ``cancelled`` event: it is set the moment we are cancelled, and a cooperative engine
  polls it every decode step and stops.
- While every task waits on threads the loop sleeps in ``select`` with no timeout. A SIGINT that the kernel
  hands to one of those threads (any thread may receive it) only sets a flag; Python runs its handler when
  the main thread next executes bytecode, i.e. when the generate ends. A heartbeat wakes the loop a few times
  a second so Ctrl-C is acted on within a fraction of a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio

from ._openmp import release_openmp_pool

__all__ = ["HEARTBEAT_S", "run_in_thread"]

T = TypeVar("T")

#: How often the loop wakes while only threads are working (the worst-case Ctrl-C latency).
HEARTBEAT_S = 0.2


async def run_in_thread(
    fn: Callable[[], T],
    *,
    limiter: anyio.CapacityLimiter,
    cancelled: threading.Event | None = None,
    abandon_on_cancel: bool = False,
) -> T:
    """``fn()`` in a worker thread; exceptions are raised as they are (never in an ExceptionGroup). This
    thread's OpenMP pool is given back first (``_openmp``: it would slow ``fn``'s parallel regions)."""
    release_openmp_pool()
    result: list[T] = []
    error: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_heartbeat, cancelled)
        try:
            result.append(
                await anyio.to_thread.run_sync(fn, limiter=limiter, abandon_on_cancel=abandon_on_cancel)
            )
        except Exception as exc:  # raised after the task group, so it is not wrapped
            error.append(exc)
        tg.cancel_scope.cancel()
    if error:
        raise error[0]
    return result[0]


async def _heartbeat(cancelled: threading.Event | None) -> None:
    try:
        while True:
            await anyio.sleep(HEARTBEAT_S)
    finally:  # cancelled: either the work is done (harmless) or we are, and the engine must stop
        if cancelled is not None:
            cancelled.set()
