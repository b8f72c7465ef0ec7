"""The API gateway (installed as ``interlens.scheduler.gateway``): retries, in-flight limits and provider
batches for hosted-model calls, generic over the provider.

This ``__init__`` is the package's contract; its modules are private. A participant implements
:class:`APISpec` (picklable settings, no secret) whose ``open_client()`` builds a :class:`ProviderClient` (the
SDK adapter, :class:`BatchClient` being its batch half) that speaks in :class:`SubmittedBatch`,
:class:`BatchStatus`, :class:`BatchLimits` and :class:`Failure`; a run (or an event loop, for live use) holds
one :class:`Gateway`, tuned per spec by :class:`RetryPolicy` and :class:`BatchPolicy`. A call that fails for
good raises :class:`ProviderCallError`; a failed batch row is a :class:`BatchRowError` for its own caller.

Modules: ``_contract`` (the protocols, the values an adapter returns, the two errors), ``_policies`` (the
failure an adapter reads, retry and batch policies, retry-after: plain values), ``_core`` (the gateway: lanes,
single and batched calls), ``_limits`` (the adaptive limit), ``_provider_batch`` (rows, batches), ``_collect``
(rounds, submission recorded before polling, re-attach after a crash), ``_spend`` (the :class:`SpendGuard` a
run's API budget plugs in: asked before each request or batch is sent, told of each result; a refusal raises
:class:`SpendLimitReached` to the caller, whose job stays pending).

The face is lazy (PEP 562): a name loads its module on first use and is kept here, so a provider adapter
(``interlens.providers``) loads ``_contract`` and ``_policies`` alone, not the gateway's machinery.
"""

from __future__ import annotations

import typing

from .._lazy import lazy_face as _lazy_face

if typing.TYPE_CHECKING:
    from ._collect import Blocker
    from ._contract import (
        APISpec,
        BatchClient,
        BatchLimits,
        BatchRowError,
        BatchStatus,
        BatchStore,
        ProviderCallError,
        ProviderClient,
        SubmittedBatch,
    )
    from ._core import Gateway
    from ._limits import AdaptiveLimiter
    from ._policies import BatchPolicy, Failure, RetryPolicy, retry_after_seconds
    from ._spend import SpendGuard, SpendLimitReached

#: Each exported name -> the private module that defines it.
_EXPORTS: dict[str, str] = {
    "Blocker": "._collect",
    "APISpec": "._contract",
    "BatchClient": "._contract",
    "BatchLimits": "._contract",
    "BatchRowError": "._contract",
    "BatchStatus": "._contract",
    "BatchStore": "._contract",
    "ProviderCallError": "._contract",
    "ProviderClient": "._contract",
    "SubmittedBatch": "._contract",
    "Gateway": "._core",
    "AdaptiveLimiter": "._limits",
    "BatchPolicy": "._policies",
    "Failure": "._policies",
    "RetryPolicy": "._policies",
    "retry_after_seconds": "._policies",
    "SpendGuard": "._spend",
    "SpendLimitReached": "._spend",
}

__all__ = [
    "APISpec",
    "AdaptiveLimiter",
    "BatchClient",
    "BatchLimits",
    "BatchPolicy",
    "BatchRowError",
    "BatchStatus",
    "BatchStore",
    "Blocker",
    "Failure",
    "Gateway",
    "ProviderCallError",
    "ProviderClient",
    "RetryPolicy",
    "SpendGuard",
    "SpendLimitReached",
    "SubmittedBatch",
    "retry_after_seconds",
]


__getattr__, __dir__ = _lazy_face(__name__, _EXPORTS)
