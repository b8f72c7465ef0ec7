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

Readers put the same mapping back together (:func:`assemble`), so callers see exactly what was written.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ._json import SecretGuard, dumps

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["EncodedResult", "assemble", "encode_result", "store_result"]

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
    if isinstance(state.get(_TRANSCRIPT), list):
        messages = tuple(
            dumps(message, what=f"message {i} of the transcript in {what}", guard=guard)
            for i, message in enumerate(state.pop(_TRANSCRIPT))
        )
    state_json = dumps(state, what=what, guard=guard)
    analysis_json = (
        None if analysis is None else dumps(analysis, what=f"the analysis of job {job_id!r}", guard=guard)
    )
    return EncodedResult(job_id, state_json, recipe, messages, analysis_json)


async def store_result(conn: aiosqlite.Connection, result: EncodedResult) -> bool:
    """Write ``result`` inside the caller's transaction; False (nothing written) when the job is unknown."""
    job_id = result.job_id
    rows = list(
        await conn.execute_fetchall(
            "SELECT l.describe_json FROM jobs j LEFT JOIN lineups l ON l.name = j.lineup WHERE j.job_id = ?",
            (job_id,),
        )
    )
    if not rows:
        return False
    shared = result.recipe_json is not None and result.recipe_json == rows[0][0]
    order: str | None = None
    await conn.execute("DELETE FROM turns WHERE job_id = ? AND idx < 0", (job_id,))
    if result.messages is not None:
        committed: dict[str, deque[int]] = {}
        for idx, text in await conn.execute_fetchall(
            "SELECT idx, turn_json FROM turns WHERE job_id = ? AND idx >= 0 ORDER BY idx", (job_id,)
        ):
            committed.setdefault(text, deque()).append(int(idx))
        indices: list[int] = []
        extra: list[tuple[str, int, str, float]] = []
        now = time.time()
        for text in result.messages:
            same = committed.get(text)
            if same:
                indices.append(same.popleft())
            else:
                extra.append((job_id, -len(extra) - 1, text, now))
                indices.append(extra[-1][1])
        await conn.executemany(
            "INSERT INTO turns (job_id, idx, turn_json, committed_at) VALUES (?, ?, ?, ?)", extra
        )
        order = json.dumps(indices, separators=(",", ":"))
    await conn.execute(
        "INSERT OR REPLACE INTO results (job_id, state_json, lineup_recipe, turn_order, analysis_json) "
        "VALUES (?, ?, ?, ?, ?)",
        (
            job_id,
            result.state_json if shared else result.state_with_recipe(),
            int(shared),
            order,
            result.analysis_json,
        ),
    )
    return True


def assemble(
    state_json: str, recipe_json: str | None, turn_order: str | None, turns: Mapping[int, str]
) -> dict[str, Any]:
    """The conversation mapping a result was written from. ``recipe_json``: the lineup's recipe when the
    result shares it, else None; ``turns``: the job's turns rows (idx → text), at least those it lists."""
    conversation: dict[str, Any] = {}
    if recipe_json is not None:
        conversation[_RECIPE] = json.loads(recipe_json)
    if turn_order is not None:
        conversation[_TRANSCRIPT] = [json.loads(turns[idx]) for idx in json.loads(turn_order)]
    conversation.update(json.loads(state_json))
    return conversation
