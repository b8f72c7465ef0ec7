"""``report.branch(at_turn=k)``: a run's recorded jobs as branch points of a new recipe (issue 39).

Each selected job gives one :class:`~interlens.conversation.BranchPoint`: its data row, its seed and its
first ``k`` turns as its ledger (or the report in memory) recorded them, with where they come from. The
points ride on a copy of the job's lineup recipe as its data, so the usual modifiers change the recipe and a
rollout expands each point into ``n`` continuations (``rollouts._rollout``). Everything that can be wrong
with a branch point (a turn past a job's length, a job that failed before it, an unknown job) is refused
here, naming the job and the fix, before any job starts.

The recorded turns are carried as recorded: a hosted participant's turns are replayed, never bought again,
and a turn whose token record lives in the ledger's table gets it back inline (``_ledger_tokens``), so the
branch's own ledger keeps it whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._core import MODERATOR, BranchError, BranchPoint, BranchPoints, closest_name, expand_turns, first_turns

if TYPE_CHECKING:
    from interlens.store import LedgerReader

    from ..conversation import Conversation
    from ._report import RunReport, RunResult

__all__ = ["END", "PARENT_KEY", "branch"]

PARENT_KEY = "parent"
"""The key of a branch job's result conversation JSON naming its parent: ``{"out_dir", "job_id", "turn"}``."""

END = "end"
"""``branch(at_turn="end")``: each job at its own last turn (analyse again without generating)."""


def _check_turn(at_turn: Any) -> int | None:
    """``at_turn`` as a turn count, or None for ``"end"``; anything else refused."""
    if at_turn == END:
        return None
    if isinstance(at_turn, bool) or not isinstance(at_turn, int) or at_turn < 0:
        raise BranchError(
            f"branch(at_turn={at_turn!r}): pass a number of generated turns (0, 1, ...) to continue after, "
            f"or at_turn={END!r} to take each job whole (a new analyzer on what was recorded)"
        )
    return at_turn


def _selected(report: RunReport, jobs: Sequence[str] | None, lineup: str | None) -> list[str]:
    """The job ids to branch: ``jobs`` as given (each checked), else every finished job of the lineup."""
    known = list(report.results)
    if jobs is not None:
        if isinstance(jobs, str):
            jobs = [jobs]
        for job_id in jobs:
            if job_id not in report.results:
                near = closest_name(str(job_id), known)
                hint = f" (did you mean {near!r}?)" if near else ""
                raise BranchError(
                    f"branch(jobs=...): no job {job_id!r} in this report{hint}; its jobs are "
                    f"report.results' keys ({len(known)}, e.g. {known[:3]})"
                )
        return list(jobs)
    lineups = report._lineup_names
    if lineup is None and len(lineups) > 1:
        raise BranchError(
            f"branch(): this report holds the lineups {lineups}; branch one of them at a time with "
            f"branch(at_turn=..., lineup={lineups[0]!r}), or name the jobs with jobs=[...]"
        )
    failed = set(report.failed)
    return [
        job_id
        for job_id in known
        if job_id not in failed and (lineup is None or report._lineup_of(job_id) == lineup)
    ]


def _transcript(result: RunResult, reader: LedgerReader | None) -> list[dict[str, Any]]:
    """The job's recorded messages as JSON, token records inline."""
    state = result._state
    assert state is not None
    if reader is not None:
        from ._ledger_tokens import with_records

        state = with_records(reader, result.job_id, state) or state
    return expand_turns(state.get("transcript") or [])


def _point(result: RunResult, at_turn: int | None, reader: LedgerReader | None) -> BranchPoint:
    job_id = result.job_id
    if result._state is None:
        error = result.error
        why = f"{error.type}: {error.message[:200]}" if error is not None else "no error recorded"
        raise BranchError(
            f"job {job_id!r} failed ({why}) and kept no conversation, so it has no turns to branch from; "
            "leave it out (branch(jobs=[...]) without it; report.failed lists the failed jobs) or rerun it "
            "into its out_dir first"
        )
    messages = [m for m in _transcript(result, reader) if not (m.get("metadata") or {}).get("shared_context")]
    length = sum(1 for m in messages if m.get("author") != MODERATOR)
    k = length if at_turn is None else at_turn
    if k > length:
        failed = " (it failed before finishing)" if result.error is not None else ""
        raise BranchError(
            f"job {job_id!r} has {length} generated turn(s){failed}, so it cannot be branched at turn {k}: "
            f"pass at_turn <= {length}, or leave it out with branch(jobs=[...])"
        )
    state = result._state
    return BranchPoint(
        parent_job=job_id,
        at_turn=k,
        seed=result.seed,
        row=state.get("row"),
        row_index=result.row_index,
        turns=tuple(first_turns(messages, k, author=lambda m: str(m.get("author")))),
        parent_out_dir=str(result._out_dir) if result._out_dir is not None else None,
    )


def branch(
    report: RunReport,
    at_turn: int | str,
    *,
    jobs: Sequence[str] | None = None,
    lineup: str | None = None,
    n: int = 1,
) -> Conversation:
    """See :meth:`RunReport.branch`."""
    turn = _check_turn(at_turn)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BranchError(f"branch(n={n!r}): n is how many continuations each branch point gets, an int >= 1")
    job_ids = _selected(report, jobs, lineup)
    if not job_ids:
        raise BranchError(
            "branch(): no finished job to branch in this report (failed jobs are left out unless named "
            "with jobs=[...])"
        )
    results = [report.results[job_id] for job_id in job_ids]
    lineups = sorted({report._lineup_of(job_id) for job_id in job_ids})
    if len(lineups) > 1:
        raise BranchError(
            f"branch(jobs=...): the jobs come from the lineups {lineups}, and a branch continues one recipe; "
            "branch the jobs of each lineup apart (branch(..., lineup=name)) and run them together with "
            "interlens.run([...])"
        )
    recipe = report._lineup_recipe(lineups[0])
    reader = report._open_reader()
    try:
        points = tuple(_point(result, turn, reader) for result in results)
    finally:
        if reader is not None:
            reader.close()
    return recipe.recipe().data(BranchPoints(points, n))


def parent_of(conversation: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The parent a branch job's result records (``out_dir``, ``job_id``, ``turn``), else None."""
    parent = (conversation or {}).get(PARENT_KEY)
    return parent if isinstance(parent, Mapping) else None


def describe_parent(parent: Mapping[str, Any] | None) -> str | None:
    """``row_00012@3 in runs/x``: a parent as one line of text (export, show, the HTML report)."""
    if parent is None:
        return None
    where = f" in {parent['out_dir']}" if parent.get("out_dir") else ""
    return f"{parent.get('job_id')}@{parent.get('turn')}{where}"
