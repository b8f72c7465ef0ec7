"""The options of ``rollout``/``run`` and their async twins, checked in the user's call before anything runs.

Every option is checked here, in the caller's thread, before a job is expanded, a worker started or a ledger
file created: a typo (``outdir=``), a wrong type (``seed="a"``, ``n=True``, ``resume="no"``) or a directory
that cannot be written fails at once with an error naming the call, the option and the fix, instead of a raw
``TypeError`` from the scheduler or an ``OSError`` minutes into a run. The checked options are one record,
:class:`Options`: the run's own settings are the scheduler's :class:`~interlens.scheduler.RunConfig`, passed
on whole. ``RunConfig`` is the single source of those options: their names and defaults are derived from its
fields (``OPTION_DEFAULTS``) and its ``check`` is their one checker, whose messages name the user's call; only
``seed``, ``batched`` (another spelling of ``mode``), ``api_budget``, ``record_tokens`` and the jobs' time
limits (``turn_timeout``, ``analyzer_timeout``) are interlens' own and checked here. ``RunOptions`` is the
same names for type checkers (a TypedDict cannot be derived at run time; a test keeps its keys equal to the
derived names).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from interlens.scheduler import RunConfig, SchedulerConfigError

from .._core import (
    NO_TIME_LIMITS,
    ConfigurationError,
    ConfigurationTypeError,
    TimeLimits,
    check_bool,
    check_int,
    check_number,
    closest_name,
    type_name,
)

if TYPE_CHECKING:
    from interlens.scheduler import ExecutionMode

    from ._api_budget import APIBudget

__all__ = [
    "OPTION_DEFAULTS",
    "SEED_LIMIT",
    "Options",
    "RunOptions",
    "check_n",
    "parse_options",
    "prepare_out_dir",
]


class RunOptions(TypedDict, total=False):
    """The keyword options of ``rollout``/``run`` (for type checkers and IDEs: ``**options: Unpack[...]``)."""

    devices: Sequence[str | Sequence[str]] | None  # an inner list: a group of GPUs for one worker
    out_dir: str | os.PathLike[str] | None
    seed: int
    batched: bool | None
    mode: ExecutionMode | str | None
    resume: bool
    max_batch_size: int
    max_concurrency: int
    max_attempts: int
    progress: bool | None
    max_batch_wait: float
    worker_start_timeout: float
    api_budget: APIBudget | None
    cluster: Literal["ray"] | None  # "ray": the device workers are Ray actors (docs/ray.md)
    record_tokens: bool  # every participant that can keeps its turns' tokens (message.tokens)
    turn_timeout: float | None  # seconds one turn may take before its job fails (None: no limit)
    analyzer_timeout: float | None  # seconds an analyzer may take before its job fails (None: no limit)


#: ``RunConfig`` fields that interlens fills in itself (from the registered hooks, the installed versions,
#: ``api_budget``): never options. Every other field of ``RunConfig`` is an option of the same name.
SET_BY_INTERLENS = ("versions", "worker_init", "spend_guard")

#: The options that are interlens' own (not ``RunConfig`` fields), and their defaults.
_OWN_DEFAULTS: Mapping[str, Any] = {
    "seed": 0,  # per-rollout seeds are seed, seed+1, ...
    "batched": None,  # True unless mode=ExecutionMode.DETERMINISTIC
    "api_budget": None,  # else the enclosing ``with APIBudget(...):`` block's
    "record_tokens": False,  # True: record_tokens=True on every participant that can (docs/rollouts.md)
    "turn_timeout": None,  # seconds; None: a turn may take as long as it takes
    "analyzer_timeout": None,  # seconds; None: an analyzer may take as long as it takes
}

#: The ``RunConfig`` fields that are options, in the record's order.
_RUN_OPTIONS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in SET_BY_INTERLENS)

#: Each option and its default (the scheduler's, stated once in ``RunConfig``), in the order the error for an
#: unknown option lists them. ``mode``'s is None: decided with ``batched=`` (BATCHED unless batched=False).
#: ``devices=None``: every visible GPU, else the CPU (only local models need a device).
OPTION_DEFAULTS: Mapping[str, Any] = {
    **{f.name: f.default for f in dataclasses.fields(RunConfig) if f.name in _RUN_OPTIONS},
    "mode": None,
    **_OWN_DEFAULTS,
}

#: Options people reach for that do not exist, and what to write instead.
_INSTEAD: Mapping[str, str] = {
    "fresh": "to start over in an existing out_dir pass resume=False (the old ledger is moved aside, not "
    "deleted)",
    "device": "pass devices=[...] (a list, e.g. devices=['cuda:0'])",
    "deterministic": "pass mode=ExecutionMode.DETERMINISTIC (or batched=False)",
}

SEED_LIMIT = 2**63  # the ledger stores seeds as SQLite INTEGER (signed 64-bit)


@dataclass(frozen=True)
class Options:
    """The checked options of one run call: the scheduler's record of the run, and what interlens adds."""

    caller: str  # "rollout", "arollout", "run", "arun": named in every message
    seed: int
    run: RunConfig  # devices, out_dir (a Path), resume, mode, limits, progress, cluster: passed on whole
    api_budget: APIBudget | None = None
    record_tokens: bool = False  # each participant that can records its turns' tokens (part of the recipe)
    limits: TimeLimits = NO_TIME_LIMITS  # how long a job waits for one turn and for its analyzer
    seed_given: bool = (
        False  # seed= was passed: a branch's continuations then draw from it (not the parent's)
    )


def parse_options(caller: str, options: Mapping[str, Any]) -> Options:
    """Check ``options`` given to ``caller()``; raise naming the option and the fix, else return them."""
    unknown = [name for name in options if name not in OPTION_DEFAULTS]
    if unknown:
        raise _unknown_option(caller, unknown[0])
    given = {**OPTION_DEFAULTS, **options}
    where = f"{caller}()"
    seed = check_int(
        given["seed"], what=f"{where}: seed", low=0, fix="per-rollout seeds are seed, seed+1, ... e.g. seed=0"
    )
    if seed >= SEED_LIMIT:
        raise ConfigurationError(f"{where}: seed must be below 2**63 (a 64-bit integer), got {seed}")
    values = {name: given[name] for name in _RUN_OPTIONS}
    run = RunConfig(**{**values, "mode": _mode(where, given["mode"], given["batched"])})
    try:
        run.check(where=where)  # the one checker of the run's options (the scheduler's record)
    except SchedulerConfigError as exc:
        raise (ConfigurationTypeError if isinstance(exc, TypeError) else ConfigurationError)(
            *exc.args
        ) from None
    _cluster_installed(where, run.cluster)
    out_dir = None if run.out_dir is None else Path(run.out_dir).expanduser()  # "~/runs/x": the home's
    devices = None if run.devices is None else list(run.devices)
    run = dataclasses.replace(run, devices=devices, out_dir=out_dir)
    record_tokens = check_bool(
        given["record_tokens"],
        what=f"{where}: record_tokens",
        fix="True keeps every turn's tokens and their log-probabilities where its participant can",
    )
    return Options(
        caller=caller,
        seed=seed,
        run=run,
        api_budget=_api_budget(where, given["api_budget"]),
        record_tokens=bool(record_tokens),
        seed_given="seed" in options,
        limits=TimeLimits(
            turn=_seconds(where, "turn_timeout", given["turn_timeout"]),
            analyzer=_seconds(where, "analyzer_timeout", given["analyzer_timeout"]),
        ),
    )


def _seconds(where: str, name: str, value: Any) -> float | None:
    """A time limit: None (none) or a number of seconds > 0."""
    if value is None:
        return None
    return check_number(
        value,
        what=f"{where}: {name}",
        low=0,
        open_low=True,
        fix=f"seconds, e.g. {name}=600, or None for no limit",
    )


def _cluster_installed(where: str, cluster: str | None) -> None:
    if cluster is not None and not _installed(cluster):
        raise ConfigurationError(
            f"{where}: cluster={cluster!r} needs Ray, which is not installed here; install it with "
            "`pip install 'interlens[ray]'` (the same Ray version as the cluster's), or leave "
            "cluster=None to run on this machine"
        )


def _api_budget(where: str, budget: Any) -> APIBudget | None:
    from ._api_budget import APIBudget, ambient_budget

    if budget is None:
        return ambient_budget()
    if not isinstance(budget, APIBudget):
        raise ConfigurationTypeError(
            f"{where}: api_budget must be an APIBudget (e.g. api_budget=APIBudget(tokens=2_000_000)) or "
            f"None, got {type_name(budget)}"
        )
    return budget


def check_n(caller: str, n: Any) -> int | None:
    """``n`` of ``rollout``: None (one job, or one per data row) or a count."""
    if n is None:
        return None
    return check_int(n, what=f"{caller}(): n", low=0, fix="n is the number of rollouts, e.g. n=64")


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (``import interlens`` stays cheap)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _unknown_option(caller: str, name: str) -> ConfigurationTypeError:
    valid = ", ".join(OPTION_DEFAULTS)
    if caller in ("rollout", "arollout"):
        valid = f"n, {valid}"
    hint = _INSTEAD.get(name)
    if hint is None:
        close = closest_name(name, OPTION_DEFAULTS)
        hint = f"did you mean {close}=...?" if close else ""
    hint = f"; {hint}{'' if hint.endswith('?') else '.'}" if hint else "."
    return ConfigurationTypeError(
        f"{caller}() has no option {name!r}{hint} Its options are: {valid} (see help(interlens.run))."
    )


def _mode(where: str, mode: Any, batched: Any) -> ExecutionMode:
    from interlens.scheduler import ExecutionMode

    batched = check_bool(
        batched,
        what=f"{where}: batched",
        allow_none=True,
        fix="batched=False is the deterministic escape hatch (mode=ExecutionMode.DETERMINISTIC)",
    )
    if mode is None:
        return ExecutionMode.DETERMINISTIC if batched is False else ExecutionMode.BATCHED
    choices = (
        "ExecutionMode.BATCHED or ExecutionMode.DETERMINISTIC (or the strings 'batched', 'deterministic')"
    )
    if isinstance(mode, str) and not isinstance(mode, ExecutionMode):
        try:
            mode = ExecutionMode(mode.lower())
        except ValueError:
            raise ConfigurationError(f"{where}: mode must be {choices}, got {mode!r}") from None
    if not isinstance(mode, ExecutionMode):
        raise ConfigurationTypeError(f"{where}: mode must be {choices}, got {type_name(mode)}")
    if batched is not None and batched != (mode is ExecutionMode.BATCHED):
        raise ConfigurationError(
            f"{where}: batched={batched} contradicts mode=ExecutionMode.{mode.name}: deterministic mode "
            "generates every turn alone (it is batched=False), batched mode co-steps them. Pass one of the "
            "two: mode=ExecutionMode.DETERMINISTIC alone, or batched=True/False alone"
        )
    return mode


def prepare_out_dir(options: Options) -> None:
    """Create ``out_dir`` and prove it writable, or raise naming it; a refused path leaves nothing behind.

    Runs after every other check and before the run opens its ledger, so a path under a regular file, in a
    read-only or virtual filesystem (``/proc/...``) or without permission fails here, not half-way through.
    """
    path = None if options.run.out_dir is None else Path(options.run.out_dir)
    if path is None:
        return
    what = f"{options.caller}(): out_dir={str(path)!r}"
    fix = "choose a directory you can write to, or out_dir=None to keep results in memory"
    missing: list[Path] = []
    existing = path.absolute()
    try:
        while not existing.exists():
            missing.append(existing)
            existing = existing.parent
    except OSError as exc:
        raise ConfigurationError(f"{what} cannot be inspected ({exc}); {fix}") from None
    if not existing.is_dir():
        where = "is a file" if not missing else f"lies under {str(existing)!r}, which is a file"
        raise ConfigurationError(f"{what} {where}, not a directory; {fix}")
    created: list[Path] = []
    try:
        for directory in reversed(missing):
            directory.mkdir()
            created.append(directory)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".interlens-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        for directory in reversed(created):
            try:
                directory.rmdir()
            except OSError:
                pass
        reason = exc.strerror or str(exc)
        raise ConfigurationError(f"{what} cannot be created or written to ({reason}); {fix}") from None
