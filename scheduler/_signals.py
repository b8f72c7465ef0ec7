"""A level-triggered "something changed" signal for loops that re-check a condition.

anyio's Event cannot be cleared, so each ``notify`` swaps in a fresh one: a waiter holding the old event
wakes, re-reads the state it cares about and waits on the new one. It never misses a change that happened
between its check and its wait, because it captured the event before checking.
"""

from __future__ import annotations

import anyio

__all__ = ["Notifier"]


class Notifier:
    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    def event(self) -> anyio.Event:
        """Capture this BEFORE checking the condition, then ``await event.wait()`` if it does not hold."""
        return self._event

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for the next notification (or ``timeout`` seconds); the caller re-checks its condition."""
        event = self._event
        with anyio.move_on_after(timeout):
            await event.wait()
