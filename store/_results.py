"""A job's result as the ledger stores it (schema 3): each message once, the recipe once per lineup.

A result is the caller's ``conversation`` mapping (interlens: ``{"schema", "recipe", "transcript", "row",
"seed"}``) and its analysis. Stored whole per job (schema 2), every transcript was on disk twice — as the
turns the job committed while it ran and again inside the result — and the recipe, the same for every job
of a lineup, once per job. So the result is split where it is written:

- ``"transcript"`` (when it is a list): each message is a reference to a ``turns`` row holding the same
  text. A committed turn (idx >= 0) is reused; a message no turn row holds (a seeded shared context, what the
  conversation had before the run, anything added after its last turn) is written as a row with a negative
  idx, in the same transaction as the result, and is never replayed by a resumed job. ``results.turn_order``
  lists the idx of each message in order. Texts are compared exactly, so a message read back is the one
  written, metadata included; equal texts are interchangeable, so the k-th occurrence of a text takes the
  k-th committed turn with that text.
- ``"recipe"``: when its JSON text equals the lineup's (``lineups.describe_json``, the recipe the caller
  recorded at ``begin_run``), only ``results.lineup_recipe = 1`` is stored; any other recipe stays per job.
- the rest (``state_json``): what is the job's own — its data row, seed, format version.

A result written for a job that already has one (its analyzer failed with the conversation kept, then a
rerun redid the analysis) replaces it, and the replaced row's ``state_json`` and ``analysis_json`` move to
``superseded_results`` in the same transaction (schema 4): what an attempt recorded, such as the metadata of
paid API calls, is kept for totals over every result (``LedgerReader.result_values``), while every reader of
"the" result sees the current one only. Its transcript is not kept again: the job's turns rows stay (the rows
with a negative idx are the current result's own and are rewritten with it).

Readers put the same mapping back together (:func:`assemble`), so callers see exactly what was written.
:func:`store_results` writes the results of every ``finish_job`` of one group-committed transaction with a
few statements for all of them: a statement per result would cost a round trip to SQLite's thread each.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ._json import SecretGuard, dumps
from ._token_rows import TOKENS_TABLE, TokenRow, put_marker, split, stored_values

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["EncodedResult", "assemble", "chunks", "encode_result", "store_results"]

_RECIPE: Final = "recipe"
_TRANSCRIPT: Final = "transcript"


@dataclass(frozen=True, slots=True)
class EncodedResult:
    """A result as JSON texts, encoded (and checked for credentials) in the caller, before it is queued."""

    job_id: str
    state_json: str  # the conversation without "recipe" and without a "transcript" list
    recipe_json: str | None  # the conversation's "recipe", None when it has none
    messages: tuple[str, ...] | None  # each message of a "transcript" list; None when there is no list
    analysis_json: str | None
    records: tuple[TokenRow | None, ...] = ()  # each message's token record, taken out of its JSON

    def state_with_recipe(self) -> str:
        """``state_json`` with the recipe put back: what is stored when the recipe is not the lineup's."""
        if self.recipe_json is None:
            return self.state_json
        rest = self.state_json[1:]  # an encoded mapping: "{...}"
        return '{"recipe":' + self.recipe_json + ("" if rest == "}" else ",") + rest


def encode_result(
    job_id: str, conversation: Mapping[str, Any], analysis: Any, *, what: str, guard: SecretGuard
) -> EncodedResult:
    """Encode a result; ``what`` names it in errors ("the conversation of job 'x'")."""
    state = dict(conversation)
    recipe = (
        dumps(state.pop(_RECIPE), what=f"the recipe in {what}", guard=guard) if _RECIPE in state else None
    )
    messages = None
    records: tuple[TokenRow | None, ...] = ()
    if isinstance(state.get(_TRANSCRIPT), list):
        pieces = [split(message) for message in state.pop(_TRANSCRIPT)]  # a record: to turn_tokens
        messages = tuple(
            dumps(message, what=f"message {i} of the transcript in {what}", guard=guard)
            for i, (message, _) in enumerate(pieces)
        )
        records = tuple(row for _, row in pieces)
    state_json = dumps(state, what=what, guard=guard)
    analysis_json = (
        None if analysis is None else dumps(analysis, what=f"the analysis of job {job_id!r}", guard=guard)
    )
    return EncodedResult(job_id, state_json, recipe, messages, analysis_json, records)


_CHUNK: Final = 500  # values per "IN (...)": under SQLite's oldest limit of 999 bound parameters


def chunks(values: Sequence[str]) -> Iterator[tuple[str, Sequence[str]]]:
    """``values`` in pieces small enough for one "IN (...)", each with its "?, ?, ..." marks."""
    for start in range(0, len(values), _CHUNK):
        piece = values[start : start + _CHUNK]
        yield ", ".join("?" * len(piece)), piece


async def store_results(conn: aiosqlite.Connection, results: Sequence[EncodedResult]) -> list[str]:
    """Write ``results`` inside the caller's transaction, a few statements for all of them; return the ids
    whose job is unknown, in which case nothing was written."""
    lineup_of: dict[str, str] = {}
    ids = [result.job_id for result in results]
    for marks, piece in chunks(ids):
        sql = f"SELECT job_id, lineup FROM jobs WHERE job_id IN ({marks})"
        lineup_of.update((job_id, lineup) for job_id, lineup in await conn.execute_fetchall(sql, piece))
    unknown = [job_id for job_id in ids if job_id not in lineup_of]
    if unknown:
        return unknown
    recipes: dict[str, str] = {}
    for marks, piece in chunks(sorted(set(lineup_of.values()))):
        sql = f"SELECT name, describe_json FROM lineups WHERE name IN ({marks})"
        recipes.update((name, text) for name, text in await conn.execute_fetchall(sql, piece))
    # job → (text, its token record's digest) → its committed idx, in order. The digest (schema 6: in the
    # record's row, not its marker) keeps turns whose JSON differs only in their records apart.
    committed: dict[str, dict[tuple[str, str | None], deque[int]]] = {}
    stale: set[str] = set()  # jobs with rows of an earlier stored result, replaced below
    for marks, piece in chunks(ids):
        sql = (
            "SELECT t.job_id, t.idx, t.turn_json, CASE WHEN json_valid(k.facts_json) THEN "
            f"json_extract(k.facts_json, '$.digest') END FROM turns t LEFT JOIN {TOKENS_TABLE} k "
            f"ON k.job_id = t.job_id AND k.idx = t.idx WHERE t.job_id IN ({marks}) ORDER BY t.job_id, t.idx"
        )
        for job_id, idx, text, digest in await conn.execute_fetchall(sql, piece):
            if idx < 0:
                stale.add(job_id)
            else:
                committed.setdefault(job_id, {}).setdefault((text, digest), deque()).append(int(idx))
    extra: list[tuple[str, int, str, float, int | None]] = []
    extra_tokens: list[tuple[Any, ...]] = []  # the token records of those rows (schema 5)
    rows: list[tuple[str, str, int, str | None, str | None]] = []
    now = time.time()
    for result in results:
        job_id = result.job_id
        shared = result.recipe_json is not None and result.recipe_json == recipes.get(lineup_of[job_id])
        order = None
        first_extra = len(extra)  # this job's own rows start at -1
        if result.messages is not None:
            texts = committed.get(job_id, {})
            indices: list[int] = []
            for k, text in enumerate(result.messages):
                row = result.records[k] if result.records else None
                same = texts.get((text, None if row is None else row.digest()))
                if same:
                    indices.append(same.popleft())
                else:  # a message no turn row holds: its own row, numbered -1, -2, ...
                    extra.append(
                        (job_id, -len(extra) - 1 + first_extra, text, now, None if row is None else 1)
                    )
                    indices.append(extra[-1][1])
                    if row is not None:
                        extra_tokens.append((job_id, extra[-1][1], *stored_values(row, {})))
            order = json.dumps(indices, separators=(",", ":"))
        state = result.state_json if shared else result.state_with_recipe()
        rows.append((job_id, state, int(shared), order, result.analysis_json))
    for marks, piece in chunks(ids):  # results these replace: kept (schema 4), see the module docstring
        await conn.execute(
            "INSERT INTO superseded_results (job_id, state_json, analysis_json, replaced_at) "
            f"SELECT job_id, state_json, analysis_json, ? FROM results WHERE job_id IN ({marks})",
            (now, *piece),
        )
    if stale:
        await conn.executemany(
            "DELETE FROM turns WHERE job_id = ? AND idx < 0", [(j,) for j in sorted(stale)]
        )
        await conn.executemany(
            f"DELETE FROM {TOKENS_TABLE} WHERE job_id = ? AND idx < 0", [(j,) for j in sorted(stale)]
        )
    if extra:
        await conn.executemany(
            "INSERT INTO turns (job_id, idx, turn_json, committed_at, stored_tokens) VALUES (?, ?, ?, ?, ?)",
            extra,
        )
    if extra_tokens:
        await conn.executemany(
            f"INSERT OR REPLACE INTO {TOKENS_TABLE} (job_id, idx, facts_json, ids, model_logprobs, "
            "sampling_logprobs, prompt_ids) VALUES (?, ?, ?, ?, ?, ?, ?)",
            extra_tokens,
        )
    await conn.executemany(
        "INSERT OR REPLACE INTO results (job_id, state_json, lineup_recipe, turn_order, analysis_json) "
        "VALUES (?, ?, ?, ?, ?)",
        rows,
    )
    return []


def assemble(
    state_json: str,
    recipe_json: str | None,
    turn_order: str | None,
    turns: Mapping[int, str],
    marked: Container[int] = (),
) -> dict[str, Any]:
    """The conversation mapping a result was written from. ``recipe_json``: the lineup's recipe when the
    result shares it, else None; ``turns``: the job's turns rows (idx → text), at least those it lists;
    ``marked``: the idx of those whose record is in ``turn_tokens`` (schema 7), given their marker back."""
    conversation: dict[str, Any] = {}
    if recipe_json is not None:
        conversation[_RECIPE] = json.loads(recipe_json)
    if turn_order is not None:
        conversation[_TRANSCRIPT] = [
            put_marker(json.loads(turns[idx])) if idx in marked else json.loads(turns[idx])
            for idx in json.loads(turn_order)
        ]
    conversation.update(json.loads(state_json))
    return conversation
