"""The gateway's contract: what a participant hands it (:class:`APISpec`), what a provider adapter is
(:class:`ProviderClient`, :class:`BatchClient` its batch half) and speaks in (:class:`SubmittedBatch`,
:class:`BatchStatus`, :class:`BatchLimits`), where batches are recorded (:class:`BatchStore`), and the two
errors a caller sees (:class:`ProviderCallError`, :class:`BatchRowError`).

Protocols, plain values and errors only, so ``interlens.providers`` implements it without loading the
gateway's machinery (``_core``, ``_collect``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._errors import SchedulerError
from ._policies import Failure

if TYPE_CHECKING:
    from ._policies import BatchPolicy, RetryPolicy

__all__ = [
    "APISpec",
    "BatchClient",
    "BatchLimits",
    "BatchRowError",
    "BatchStatus",
    "BatchStore",
    "ProviderCallError",
    "ProviderClient",
    "SubmittedBatch",
]


@dataclass(frozen=True)
class BatchLimits:
    """A provider's ceiling for one batch: requests, and bytes of the serialized requests."""

    max_requests: int
    max_bytes: int


@dataclass(frozen=True)
class SubmittedBatch:
    """What an adapter returns for a batch the provider accepted. ``meta`` is JSON, never a credential."""

    batch_id: str
    state: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchStatus:
    """One poll: the provider's state name, and whether results can be fetched now."""

    state: str
    done: bool


class BatchRowError(Exception):
    """One row of a provider batch failed, or the whole batch did: raised to that row's caller only.

    ``retryable`` rows (expired, rate limited, a server error) go into a later batch, per the retry policy.
    """

    def __init__(self, message: str, retryable: bool = False, rate_limited: bool = False) -> None:
        super().__init__(message, retryable, rate_limited)  # all in args: pickles across a worker pipe

    @property
    def failure(self) -> Failure:
        return Failure(retryable=bool(self.args[1]), rate_limited=bool(self.args[2]))

    def __str__(self) -> str:
        return str(self.args[0])


class BatchStore(Protocol):
    """Where batches are recorded: ``interlens.store.Ledger`` (its batch methods) satisfies this."""

    async def record_batch(self, batch: Any) -> None: ...

    async def update_batch(
        self, provider: str, batch_id: str, *, state: str, meta: Mapping[str, Any] | None = None
    ) -> None: ...

    async def open_batches(self) -> list[Any]: ...


class BatchClient(Protocol):
    """The batch half of a provider adapter (see :class:`ProviderClient`)."""

    provider: str
    batch_limits: BatchLimits

    def classify(self, exc: BaseException) -> Failure: ...

    def row_size(self, request: Any) -> int: ...

    def request_hash(self, request: Any) -> str: ...

    async def submit_batch(self, rows: Sequence[tuple[str, Any]]) -> SubmittedBatch: ...

    async def poll_batch(self, batch_id: str, meta: Mapping[str, Any]) -> BatchStatus: ...

    async def batch_results(
        self, batch_id: str, meta: Mapping[str, Any]
    ) -> Mapping[str, Any | BaseException]: ...


class ProviderCallError(SchedulerError):
    """A provider call failed for good: not retryable, or out of attempts. Fails its conversation only."""

    def __init__(
        self, message: str, attempts: int = 1, retryable: bool = False, status: int | None = None
    ) -> None:
        super().__init__(message, attempts, retryable, status)  # all in args: pickles across a worker pipe

    @property
    def attempts(self) -> int:
        return int(self.args[1])

    @property
    def status(self) -> int | None:
        """The HTTP status of the last attempt's answer (None: no answer, a connection error)."""
        return self.args[3] if len(self.args) > 3 else None

    def __str__(self) -> str:
        return str(self.args[0])


@runtime_checkable
class ProviderClient(Protocol):
    """An SDK adapter, opened once per client key in the gateway's event loop; it may hold the API key."""

    provider: str
    batch_limits: BatchLimits

    async def send(self, request: Any) -> Any:
        """One request, one attempt (the SDK's own retries are off); raise on failure."""
        ...

    def classify(self, exc: BaseException) -> Failure:
        """How the gateway should treat ``exc`` (retry? rate limited? retry-after?)."""
        ...

    def row_size(self, request: Any) -> int:
        """Bytes ``request`` adds to a batch (for splitting at the provider's limit)."""
        ...

    def request_hash(self, request: Any) -> str:
        """A stable hash of ``request`` exactly as a batch row sends it (endpoint and full body, never a
        credential): a rerun re-attaches a job to a recorded row only when the hashes are equal."""
        ...

    async def submit_batch(self, rows: Sequence[tuple[str, Any]]) -> SubmittedBatch: ...

    async def poll_batch(self, batch_id: str, meta: Mapping[str, Any]) -> BatchStatus: ...

    async def batch_results(
        self, batch_id: str, meta: Mapping[str, Any]
    ) -> Mapping[str, Any | BaseException]:
        """Every row's result by custom id, or an Exception in its place (a :class:`BatchRowError` says
        whether to retry); a ``"*"`` entry answers every row without its own (a batch that failed whole)."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class APISpec(Protocol):
    """What a participant hands the gateway: picklable settings, never a secret."""

    @property
    def client_key(self) -> Hashable:
        """Specs with equal keys share one client and one in-flight limit (e.g. provider, endpoint, limit)."""
        ...

    @property
    def max_in_flight(self) -> int: ...

    @property
    def retry_policy(self) -> RetryPolicy: ...

    @property
    def batch_key(self) -> Hashable | None:
        """None: concurrent single requests. Else the group whose requests share provider batches."""
        ...

    @property
    def batch_policy(self) -> BatchPolicy: ...

    @property
    def model_id(self) -> str: ...

    def open_client(self) -> ProviderClient:
        """Build the SDK adapter (reads the key from the environment; a clear error when it is unset)."""
        ...
