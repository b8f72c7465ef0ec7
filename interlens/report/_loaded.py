"""``RunReport.load(out_dir)``: a report over every job a ledger holds, without the run that wrote it.

What a later session needs to branch, export or sample a finished run: the jobs come from the ledger (read
on demand, as a live report's do), and each lineup's Conversation is either the original object the caller
passes (``conversations={name: conv}``: closures, custom stop conditions and all) or rebuilt from the recipe
the ledger recorded. Either is checked against the lineup's recorded fingerprint (in each job's input
fingerprint, ``settings``), so a recipe that did not write the ledger is refused here, naming the lineup,
instead of branching jobs it never ran. A lineup that cannot be rebuilt is refused only where it is needed
(``branch``), with the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._core import BranchError, ConfigurationError, as_interlens_errors, recipe_from_json

if TYPE_CHECKING:
    from interlens.scheduler import JobOutcome, RunOutcome
    from interlens.store import JobRecord, LedgerReader

    from ..conversation import Conversation

__all__ = ["lineup_recipes", "load_outcome"]


class _WholeLedger:
    """Every job of a ledger as outcomes (the scheduler's ``OutcomeSource``), read on demand."""

    def __init__(self, out_dir: os.PathLike[str] | str) -> None:
        self._out_dir = out_dir

    def _reader(self) -> LedgerReader:
        from interlens.store import LedgerReader

        return LedgerReader(self._out_dir)

    def job_ids(self, state: str | None = None) -> list[str]:
        with self._reader() as reader:
            if state is not None:
                return reader.job_ids(state=state)
            ended = {*reader.job_ids(state="done"), *reader.job_ids(state="failed")}
            return [job_id for job_id in reader.job_ids() if job_id in ended]

    def outcome(self, job_id: str) -> JobOutcome:
        with self._reader() as reader:
            job = reader.job(job_id)
            if job is None or job.state not in ("done", "failed"):
                raise KeyError(f"job {job_id!r} is not a finished or failed job of {self._out_dir}")
            return _outcome(job, reader.result(job_id))

    def outcomes(self) -> Iterator[JobOutcome]:
        with self._reader() as reader:
            for job, result in reader.iter_results(states=("done", "failed")):
                yield _outcome(job, result)


def _outcome(job: JobRecord, result: Mapping[str, Any] | None) -> JobOutcome:
    from interlens.scheduler import JobOutcome

    return JobOutcome.from_ledger(job, result)


def load_outcome(out_dir: os.PathLike[str] | str) -> RunOutcome:
    """The ledger in ``out_dir`` as a ``RunOutcome`` of all its finished and failed jobs."""
    from interlens.scheduler import RunOutcome
    from interlens.store import LedgerReader

    with as_interlens_errors(), LedgerReader(out_dir) as reader:
        counts = reader.counts()
        path = reader.path
    return RunOutcome(ledger_path=path, counts=counts, _source=_WholeLedger(path.parent))


def _settings_of(job: JobRecord) -> str | None:
    """A lineup's recipe fingerprint, as its job's input fingerprint recorded it."""
    try:
        parts = json.loads(job.input_fp or "{}")
    except ValueError:
        return None
    return parts.get("settings") if isinstance(parts, dict) else None


def lineup_recipes(
    out_dir: os.PathLike[str] | str,
    given: Mapping[str, Conversation] | None,
) -> tuple[dict[str, Conversation], dict[str, Exception]]:
    """Each lineup's Conversation (given, or rebuilt from its recorded recipe), checked against the
    fingerprint its jobs recorded; and, for a lineup that could not be rebuilt, why."""
    from interlens.store import LedgerReader

    recorded: dict[str, tuple[str | None, Mapping[str, Any] | None]] = {}
    with as_interlens_errors(), LedgerReader(out_dir) as reader:
        for job, result in reader.iter_results(states=("done", "failed", "pending", "running")):
            known = recorded.get(job.lineup)
            if known is not None and known[1] is not None:
                continue
            recipe = (result or {}).get("conversation", {}).get("recipe") if result else None
            recorded[job.lineup] = (_settings_of(job), recipe)
    unknown = sorted(set(given or {}) - set(recorded))
    if unknown:
        raise ConfigurationError(
            f"RunReport.load(conversations=...): the ledger in {out_dir} has no lineup {unknown[0]!r}; its "
            f"lineups: {sorted(recorded)}"
        )
    out: dict[str, Conversation] = {}
    missing: dict[str, Exception] = {}
    for name, (settings, recipe) in recorded.items():
        conv = (given or {}).get(name)
        if conv is None:
            if recipe is None:
                missing[name] = BranchError(f"lineup {name!r} has no finished job, so no recorded recipe")
                continue
            try:
                conv = recipe_from_json(recipe, lineup=name)
            except ConfigurationError as exc:
                missing[name] = exc
                continue
            if settings is not None and conv.fingerprint() != settings:
                missing[name] = BranchError(
                    f"lineup {name!r}: its recorded recipe does not rebuild to the recipe that ran (a part "
                    "JSON cannot say, such as a closure); pass the original Conversation: "
                    f"RunReport.load(out_dir, conversations={{{name!r}: conv}})"
                )
                continue
        elif settings is not None and conv.fingerprint() != settings:
            raise BranchError(
                f"RunReport.load(conversations=...): the Conversation given for lineup {name!r} is not the "
                f"recipe that wrote the ledger in {out_dir} (its fingerprint {conv.fingerprint()} differs "
                f"from the recorded {settings}: another model, sampling setting, turn count, stop "
                "condition or analyzer). Pass the recipe that ran, or branch from the ledger alone "
                "(conversations=None)"
            )
        out[name] = conv
    return out, missing
