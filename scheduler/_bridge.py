"""``run_sync``: call an async API from synchronous code, including from inside a running event loop.

In a plain script there is no loop in this thread, so the coroutine runs with ``anyio.run`` (asyncio); Ctrl-C
cancels it, lets cleanup run (a batch stopped, the ledger closed), then raises KeyboardInterrupt.

Inside a running loop (Jupyter, an async app calling sync code) that loop cannot be re-entered and must not
be patched (no nest_asyncio), so a fresh loop runs on a helper thread while this thread blocks. Ctrl-C lands
in this thread: we cancel the helper's work, wait for its cleanup (a ledger closed, a batch stopped), then
re-raise. A second Ctrl-C during that wait stops waiting. The caller's contextvars are carried over, so
ambient settings (``with TokenBudget(...)``) reach the coroutine on either path.
"""

from __future__ import annotations

import asyncio
import contextvars
import signal
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, ParamSpec, TypeVar, cast

import anyio

from ._openmp import release_openmp_pool

__all__ = ["run_sync"]

P = ParamSpec("P")
T = TypeVar("T")


def run_sync(async_fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``await async_fn(*args, **kwargs)`` to completion and return its result (exceptions unchanged)."""
    if _loop_running():
        return _run_on_helper_thread(async_fn, args, kwargs)
    if not _owns_ctrl_c():
        return anyio.run(partial(_call, async_fn, args, kwargs))
    interrupted = threading.Event()
    result = anyio.run(partial(_call_interruptible, async_fn, args, kwargs, interrupted))
    if interrupted.is_set():
        raise KeyboardInterrupt
    return cast(T, result)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _call(async_fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    return await async_fn(*args, **kwargs)


def _owns_ctrl_c() -> bool:
    """Whether we may take over SIGINT: in the main thread, when nobody replaced Python's default handler."""
    return (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )


async def _call_interruptible(
    async_fn: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    interrupted: threading.Event,
) -> T | None:
    """Ctrl-C cancels the work, cleanup runs, then KeyboardInterrupt is raised; a second Ctrl-C aborts.

    asyncio's own SIGINT handling sets no wakeup fd, so when the signal lands on another thread (an engine
    generating in a worker thread) the loop sleeps on until something else wakes it, possibly for the whole
    generate. ``loop.add_signal_handler`` wakes the loop through its self-pipe whichever thread gets it.
    """
    loop = asyncio.get_running_loop()
    result: T | None = None
    with anyio.CancelScope() as scope:

        def on_ctrl_c() -> None:
            interrupted.set()
            scope.cancel()
            loop.remove_signal_handler(signal.SIGINT)  # restores default_int_handler: a 2nd Ctrl-C aborts

        loop.add_signal_handler(signal.SIGINT, on_ctrl_c)
        try:
            result = await async_fn(*args, **kwargs)
        finally:
            if not interrupted.is_set():
                loop.remove_signal_handler(signal.SIGINT)
    return result  # the caller raises KeyboardInterrupt, outside the loop, once it is closed


def _wait(event: threading.Event) -> None:
    while not event.wait(0.1):
        pass


class _Helper:
    """State shared between the blocked caller and the helper thread's loop."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.finished = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.scope: anyio.CancelScope | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def cancel(self) -> None:
        self.started.wait()
        loop, scope = self.loop, self.scope
        if loop is None or scope is None:
            return
        try:
            loop.call_soon_threadsafe(scope.cancel)
        except RuntimeError:  # the loop already closed: nothing left to cancel
            pass


def _run_on_helper_thread(
    async_fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> T:
    helper = _Helper()
    release_openmp_pool()  # this thread blocks from here on: its OpenMP pool would only slow the helper's

    async def main() -> None:
        helper.loop = asyncio.get_running_loop()
        with anyio.CancelScope() as scope:
            helper.scope = scope
            helper.started.set()
            helper.result = await async_fn(*args, **kwargs)

    def target() -> None:
        try:
            anyio.run(main)
        except BaseException as exc:  # handed to the caller's thread unchanged
            helper.error = exc
        finally:
            helper.started.set()
            helper.finished.set()

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name="interlens-run_sync", daemon=True)
    thread.start()
    # Wait on an Event, not thread.join(): on Python 3.11 a join() interrupted by Ctrl-C marks the thread
    # as stopped while it still runs (bpo-45274), so a second join() would return before the cleanup. Poll
    # with a timeout: a SIGINT delivered to another thread is only handled when this thread runs bytecode.
    try:
        _wait(helper.finished)
    except KeyboardInterrupt:
        helper.cancel()
        _wait(helper.finished)  # let the helper clean up; a second Ctrl-C abandons the wait
        raise
    if helper.error is not None:
        raise helper.error
    return helper.result
