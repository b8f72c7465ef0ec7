"""The API gateway: where every hosted-model call of a run goes, in the parent process only.

One :class:`Gateway` per run (or per event loop, for live use) holds one client per provider configuration,
each behind an :class:`AdaptiveLimiter` (max in flight), retries failed calls with backoff, and gathers
``batch`` requests into provider batches through a :class:`BatchCollector` per group. It is generic: a
participant hands it an :class:`APISpec` (picklable, no secret) that opens a :class:`ProviderClient` (the
SDK adapter, holding the key read from the environment) the first time it is needed, in the gateway's loop
(those protocols are the contract's, ``_contract``).

Seams for the scheduler (the wiring):

* ``JobContext.call_gateway(spec, request)`` -> ``gateway.call(spec, request, owner=ctx.job_id, blocker=...)``
  (``_run_jobs``); from a worker process the (spec, request) pair crosses the pipe and the result or error
  comes back. ``blocker`` tells the job's device batcher while a row waits on a provider batch.
* ``Gateway(store=ledger)``: batches are recorded in the run's ledger before polling; a rerun re-attaches a
  job to the row it recorded only when the job sends the same request now (``ProviderClient.request_hash``).
* ``Gateway(quiescent=probe)`` and :meth:`Gateway.poke`: a round is flushed when every live job is waiting
  on a batched call here (``gateway.batch_waiting >= live jobs``; a job in a device batcher or in a quick
  single call will still add to the round). The gateway pokes itself when a caller arrives; poke when the
  probe's other inputs change (a job ends). A device batcher counts its own jobs blocked on an API call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import anyio

from interlens.store import redacting_logger

from .._errors import SchedulerError
from ._collect import BatchBook, BatchCollector, Blocker
from ._contract import APISpec, BatchStore, ProviderCallError, ProviderClient
from ._limits import AdaptiveLimiter
from ._policies import Failure, RetryPolicy
from ._provider_batch import classify, describe_error
from ._spend import SpendGuard, SpendLimitReached

__all__ = ["Gateway"]

log = redacting_logger("interlens.gateway")  # a key echoed in an error is redacted


@dataclass
class _Lane:
    client: ProviderClient
    limiter: AdaptiveLimiter
    requests: int = 0
    retries: int = 0
    failures: int = 0


class Gateway:
    """All hosted-model calls of one run (or one event loop). Use as ``async with Gateway(...) as gw``.

    It starts no task: every call does its own work in its caller's task, so cancelling a job cancels
    exactly its own request (a batch submission in progress is shielded until it is recorded).
    """

    def __init__(
        self,
        *,
        store: BatchStore | None = None,
        quiescent: Callable[[], bool] | None = None,
        spend: SpendGuard | None = None,
    ) -> None:
        self._lanes: dict[Hashable, _Lane] = {}
        self._collectors: dict[Hashable, BatchCollector] = {}
        self._spend = spend
        self._book = BatchBook(store=store, spend=spend)
        self._quiescent = quiescent
        self._waiting = 0
        self._closed = False

    @property
    def waiting(self) -> int:
        """Callers blocked in the gateway right now (a job waiting on its API turn)."""
        return self._waiting

    @property
    def halted(self) -> bool:
        """The spend guard refused a request or a batch: the run should start no new job."""
        return self._spend is not None and self._spend.halted

    @property
    def batch_waiting(self) -> int:
        """Callers of batched specs blocked here (in a round, or on a submitted batch): the quiescence count.

        A caller stops counting the moment its row's outcome is delivered. Callers of single requests, or
        waiting to retry a row, are left out: they are back in a moment and may join a round then, so a
        round must not leave without them (a batch is slow; flushing a round of one is costly).
        """
        return self._book.blocked

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every client (their connection pools). Idempotent."""
        self._closed = True
        lanes, self._lanes = list(self._lanes.values()), {}
        self._collectors.clear()
        with anyio.CancelScope(shield=True):
            for lane in lanes:
                try:
                    await lane.client.aclose()
                except Exception as exc:  # a pool that fails to close must not hide the run's outcome
                    log.warning("closing a %s client failed: %s", lane.client.provider, exc)

    async def load_open_batches(self) -> int:
        """Read the store's in-flight batches so that jobs asking again re-attach; returns rows re-attachable.

        Called on the first batched call anyway; call it at run start to fail early on a broken store.
        """
        return await self._book.load_open()

    def poke(self) -> None:
        """The quiescence probe's inputs changed (a job blocked or ended): re-check pending rounds now."""
        for collector in self._collectors.values():
            collector.poke()

    def stats(self) -> dict[str, Any]:
        """Per client: limit, in flight, peak, lowest limit, rate-limited calls, retries; batch counts (rows
        re-attached after a crash, and rows refused because the job's request had changed)."""
        lanes = [
            {
                "provider": lane.client.provider,
                "max_in_flight": lane.limiter.max_in_flight,
                "limit": lane.limiter.limit,
                "lowest_limit": lane.limiter.lowest,
                "in_flight": lane.limiter.in_flight,
                "peak_in_flight": lane.limiter.peak,
                "rate_limited": lane.limiter.rate_limited,
                "requests": lane.requests,
                "retries": lane.retries,
                "failures": lane.failures,
            }
            for lane in self._lanes.values()
        ]
        return {
            "clients": lanes,
            "batches_submitted": self._book.submitted,
            "rows_reattached": self._book.reattached,
            "rows_refused": self._book.refused,  # recorded for a request that changed: sent again instead
        }

    def limiter(self, spec: APISpec) -> AdaptiveLimiter | None:
        """The limiter serving ``spec``'s client, if that client is open."""
        lane = self._lanes.get(spec.client_key)
        return None if lane is None else lane.limiter

    async def call(
        self,
        spec: APISpec,
        request: Any,
        *,
        owner: str | None = None,
        turn: int | None = None,
        blocker: Blocker | None = None,
    ) -> Any:
        """Send ``request`` for ``spec`` and return the adapter's result; raise :class:`ProviderCallError`.

        ``owner`` (the job id) and ``turn`` (default: ``request.turn``) name the request in the ledger's batch
        map, so that a rerun can re-attach to the batch carrying it. ``blocker`` is told while the request
        waits in a round or on a provider batch (the caller's device batcher stops waiting for it).
        """
        if self._closed:
            raise SchedulerError("this gateway is closed; API calls need a live run (or event loop)")
        if turn is None:
            turn = getattr(request, "turn", None)
        self._waiting += 1
        try:
            lane = self._lane(spec)
            if spec.batch_key is None:
                return await self._single(lane, spec.retry_policy, request)
            return await self._batched(lane, spec, request, owner, turn, blocker)
        finally:
            self._waiting -= 1

    def _lane(self, spec: APISpec) -> _Lane:
        key = spec.client_key
        lane = self._lanes.get(key)
        if lane is None:
            lane = _Lane(spec.open_client(), AdaptiveLimiter(spec.max_in_flight))
            self._lanes[key] = lane
        return lane

    async def _single(self, lane: _Lane, policy: RetryPolicy, request: Any) -> Any:
        attempt = 0
        while True:
            attempt += 1
            lane.requests += 1
            token = await lane.limiter.acquire()
            outcome: Any = "error"
            ticket = None
            try:
                if self._spend is not None:  # asked once the limiter lets it through: right before it goes
                    ticket = self._spend.admit([request], batch=False)
                    if ticket is None:
                        outcome = None
                        lane.requests -= 1  # never sent
                        raise SpendLimitReached(self._spend.refusal())
                result = await lane.client.send(request)
                outcome = "ok"
                if self._spend is not None:
                    self._spend.charge(request, result, batch=False)
                return result
            except SpendLimitReached:
                raise
            except Exception as exc:
                failure = lane.client.classify(exc)
                if failure.rate_limited:
                    outcome = "rate_limited"
                if not policy.should_retry(attempt, failure):
                    lane.failures += 1
                    raise _gave_up(lane.client.provider, exc, attempt, failure, policy) from exc
                delay = policy.delay(attempt, failure.retry_after)
                lane.retries += 1
                log.info(
                    "%s request failed (%s); attempt %d of %d, retrying in %.2f s",
                    lane.client.provider,
                    describe_error(exc),
                    attempt,
                    policy.max_attempts,
                    delay,
                )
            except BaseException:
                outcome = None  # cancelled: says nothing about the provider
                raise
            finally:
                lane.limiter.release(token, outcome)
                if ticket is not None and self._spend is not None:
                    self._spend.release(ticket)
            await anyio.sleep(delay)

    async def _batched(
        self,
        lane: _Lane,
        spec: APISpec,
        request: Any,
        owner: str | None,
        turn: int | None,
        blocker: Blocker | None,
    ) -> Any:
        client, policy, poll = lane.client, spec.retry_policy, spec.batch_policy
        await self._book.load_open()
        # No checkpoint from here until the row is in its round (or re-attached) and counted in
        # ``batch_waiting``, so the drivers woken here see it: it may complete another group's round.
        self.poke()
        row = self._book.claim(client, owner, turn, request, blocker)
        attempt = 0
        while True:
            attempt += 1
            try:
                if row is not None:  # re-attached: the batch is already paid for, wait for it
                    result = await self._book.collect(client, policy, poll, row)
                    row = None
                else:
                    collector = self._collector(lane, spec)
                    result = await collector.request(request, owner=owner, turn=turn, blocker=blocker)
                return result
            except SpendLimitReached:
                raise
            except Exception as exc:
                failure = classify(client, exc)
                if not policy.should_retry(attempt, failure):
                    raise _gave_up(client.provider, exc, attempt, failure, policy) from exc
                delay = policy.delay(attempt, failure.retry_after)
                log.info(
                    "%s batch row failed (%s); resubmitting in %.2f s",
                    client.provider,
                    describe_error(exc),
                    delay,
                )
            row = None
            await anyio.sleep(delay)

    def _collector(self, lane: _Lane, spec: APISpec) -> BatchCollector:
        key = spec.batch_key
        collector = self._collectors.get(key)
        if collector is None:
            collector = BatchCollector(
                book=self._book,
                client=lane.client,
                policy=spec.batch_policy,
                retry=spec.retry_policy,
                model=spec.model_id,
                quiescent=self._quiescent,
            )
            self._collectors[key] = collector
        return collector


def _gave_up(
    provider: str, exc: BaseException, attempts: int, failure: Failure, policy: RetryPolicy
) -> ProviderCallError:
    if not failure.retryable:
        why = "not retryable"
    elif attempts >= policy.max_attempts:
        why = f"gave up after {attempts} attempts"
    else:
        why = f"the provider asked to retry after {failure.retry_after} s, over max_retry_after_s"
    status = getattr(exc, "status_code", None)
    return ProviderCallError(
        f"{provider} call failed ({why}): {describe_error(exc)}",
        attempts,
        failure.retryable,
        status if isinstance(status, int) else None,
    )
