"""The writer's turn operations: a committed turn (with its token record, if any) and the resume replay.

Kept apart from ``_ledger`` (the writer's lifecycle, jobs and results) because a turn carries its token
record with it (``_token_rows``): what the writer stores of a record, where, and how a resumed job gets it
back whole is this module's concept, the rest of the writer only submits the operations built here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import StoreError, UnreadableRecordError
from ._group import Op
from ._json import SecretGuard, dumps
from ._token_rows import (
    TOKENS_KEY,
    TOKENS_TABLE,
    GeneratedIds,
    TokenRow,
    TokenRowError,
    detach_later,
    join,
    local_marker,
    put_marker,
    read_rows,
    split,
    stored_values,
)
from ._token_stream import append

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["committed_turns_op", "record_turn_op", "unknown_job"]

_UPSERT_TURN = (
    "INSERT OR REPLACE INTO turns (job_id, idx, turn_json, committed_at, stored_tokens) "
    "VALUES (?, ?, ?, ?, ?)"
)
_UPSERT_TOKENS = (
    f"INSERT OR REPLACE INTO {TOKENS_TABLE} (job_id, idx, facts_json, ids, model_logprobs, "
    "sampling_logprobs, prompt_ids) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_DROP_TOKENS = f"DELETE FROM {TOKENS_TABLE} WHERE job_id = ? AND idx = ?"  # a turn re-recorded without one


def unknown_job(action: str, job_id: str) -> StoreError:
    return StoreError(
        f"{action}: unknown job id {job_id!r}. Add the job with add_jobs() before recording for it."
    )


@dataclass(frozen=True, slots=True)
class _TurnWrite:
    """One record_turn's rows: its turns row and its token row's values as stored (None: it has none)."""

    job_id: str
    index: int
    text: str
    at: float
    tokens: tuple[Any, ...] | None


async def _write_turns(conn: aiosqlite.Connection, writes: Sequence[_TurnWrite]) -> None:
    """The record_turn calls of one transaction (or one that replaces a turn), together: the records' bytes
    appended to the stream at once (``_token_stream``), then every row with a few statements."""
    stream = iter(await append(conn, [w.tokens for w in writes if w.tokens is not None]))
    turns, drops, tokens = [], [], []
    for w in writes:
        turns.append((w.job_id, w.index, w.text, w.at, None if w.tokens is None else 1))
        if w.tokens is None:
            drops.append((w.job_id, w.index))
        else:
            tokens.append((w.job_id, w.index, *next(stream)))
    await conn.executemany(_UPSERT_TURN, turns)
    if drops:
        await conn.executemany(_DROP_TOKENS, drops)
    if tokens:
        await conn.executemany(_UPSERT_TOKENS, tokens)


def record_turn_op(
    job_id: str, index: int, turn: Mapping[str, Any], *, guard: SecretGuard, generated: GeneratedIds
) -> tuple[Op, TokenRow | None]:
    """The op that commits turn ``index`` of ``job_id`` (checked), and its token row, which the caller
    remembers in ``generated`` once the op committed."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"record_turn({job_id!r}): index must be an int >= 0, got {index!r}")
    if not isinstance(turn, Mapping):
        raise TypeError(
            f"record_turn({job_id!r}, {index}): turn must be a mapping, got {type(turn).__name__}"
        )
    stored, row = split(turn)  # its token record, if any, to turn_tokens in the same transaction
    text = dumps(dict(stored), what=f"turn {index} of job {job_id!r}", guard=guard)
    values = None if row is None else stored_values(row, *generated.sources(job_id, index, row))
    write = _TurnWrite(job_id, index, text, time.time(), values)

    async def again(conn: aiosqlite.Connection) -> None:  # a turn that may replace one others refer to
        await detach_later(conn, job_id, index)
        await _write_turns(conn, [write])

    what, explain = f"record_turn({job_id!r}, {index})", lambda _exc: unknown_job("record_turn", job_id)
    if generated.appends(job_id, index):
        return Op(what, apply_group=_write_turns, payload=write, explain=explain), row
    return Op(what, again, explain=explain), row


def committed_turns_op(job_id: str, generated: GeneratedIds) -> Op:
    """The op that reads ``job_id``'s committed turns, records joined back (see ``Ledger.committed_turns``),
    and tells ``generated`` what the job's later prompts may refer to."""

    async def apply(conn: aiosqlite.Connection) -> list[dict[str, Any]]:
        rows = await conn.execute_fetchall(
            "SELECT t.idx, t.turn_json, t.stored_tokens, k.facts_json, k.ids, k.model_logprobs, "
            f"k.sampling_logprobs, k.prompt_ids FROM turns t LEFT JOIN {TOKENS_TABLE} k "
            "ON k.job_id = t.job_id AND k.idx = t.idx "
            "WHERE t.job_id = ? AND t.idx >= 0 ORDER BY t.idx",
            (job_id,),
        )
        records = iter(await read_rows(conn, [row[3:] for row in rows if row[3] is not None]))
        whole = [
            (idx, text, flag, None if values[0] is None else next(records))
            for idx, text, flag, *values in rows
        ]
        sources = {idx: v[1] for idx, _, _, v in whole if v is not None and v[1] is not None}
        turns: list[dict[str, Any]] = []
        generated.forget(job_id)
        for idx, text, flag, values in whole:
            turn = json.loads(text)
            if values is not None or flag:
                meta = turn["metadata"] if not flag else put_marker(turn)["metadata"]
                try:
                    if values is None:
                        raise TokenRowError("its row is missing")
                    record = join(meta.get(TOKENS_KEY, local_marker()), values, sources)
                    turn["metadata"] = {**meta, TOKENS_KEY: record}
                    generated.remember(job_id, idx, TokenRow(*values))
                except TokenRowError as exc:
                    raise UnreadableRecordError(
                        f"job {job_id!r}'s turn {len(turns)}: its token record ({TOKENS_TABLE}) does not "
                        f"read: {exc}; the file was damaged there, so the job cannot replay it. Rerun it "
                        "with resume=False or into another out_dir",
                        job_id=job_id,
                        idx=len(turns),
                    ) from exc
            turns.append(turn)
        return turns

    return Op(f"committed_turns({job_id!r})", apply=apply)
