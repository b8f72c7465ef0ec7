"""The API gateway (installed as ``interlens.scheduler.gateway``): retries, in-flight limits and provider
batches for hosted-model calls, generic over the provider.

This ``__init__`` is the package's contract; its modules are private. A participant implements
:class:`APISpec` (picklable settings, no secret) whose ``open_client()`` builds a :class:`ProviderClient` (the
SDK adapter, :class:`BatchClient` being its batch half) that speaks in :class:`SubmittedBatch`,
:class:`BatchStatus`, :class:`BatchLimits` and :class:`Failure`; a run (or an event loop, for live use) holds
one :class:`Gateway`, tuned per spec by :class:`RetryPolicy` and :class:`BatchPolicy`. A call that fails for
good raises :class:`ProviderCallError`; a failed batch row is a :class:`BatchRowError` for its own caller.

Modules: ``_core`` (the contract's protocols, lanes, single and batched calls), ``_limits`` (adaptive limit,
retry policy, retry-after), ``_provider_batch`` (policy, rows, batches, the store protocol), ``_collect``
(rounds, submission recorded before polling, re-attach after a crash), ``_spend`` (the :class:`SpendGuard` a
run's API budget plugs in: asked before each request or batch is sent, told of each result; a refusal raises
:class:`SpendLimitReached` to the caller, whose job stays pending).
"""

from ._collect import Blocker
from ._core import APISpec, Gateway, ProviderCallError, ProviderClient
from ._limits import AdaptiveLimiter, Failure, RetryPolicy, retry_after_seconds
from ._provider_batch import (
    BatchClient,
    BatchLimits,
    BatchPolicy,
    BatchRowError,
    BatchStatus,
    BatchStore,
    SubmittedBatch,
)
from ._spend import SpendGuard, SpendLimitReached

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
