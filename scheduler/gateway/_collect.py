"""Provider batch rounds: many conversations' turns become ONE provider batch, which survives a crash.

A :class:`BatchCollector` gathers the requests of one group (one provider, model and parameters) and flushes
them as a batch when the round is complete: every live job is waiting (a quiescence probe the scheduler
provides), or ``idle_s`` passed without a new request (the default probe), or a size or time bound is hit.
A flush is split at the provider's limits (requests and bytes per batch).

A batch is paid for when it is submitted, so its id and the custom id -> (job, turn) map go to the store
BEFORE polling starts, and submission plus recording are shielded from cancellation. A rerun after a crash
calls :meth:`BatchBook.load_open` and the job asking again for that (job, turn) waits on the batch already in
flight instead of submitting it twice.

Re-attaching is safe only for the same question: each recorded row carries the hash of its request as sent
(``BatchClient.request_hash``: endpoint and full body), and a job is re-attached only when the request it
sends now has that hash. Otherwise (another prompt, model or parameter; or a row recorded without a hash, by
an older ledger) the job's request goes into a new round, as if nothing had been recorded, and the old row's
result is ignored, with a warning naming the batch. The old batch is not cancelled at the provider (it may
be done, and other rows of it may still be re-attached). Once every row of a loaded batch has been refused,
it is marked ``superseded`` in the store, at the next batch recorded, so later reruns neither poll nor
re-check it; a batch with rows nobody asked for stays open, as before.

There is no background task: the callers do the work. The first caller of a round drives the flush (and
hands that role on if it is cancelled); afterwards the callers of a batch take turns polling it under a lock,
so a cancelled poller is simply replaced by the next one. A row that errors or expires fails only its caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio

from interlens.store import redacting_logger

from .._signals import Notifier
from ._contract import BatchClient, BatchRowError, BatchStore
from ._policies import BatchPolicy, RetryPolicy
from ._provider_batch import Batch, Row, describe_error, retrying
from ._spend import SpendGuard, SpendLimitReached

__all__ = ["BatchBook", "BatchCollector", "Blocker"]

log = redacting_logger("interlens.gateway")  # a key echoed in an error is redacted


class Blocker(Protocol):
    """Told when a caller starts and stops waiting on a batch row (a device batcher's quiescence count).

    ``unblock`` comes when the row's outcome is delivered, in the same step for every row of a batch, so
    the first job to resume cannot make its batcher leave without the others."""

    def block(self) -> None: ...

    def unblock(self) -> None: ...


class BatchBook:
    """Submits, records, polls and re-attaches batches for every collector of one gateway."""

    def __init__(
        self,
        *,
        store: BatchStore | None,
        clock: Callable[[], float] = time.monotonic,
        spend: SpendGuard | None = None,
    ) -> None:
        self.store = store
        self.spend = spend
        self._tickets: dict[Batch, Any] = {}  # submitted batches' reservations with the spend guard
        self.clock = clock
        self.submitted = 0
        self.reattached = 0
        #: Callers whose row is in a round or a batch and not delivered yet (the gateway's quiescence count).
        self.blocked = 0
        #: Rows recorded for a (job, turn) whose request had changed: refused, their result ignored.
        self.refused = 0
        #: (job, turn) -> (loaded batch, custom id, the hash of the request recorded for it, or None)
        self._open: dict[tuple[str, int], tuple[Batch, str, str | None]] = {}
        self._refusals: dict[Batch, int] = {}  # loaded batch -> rows refused (or sent again later) so far
        self._superseded: list[Batch] = []  # loaded batches every row of which was refused: to mark
        self._loaded = store is None
        self._load_lock = anyio.Lock()

    async def load_open(self) -> int:
        """Read the store's open batches (once); returns how many rows a job asking again may re-attach to
        (each is checked against the job's request when it asks)."""
        async with self._load_lock:
            if not self._loaded and self.store is not None:
                for record in await self.store.open_batches():  # oldest first: a newer row for a turn wins
                    batch = Batch(record.provider, dict.fromkeys(record.requests), batch_id=record.batch_id)
                    batch.state, batch.meta = record.state, dict(record.meta)
                    batch.submitted.set()
                    hashes = getattr(record, "request_hashes", {})
                    for custom_id, (job, turn) in record.requests.items():
                        older = self._open.get((job, int(turn)))
                        if older is not None:  # sent again in a later batch (refused then): that one answers
                            self._drop(older[0])
                        self._open[(job, int(turn))] = (batch, custom_id, hashes.get(custom_id))
                self._loaded = True
        return len(self._open)

    def track(self, row: Row, blocker: Blocker | None = None) -> Row:
        """Count ``row``'s caller as blocked (here and to ``blocker``) until the row is resolved/released."""
        self.blocked += 1
        if blocker is not None:
            blocker.block()

        def untrack() -> None:
            self.blocked -= 1
            if blocker is not None:
                blocker.unblock()

        row.on_done = untrack
        return row

    def claim(
        self,
        client: BatchClient,
        owner: str | None,
        turn: int | None,
        request: Any,
        blocker: Blocker | None = None,
    ) -> Row | None:
        """A row attached to the open batch that already holds ``(owner, turn)`` for this very request, or
        None: nothing recorded, or recorded for another request (refused: the caller sends ``request``)."""
        if owner is None or turn is None or not self._open:
            return None
        entry = self._open.get((owner, turn))
        if entry is None or entry[0].provider != client.provider:
            return None
        del self._open[(owner, turn)]
        batch, custom_id, recorded = entry
        if recorded is None:
            self._refuse(
                batch, custom_id, owner, turn, "it was recorded without a request hash (an older ledger)"
            )
            return None
        if recorded != client.request_hash(request):
            self._refuse(batch, custom_id, owner, turn, "the request this job sends now is different")
            return None
        row = self.track(Row(request, owner, turn, 0), blocker)
        row.batch, row.custom_id = batch, custom_id
        batch.rows[custom_id] = row
        if batch.results is not None:
            row.resolve(batch.result_for(custom_id))
        self.reattached += 1
        log.info("%s batch %s re-attached for %s turn %d", client.provider, batch.batch_id, owner, turn)
        return row

    def _refuse(self, batch: Batch, custom_id: str, owner: str, turn: int, why: str) -> None:
        """Never deliver this recorded row: its result answers another question than the job asks now."""
        self.refused += 1
        log.warning(
            "%s batch %s row %s (%s turn %d) not re-attached: %s; the job's request is sent again and that "
            "row's result is ignored",
            batch.provider,
            batch.batch_id,
            custom_id,
            owner,
            turn,
            why,
        )
        self._drop(batch)

    def _drop(self, batch: Batch) -> None:
        """One more row of a loaded batch that nobody will wait on; when it was the last, supersede it."""
        dropped = self._refusals[batch] = self._refusals.get(batch, 0) + 1
        if dropped == len(batch.rows):
            self._superseded.append(batch)

    async def _mark_superseded(self) -> None:
        """Mark loaded batches whose every row was refused, so later reruns neither poll nor re-check them.

        Done after the next batch is recorded, in the shielded flush: ``claim`` must not yield (see
        ``Gateway._batched``). A crash before it leaves them open, and the next rerun refuses them again.
        """
        while self._superseded and self.store is not None:
            batch = self._superseded.pop()
            try:
                await self.store.update_batch(batch.provider, batch.batch_id, state="superseded")
            except Exception as exc:  # harmless: a later rerun refuses its rows again
                log.warning("could not mark %s batch %s superseded: %s", batch.provider, batch.batch_id, exc)
            else:
                log.info("%s batch %s superseded: every row was refused", batch.provider, batch.batch_id)

    async def submit(
        self, client: BatchClient, policy: RetryPolicy, poll: BatchPolicy, batch: Batch, model: str
    ) -> None:
        """Submit ``batch`` and record it; never raises (failures go to the batch's rows)."""
        rows = [(cid, row.request) for cid, row in batch.rows.items() if row is not None]
        try:
            if self.spend is not None:  # paid when submitted: a batch that would cross the budget stays home
                ticket = self.spend.admit([request for _, request in rows], batch=True)
                if ticket is None:
                    batch.fail(SpendLimitReached(self.spend.refusal()))
                    return
                self._tickets[batch] = ticket
            try:
                submitted = await retrying(
                    client, policy, "batch submission", lambda: client.submit_batch(rows)
                )
            except Exception as exc:  # retried as a whole already: its rows are not resubmitted one by one
                self._settle(batch, None)
                batch.fail(
                    BatchRowError(f"submitting an {client.provider} batch failed: {describe_error(exc)}")
                )
                return
            batch.batch_id, batch.state = submitted.batch_id, submitted.state
            batch.meta = {**submitted.meta, "model": model, "rows": len(rows)}
            batch.interval = poll.poll_initial_s  # a fresh batch is never done at once: wait before polling
            self.submitted += 1
            if self.store is not None:
                from interlens.store import BatchRecord

                rows_now = [(cid, row) for cid, row in batch.rows.items() if row is not None]
                requests = {
                    cid: (row.owner or "", -1 if row.turn is None else row.turn) for cid, row in rows_now
                }
                try:
                    hashes = {cid: client.request_hash(row.request) for cid, row in rows_now}
                    record = BatchRecord(
                        client.provider,
                        batch.batch_id,
                        batch.state,
                        requests,
                        batch.meta,
                        request_hashes=hashes,
                    )
                    await self.store.record_batch(record)
                except Exception as exc:
                    batch.fail(
                        BatchRowError(
                            f"{client.provider} batch {batch.batch_id} was submitted but could not be "
                            f"recorded ({type(exc).__name__}: {exc}); not polled, to avoid untracked charges"
                        )
                    )
                    return
            log.info(
                "%s batch %s submitted: %d rows of %s", client.provider, batch.batch_id, len(rows), model
            )
        finally:
            batch.submitted.set()
        await self._mark_superseded()

    async def collect(self, client: BatchClient, policy: RetryPolicy, poll: BatchPolicy, row: Row) -> Any:
        """Wait for ``row``'s result, polling its batch whenever no other caller is."""
        batch = row.batch
        assert batch is not None
        try:
            await batch.submitted.wait()
            while not row.done.is_set():
                async with batch.poll_lock:
                    if row.done.is_set():
                        break
                    await self._poll_once(client, policy, poll, batch)
        finally:
            row.release()  # cancelled: no longer waiting, though the row stays in its batch
        return row.outcome()

    async def _poll_once(
        self, client: BatchClient, policy: RetryPolicy, poll: BatchPolicy, batch: Batch
    ) -> None:
        if batch.interval:
            await anyio.sleep(batch.interval)
        try:
            status = await retrying(
                client, policy, "batch poll", lambda: client.poll_batch(batch.batch_id, batch.meta)
            )
            # Re-attached batches are polled at once (they may be done); then the interval grows.
            grown = poll.poll_initial_s if batch.interval is None else batch.interval * poll.poll_multiplier
            batch.interval = min(grown, poll.poll_max_s)
            if status.state != batch.state:
                batch.state = status.state
                if self.store is not None and not status.done:
                    await self.store.update_batch(client.provider, batch.batch_id, state=status.state)
            if not status.done:
                return
            results = await retrying(
                client, policy, "batch results", lambda: client.batch_results(batch.batch_id, batch.meta)
            )
        except Exception as exc:  # polling gave up: never resubmit (that pays twice); a rerun re-attaches
            batch.fail(
                BatchRowError(
                    f"lost track of {client.provider} batch {batch.batch_id} ({describe_error(exc)}); "
                    "it stays open in the ledger and a rerun re-attaches to it"
                )
            )
            return
        if self.store is not None:
            # Before any turn is committed from it: a crash from now on re-fetches, never resubmits.
            try:
                await self.store.update_batch(client.provider, batch.batch_id, state="collected")
            except Exception as exc:  # the results are in hand; a rerun would merely fetch them again
                log.warning("could not mark %s batch %s collected: %s", client.provider, batch.batch_id, exc)
        log.info("%s batch %s %s: %d results", client.provider, batch.batch_id, batch.state, len(results))
        batch.finish(results)
        self._settle(batch, results)

    def _settle(self, batch: Batch, results: Any) -> None:
        """Charge the spend guard for the rows answered, and drop the batch's reservation."""
        if self.spend is None:
            return
        if results is not None:
            for custom_id, row in batch.rows.items():
                outcome = batch.result_for(custom_id)
                if row is not None and not isinstance(outcome, BaseException):
                    self.spend.charge(row.request, outcome, batch=True)
        ticket = self._tickets.pop(batch, None)
        if ticket is not None:
            self.spend.release(ticket)


class BatchCollector:
    """Gathers one group's requests into rounds and flushes each round as provider batches."""

    def __init__(
        self,
        *,
        book: BatchBook,
        client: BatchClient,
        policy: BatchPolicy,
        retry: RetryPolicy,
        model: str,
        quiescent: Callable[[], bool] | None,
    ) -> None:
        self._book = book
        self._client = client
        self._policy = policy
        self._retry = retry
        self._model = model
        self._quiescent = quiescent
        limits = client.batch_limits
        self._max_rows = min(policy.max_rows or limits.max_requests, limits.max_requests)
        self._max_bytes = limits.max_bytes
        self._pending: list[Row] = []
        self._driver: Row | None = None
        self._first_at = 0.0
        self._last_at = 0.0
        self._arrived = Notifier()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def poke(self) -> None:
        """Something the quiescence probe reads changed: let the round's driver re-check it."""
        self._arrived.notify()

    async def request(
        self, request: Any, *, owner: str | None, turn: int | None, blocker: Blocker | None = None
    ) -> Any:
        """One try through a batch: the row's result, or its error raised (the caller decides on retries)."""
        size = self._client.row_size(request)
        if size > self._max_bytes:
            raise BatchRowError(
                f"one request is {size:,} bytes, over the {self._client.provider} batch limit of "
                f"{self._max_bytes:,} bytes; shorten the conversation or use batch=False"
            )
        row = self._book.track(Row(request, owner, turn, size), blocker)
        now = self._book.clock()
        if not self._pending:
            self._first_at = now
        self._last_at = now
        self._pending.append(row)
        self._arrived.notify()
        try:
            await self._until_flushed(row)
        finally:
            if row.batch is None:  # cancelled while pending: leave the round, hand on the driver's role
                row.release()
                self._pending.remove(row)
                if self._driver is row:
                    self._driver = None
                    if self._pending and self._pending[0].wake is not None:
                        self._pending[0].wake.set()
        return await self._book.collect(self._client, self._retry, self._policy, row)

    async def _until_flushed(self, row: Row) -> None:
        while row.batch is None:
            if self._driver is None:
                self._driver = row
            if self._driver is not row:
                row.wake = anyio.Event()
                await row.wake.wait()
                continue
            event = self._arrived.event()
            now = self._book.clock()
            if self._should_flush(now):
                await self._flush()
                continue
            with anyio.move_on_after(max(0.0, self._deadline(now) - now)):
                await event.wait()

    def _should_flush(self, now: float) -> bool:
        if len(self._pending) >= self._max_rows or now - self._first_at >= self._policy.max_wait_s:
            return True
        if self._quiescent is not None:
            return self._quiescent()
        return now - self._last_at >= self._policy.idle_s

    def _deadline(self, now: float) -> float:
        deadline = self._first_at + self._policy.max_wait_s
        if self._quiescent is None:
            deadline = min(deadline, self._last_at + self._policy.idle_s)
        return deadline

    async def _flush(self) -> None:
        rows, self._pending, self._driver = self._pending, [], None
        batches = []
        for chunk in _split(rows, max_rows=self._max_rows, max_bytes=self._max_bytes):
            batch = Batch(self._client.provider, {})
            for i, row in enumerate(chunk):
                row.batch, row.custom_id = batch, f"r{i}"
                batch.rows[row.custom_id] = row
                if row.wake is not None:
                    row.wake.set()
            batches.append(batch)
        # Shielded: a batch the provider accepted must reach the store before a cancellation can stop us.
        with anyio.CancelScope(shield=True):
            for batch in batches:
                await self._book.submit(self._client, self._retry, self._policy, batch, self._model)


def _split(rows: list[Row], *, max_rows: int, max_bytes: int) -> list[list[Row]]:
    """Consecutive chunks within the provider's request and byte limits."""
    chunks: list[list[Row]] = []
    current: list[Row] = []
    size = 0
    for row in rows:
        if current and (len(current) >= max_rows or size + row.size > max_bytes):
            chunks.append(current)
            current, size = [], 0
        current.append(row)
        size += row.size
    if current:
        chunks.append(current)
    return chunks
