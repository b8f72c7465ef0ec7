"""The gateway of the running event loop, for API turns that no run's gateway serves.

Live use (``conv.run()``, ``sample()``, an analyzer) and rollouts whose job context offers no
``call_gateway`` route API turns here. SDK clients hold connection pools bound to the loop that opened them,
and ``conv.run()`` runs a fresh loop per call, so the gateway is per loop and closes its clients when the
loop shuts down: an async generator parked in the loop is finalized by ``loop.shutdown_asyncgens()`` (which
``asyncio.run`` and ``anyio.run`` call before closing the loop), and its ``finally`` closes the gateway.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from interlens.scheduler.gateway import Gateway

__all__ = ["loop_gateway"]


@dataclass
class _Entry:
    gateway: Gateway
    closer: AsyncIterator[None]  # held strongly: the loop only keeps a weak reference to async generators


_GATEWAYS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Entry] = weakref.WeakKeyDictionary()


async def _close_at_shutdown(gateway: Gateway) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await gateway.aclose()


async def loop_gateway() -> Gateway:
    """The running loop's gateway (created on first use; no ledger, default quiescence by idleness)."""
    loop = asyncio.get_running_loop()
    entry = _GATEWAYS.get(loop)
    if entry is None:
        gateway = Gateway()
        entry = _GATEWAYS[loop] = _Entry(gateway, _close_at_shutdown(gateway))
        await entry.closer.__anext__()  # registers it with the loop, which finalizes it at shutdown
    return entry.gateway
