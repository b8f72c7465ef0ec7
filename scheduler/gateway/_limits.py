"""Bounded, adaptive concurrency for calls to hosted model providers (the retry policy: ``_policies``).

Why our own retry loop instead of the SDKs': retries hidden inside an SDK never reach the limiter that should
slow down when a provider says "too many requests". Provider clients are therefore built with the SDK's
retries off, and every failure comes back here: the limiter sees each rate-limit signal, and the wait before
the next attempt honours the provider's ``retry-after``.

Nothing here knows a provider: an adapter turns its SDK's exceptions into a ``Failure`` (``_policies``).
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import anyio

__all__ = ["AdaptiveLimiter"]

Outcome = Literal["ok", "rate_limited", "error"] | None


class _Waiter:
    __slots__ = ("epoch", "event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False
        self.epoch = 0


class AdaptiveLimiter:
    """At most ``limit`` calls in flight, FIFO; the limit adapts to rate limiting (AIMD).

    A rate-limited call halves the limit (``decrease``), but only once per *epoch*: calls already in flight
    when the limit dropped carry the old epoch, so a burst of 429s answering one wave of requests counts as
    one signal, not sixteen. Each successful call adds ``1/limit``, i.e. about one slot per window of
    successes, so the limit climbs back to ``max_in_flight`` once the provider stops objecting.
    """

    def __init__(self, max_in_flight: int, *, min_in_flight: int = 1, decrease: float = 0.5) -> None:
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if not isinstance(min_in_flight, int) or not 1 <= min_in_flight <= max_in_flight:
            raise ValueError(f"min_in_flight must be an int in [1, max_in_flight], got {min_in_flight!r}")
        if not 0 < decrease < 1:
            raise ValueError(f"decrease must be a factor in (0, 1), got {decrease!r}")
        self._max = max_in_flight
        self._min = min_in_flight
        self._decrease = decrease
        self._limit = float(max_in_flight)
        self._epoch = 0
        self._in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self.peak = 0
        """The most calls ever in flight at once."""
        self.lowest = max_in_flight
        """The lowest the limit has been."""
        self.rate_limited = 0
        """Calls that ended rate-limited."""

    @property
    def max_in_flight(self) -> int:
        return self._max

    @property
    def limit(self) -> int:
        """Calls allowed in flight right now."""
        return max(self._min, int(self._limit))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> int:
        """Wait for a slot; returns the epoch token to hand back to :meth:`release`."""
        if self._in_flight < self.limit and not self._waiters:
            self._take()
            return self._epoch
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:  # the slot was handed over just as we were cancelled: give it back
                self._in_flight -= 1
                self._grant()
            else:
                self._waiters.remove(waiter)
            raise
        return waiter.epoch  # the epoch when the slot was granted, i.e. when the call goes out

    def release(self, token: int, outcome: Outcome = None) -> None:
        """Free a slot. ``outcome`` "ok" grows the limit, "rate_limited" may shrink it, others neither."""
        self._in_flight -= 1
        if outcome == "ok":
            if self._limit < self._max:
                self._limit = min(float(self._max), self._limit + 1 / self._limit)
        elif outcome == "rate_limited":
            self.rate_limited += 1
            if token == self._epoch:
                self._limit = max(float(self._min), self._limit * self._decrease)
                self._epoch += 1
                self.lowest = min(self.lowest, self.limit)
        self._grant()

    def _take(self) -> None:
        self._in_flight += 1
        if self._in_flight > self.peak:
            self.peak = self._in_flight

    def _grant(self) -> None:
        while self._waiters and self._in_flight < self.limit:
            waiter = self._waiters.popleft()
            waiter.granted = True
            waiter.epoch = self._epoch
            self._take()
            waiter.event.set()

    def __repr__(self) -> str:
        return (
            f"AdaptiveLimiter(limit={self.limit}/{self._max}, in_flight={self._in_flight}, "
            f"waiting={len(self._waiters)})"
        )
