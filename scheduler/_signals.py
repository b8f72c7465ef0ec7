"""A level-triggered "something changed" signal for loops that re-check a condition.

anyio's Event cannot be cleared, so each ``notify`` sets the current one and the next ``event()`` makes a
fresh one: a waiter holding the old event wakes, re-reads the state it cares about and waits on the new one.
It never misses a change that happened between its check and its wait, because it captured the event
before checking.
"""

from __future__ import annotations

import anyio

__all__ = ["Notifier"]


class Notifier:
    __slots__ = ("_event",)

    def __init__(self) -> None:
        # Created on demand: most notifications (a job starting or ending) have nobody waiting on them, and
        # an Event per notification is measurable in a run of a million short jobs.
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()

    def event(self) -> anyio.Event:
        """Capture this BEFORE checking the condition, then ``await event.wait()`` if it does not hold."""
        if self._event is None:
            self._event = anyio.Event()
        return self._event

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for the next notification (or ``timeout`` seconds); the caller re-checks its condition."""
        event = self.event()
        with anyio.move_on_after(timeout):
            await event.wait()
