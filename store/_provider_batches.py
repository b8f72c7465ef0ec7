"""In-flight provider batches: the operations that record them, and re-attach to them after a crash.

A provider batch is paid for when it is submitted, so its id and the custom_id → (job, turn) map are
committed BEFORE polling starts: a run killed while the batch is in flight re-attaches to it on resume
instead of submitting (and paying for) the same requests again. Each row also keeps the hash of the request
as it was sent, so that a rerun re-attaches only a job that would send that same request now.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._errors import StoreError
from ._group import Op
from ._json import SecretGuard, dumps
from ._records import TERMINAL_BATCH_STATES, BatchRecord

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["open_batches_op", "record_batch_op", "refuse_credential_keys", "update_batch_op"]

_CREDENTIAL_KEYS = frozenset(
    {"api-key", "apikey", "authorization", "x-api-key", "secret", "password", "access-token"}
)


def refuse_credential_keys(value: Any, *, what: str) -> None:
    """Refuse metadata that *names* a credential field, whatever its value (the env guard checks values)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if str(key).lower().replace("_", "-") in _CREDENTIAL_KEYS:
                raise StoreError(
                    f"refusing to store {what}: it has a {key!r} field. The ledger never stores credentials; "
                    f"keep keys in the environment and out of batch metadata."
                )
            refuse_credential_keys(item, what=what)
    elif isinstance(value, list | tuple):
        for item in value:
            refuse_credential_keys(item, what=what)


def _meta_json(provider: str, batch_id: str, meta: Mapping[str, Any], guard: SecretGuard) -> str:
    what = f"the metadata of {provider} batch {batch_id!r}"
    refuse_credential_keys(meta, what=what)
    return dumps(dict(meta), what=what, guard=guard)


def record_batch_op(batch: BatchRecord, *, guard: SecretGuard) -> Op:
    meta_json = _meta_json(batch.provider, batch.batch_id, batch.meta, guard)
    key = (batch.provider, batch.batch_id)
    hashes = batch.request_hashes
    requests = [(*key, cid, job, int(turn), hashes.get(cid)) for cid, (job, turn) in batch.requests.items()]
    now = time.time()

    async def apply(conn: aiosqlite.Connection) -> None:
        await conn.execute("DELETE FROM batch_requests WHERE provider = ? AND batch_id = ?", key)
        await conn.execute(
            "INSERT OR REPLACE INTO batches "
            "(provider, batch_id, state, meta_json, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
            (*key, batch.state, meta_json, batch.created_at or now, now),
        )
        await conn.executemany(
            "INSERT INTO batch_requests (provider, batch_id, custom_id, job_id, turn_index, request_hash) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            requests,
        )

    return Op(f"record_batch({batch.provider!r}, {batch.batch_id!r})", apply=apply)


def update_batch_op(
    provider: str, batch_id: str, *, state: str, meta: Mapping[str, Any] | None, guard: SecretGuard
) -> Op:
    if not isinstance(state, str) or not state:
        raise ValueError(f"update_batch: state must be a non-empty str, got {state!r}")
    meta_json = None if meta is None else _meta_json(provider, batch_id, meta, guard)

    async def apply(conn: aiosqlite.Connection) -> None:
        rows = await conn.execute_fetchall(
            "UPDATE batches SET state = ?, meta_json = coalesce(?, meta_json), updated_at = ? "
            "WHERE provider = ? AND batch_id = ? RETURNING 1",
            (state, meta_json, time.time(), provider, batch_id),
        )
        if not rows:
            raise StoreError(
                f"update_batch: no {provider} batch {batch_id!r} was recorded; call record_batch first"
            )

    return Op(f"update_batch({provider!r}, {batch_id!r})", apply=apply)


def open_batches_op() -> Op:
    terminal = sorted(TERMINAL_BATCH_STATES)
    marks = ", ".join("?" * len(terminal))

    async def apply(conn: aiosqlite.Connection) -> list[BatchRecord]:
        rows = await conn.execute_fetchall(
            f"SELECT provider, batch_id, state, meta_json, created_at, updated_at FROM batches "
            f"WHERE state NOT IN ({marks}) ORDER BY created_at, provider, batch_id",
            terminal,
        )
        out = []
        for provider, batch_id, state, meta_json, created, updated in rows:
            requests = await conn.execute_fetchall(
                "SELECT custom_id, job_id, turn_index, request_hash FROM batch_requests "
                "WHERE provider = ? AND batch_id = ?",
                (provider, batch_id),
            )
            mapping = {cid: (job, int(turn)) for cid, job, turn, _ in requests}
            hashes = {cid: digest for cid, _, _, digest in requests}
            meta = json.loads(meta_json)
            out.append(BatchRecord(provider, batch_id, state, mapping, meta, created, updated, hashes))
        return out

    return Op("open_batches", apply=apply)
