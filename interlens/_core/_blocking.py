"""User code that may block (a sync analyzer, a scripted participant's callable), run where it cannot stall
the event loop, and time limits on what a job waits for.

Why not ``anyio.to_thread.run_sync``: its worker threads are not daemons and a task waiting on one cannot be
cancelled (unless abandoned), so one analyzer stuck in a ``wait()`` kept a run alive through two Ctrl-C and
kept the interpreter from exiting after. Here each call gets a daemon thread of its own; the awaiting task
waits on an event, so a Ctrl-C or a time limit stops the WAIT at once. The thread itself cannot be killed: it
is left to finish, or to end with the process.

The thread carries the caller's contextvars (the job's context, ambient ``TokenBudget``s) and the loop's
token, so the ``conv.sample(...)`` an analyzer calls goes back to THAT loop (:func:`run_in_loop`), where the
job's batcher and device live.

Time limits (``rollout(turn_timeout=..., analyzer_timeout=...)``) reach the turn loop and the analyzer through
:data:`TIME_LIMITS`, set by the rollout job around its work; live ``conv.run()`` has none.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["NO_TIME_LIMITS", "TIME_LIMITS", "TimeLimits", "call_blocking", "run_in_loop", "within"]

T = TypeVar("T")

_LOOP: contextvars.ContextVar[Any] = contextvars.ContextVar("interlens_blocking_loop", default=None)


@dataclass(frozen=True)
class TimeLimits:
    """Seconds a job waits for one turn and for its analyzer (None: no limit)."""

    turn: float | None = None
    analyzer: float | None = None


NO_TIME_LIMITS = TimeLimits()  # live runs, and a rollout without turn_timeout/analyzer_timeout
TIME_LIMITS: contextvars.ContextVar[TimeLimits] = contextvars.ContextVar(
    "interlens_time_limits",
    default=NO_TIME_LIMITS,
)


async def call_blocking(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a daemon thread (:data:`_POOL`); its exception (SystemExit too) is raised here.
    Cancelling the caller (Ctrl-C, :func:`within`'s limit) stops the wait at once; the thread runs on
    unobserved, and the pool starts another for the next call."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: list[tuple[bool, Any]] = []
    loop = _asyncio_loop()

    def target() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            outcome.append((False, exc))
        try:  # asyncio (what interlens runs on): a wake-up, without waiting for the loop to run it
            if loop is not None:
                loop.call_soon_threadsafe(done.set)
            else:
                anyio.from_thread.run_sync(done.set, token=token)
        except Exception:  # the loop is gone (the run stopped waiting long ago): nobody to tell
            pass

    context = contextvars.copy_context()
    context.run(_LOOP.set, token)
    _POOL.submit(functools.partial(context.run, target))
    await done.wait()
    ok, value = outcome[0]
    if ok:
        return value
    raise value


class _DaemonPool:
    """Daemon threads for user code, kept a while between calls (starting a thread per call tripled the
    cost of a scripted turn). A thread blocked forever is simply never idle again: the pool starts another,
    and the process can still exit (daemon threads are not joined at exit, unlike anyio's and
    ``concurrent.futures``')."""

    IDLE_S = 10.0  # an idle thread ends after this long

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Callable[[], None] | None]] = []

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(inbox,), name="interlens-user-code", daemon=True
            ).start()
        inbox.put(work)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            try:
                work = inbox.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody handed it work meanwhile: end
                        self._idle.remove(inbox)
                        return
                continue  # work is on its way: serve it
            if work is None:
                return
            work()
            with self._lock:
                self._idle.append(inbox)


_POOL = _DaemonPool()


def _asyncio_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # another anyio backend
        return None


def run_in_loop(fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """From a thread :func:`call_blocking` started (or one of anyio's): ``await fn(*args)`` on the loop that
    started it, blocking this thread until it is done."""
    return anyio.from_thread.run(fn, *args, token=_LOOP.get())


async def within(seconds: float | None, awaitable: Awaitable[T], *, timed_out: Callable[[], Exception]) -> T:
    """``await awaitable``, or raise ``timed_out()`` after ``seconds`` (None: wait as long as it takes)."""
    if seconds is None:
        return await awaitable
    with anyio.move_on_after(seconds) as scope:
        return await awaitable
    if scope.cancelled_caught:
        raise timed_out()
    raise AssertionError("unreachable: the block returned or was cancelled by its deadline")
