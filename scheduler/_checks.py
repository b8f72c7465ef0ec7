"""Refusing bad input to ``run_jobs`` early, with an error that names the problem and the fix.

The lineups are checked before anything is opened or started (the rest of the run's input by
``RunConfig.check``); each pulled ``JobSpec`` is checked as it is pulled, before it is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._errors import DuplicateJobError, SchedulerConfigError
from ._protocols import JobSpec, LineupSpec

__all__ = ["check_lineups", "check_spec", "needs_device"]


def check_lineups(lineups: Sequence[LineupSpec]) -> None:
    """Refuse a bad list of lineups before anything is opened or run, naming the problem and the fix (the
    run's other arguments are :meth:`RunConfig.check`'s)."""
    if isinstance(lineups, LineupSpec):
        raise SchedulerConfigError("run_jobs takes a list of LineupSpec; wrap the single lineup: [lineup]")
    if not isinstance(lineups, Sequence) or isinstance(lineups, str):
        raise SchedulerConfigError(f"lineups must be a list of LineupSpec, got {type(lineups).__name__}")
    seen: set[str] = set()
    for lineup in lineups:
        if not isinstance(lineup, LineupSpec):
            raise SchedulerConfigError(f"every lineup must be a LineupSpec, got {type(lineup).__name__}")
        if not isinstance(lineup.name, str) or not lineup.name:
            raise SchedulerConfigError(f"a lineup name must be a non-empty str, got {lineup.name!r}")
        if lineup.name in seen:
            raise DuplicateJobError(
                f"two lineups are named {lineup.name!r}; their job ids would collide. Give each lineup of a "
                "run its own name"
            )
        seen.add(lineup.name)
        if not isinstance(lineup.fingerprint, str):
            raise SchedulerConfigError(f"lineup {lineup.name!r}: fingerprint must be a str")


def check_spec(spec: object, lineup: LineupSpec) -> None:
    if not isinstance(spec, JobSpec):
        raise SchedulerConfigError(
            f"lineup {lineup.name!r} yielded {type(spec).__name__}; its jobs must be JobSpec instances"
        )
    if not isinstance(spec.job_id, str) or not spec.job_id:
        raise SchedulerConfigError(
            f"lineup {lineup.name!r} yielded a job with id {spec.job_id!r}; ids are non-empty str"
        )
    if spec.lineup != lineup.name:
        raise SchedulerConfigError(
            f"job {spec.job_id!r} says it belongs to lineup {spec.lineup!r} but came from lineup "
            f"{lineup.name!r}; set JobSpec.lineup to the name of the lineup that yields it"
        )


def needs_device(spec: JobSpec) -> bool:
    try:
        return bool(spec.job.needs_device)
    except AttributeError:
        raise SchedulerConfigError(
            f"job {spec.job_id!r}: {type(spec.job).__name__} has no needs_device attribute (the Job "
            "protocol); set it to True when the job uses a local model"
        ) from None
