"""The spend guard's seam: the gateway asks before it sends, and reports what came back.

A hosted request costs money when it is sent (a provider batch when it is submitted), so the gateway is
where a run's API budget is enforced: it asks its :class:`SpendGuard` right before each single request goes
out (after the in-flight limiter let it through, so requests queued behind the limit are asked when their
turn comes) and before each provider batch is submitted, and reports every result that came back. What a
request or a result costs is the guard's business (interlens prices them; the gateway is generic).

A refused request is not an error of its job: the caller gets :class:`SpendLimitReached`, which the run
reads as "this job cannot continue now" and leaves the job pending, and the run starts no new job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .._errors import SchedulerError

__all__ = ["SpendGuard", "SpendLimitReached"]


class SpendLimitReached(SchedulerError):
    """A request or batch was not sent: the run's API budget is reached. Its job stays pending."""


@runtime_checkable
class SpendGuard(Protocol):
    """A run's API budget, as the gateway sees it."""

    @property
    def halted(self) -> bool:
        """True once a request or batch was refused: the run starts no new job."""
        ...

    def admit(self, requests: Sequence[Any], *, batch: bool) -> Any:
        """A ticket (anything but None) when ``requests`` may be sent now (a batch: all of them, as one),
        reserving what they may cost until :meth:`release`; None when the budget does not allow it."""
        ...

    def release(self, ticket: Any) -> None:
        """Drop the reservation of an admitted submission (its results, if any, were charged)."""
        ...

    def charge(self, request: Any, result: Any, *, batch: bool) -> None:
        """``request`` was answered with ``result``: count what it cost."""
        ...

    def refusal(self) -> str:
        """Why the guard refuses: what was spent, the budget, how to continue."""
        ...
