"""``RunConfig``: everything ``run_jobs`` needs besides the lineups, in one checked record.

One record, passed as one object from the user's call (``interlens.rollouts`` builds it from the checked
options) through ``run_jobs`` to the run, instead of the same sixteen names spelled again at every layer. Its
fields are the source of the user's run options too: ``interlens.rollouts`` derives its option names and
defaults from :func:`dataclasses.fields` of this record (plus the few options that are interlens' own), and
:meth:`~RunConfig.check` is the one checker of their values, refusing a bad one before anything is opened or
started with a message naming the user's call, the option and the fix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._errors import SchedulerConfigError
from ._protocols import ExecutionMode, WorkerInit

if TYPE_CHECKING:
    from .gateway import SpendGuard

__all__ = ["RunConfig"]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How one ``run_jobs`` call runs (keyword-only; every field has its default).

    ``devices``: one worker per entry (a repeated entry means two workers sharing a device; an inner list is a
    group of GPUs for one worker): in this process for a single device, else one spawned worker process per
    entry; None only with ``cluster="ray"``. ``out_dir``: the ledger directory (resumable: done jobs are
    skipped on a rerun unless ``resume=False``); None keeps everything in memory. ``max_batch_size``: slots
    per device worker; ``max_concurrency``: jobs at once in the host worker. ``max_attempts``: attempts per
    job when ``job.is_transient`` says a failure may pass, and how many times a job may lose its worker
    process before it is failed as the one that kills it. ``progress``: a bar (None: when interactive).
    ``versions``: package versions recorded with the run. ``max_batch_wait``: seconds a queued generation
    waits for company while some live job is busy with something the scheduler cannot see.
    ``worker_init``: picklable callables run once in each worker before its first job.
    ``worker_start_timeout``: seconds a worker process has to report ready. ``spend_guard``: the run's API
    budget, asked before each request or provider batch is sent. ``cluster``: None (this machine) or
    ``"ray"`` (the device workers are Ray actors).
    """

    devices: Sequence[str | Sequence[str]] | None = None
    out_dir: str | os.PathLike[str] | None = None
    resume: bool = True
    mode: ExecutionMode = ExecutionMode.BATCHED
    max_batch_size: int = 64
    max_concurrency: int = 256
    max_attempts: int = 3
    progress: bool | None = None
    versions: Mapping[str, str] = field(default_factory=dict)
    max_batch_wait: float = 0.05
    worker_init: Sequence[WorkerInit] = ()
    worker_start_timeout: float = 300.0
    spend_guard: SpendGuard | None = None
    cluster: str | None = None

    def check(self, *, where: str = "") -> None:
        """Refuse a value the run cannot use, naming the field and the fix (before anything is opened).

        The one checker of these fields: ``interlens.rollout``/``run`` build this record from the user's
        options and call it with ``where`` (``"rollout()"``), which starts every message, so the message names
        the user's call and option. A wrong type raises an error that is also a ``TypeError``. Whether
        ``devices`` may be None is the run's question (``run_jobs``: only with a cluster), not the field's.
        """
        say = _Say(where)
        _check_devices(say, self.devices)
        _check_out_dir(say, self.out_dir)
        say.flag("resume", self.resume, fix="resume=False starts a fresh ledger (the old one is moved aside)")
        if not isinstance(self.mode, ExecutionMode):
            say.wrong_type(
                "mode",
                "an ExecutionMode (ExecutionMode.BATCHED or ExecutionMode.DETERMINISTIC)",
                self.mode,
            )
        for name in ("max_batch_size", "max_concurrency", "max_attempts"):
            say.count(name, getattr(self, name))
        say.flag("progress", self.progress, allow_none=True, fix="None shows a bar when interactive")
        if not isinstance(self.versions, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.versions.items()
        ):
            # versions is filled in by the caller's code (interlens: the installed versions), never an option
            say.wrong_type("versions", "map str to str (package → version)", self.versions, verb="")
        say.seconds("max_batch_wait", self.max_batch_wait, positive=False)
        say.seconds("worker_start_timeout", self.worker_start_timeout, positive=True)
        if self.cluster not in (None, "ray"):
            say.bad_value(
                "cluster",
                "None (this machine) or 'ray' (a Ray cluster: RAY_ADDRESS, else a private local Ray "
                "instance; see docs/ray.md)",
                self.cluster,
            )


class _ConfigTypeError(SchedulerConfigError, TypeError):
    """A field of the wrong type (``except TypeError`` catches it; interlens raises its type-error twin)."""


class _Say:
    """Builds and raises the messages of :meth:`RunConfig.check`: ``"{where}: {field} must be ..."``."""

    def __init__(self, where: str) -> None:
        self.prefix = f"{where}: " if where else ""
        self.direct = not where  # a direct run_jobs call: the scheduler's own wording of seconds

    def wrong_type(
        self, name: str, rule: str, value: Any, *, fix: str = "", verb: str = "be ", got: str = ""
    ) -> None:
        hint = f"; {fix}" if fix else ""
        got = got or f"{value!r} ({type(value).__name__})"
        raise _ConfigTypeError(f"{self.prefix}{name} must {verb}{rule}, got {got}{hint}")

    def bad_value(self, name: str, rule: str, value: Any, *, fix: str = "", verb: str = "be ") -> None:
        hint = f"; {fix}" if fix else ""
        raise SchedulerConfigError(f"{self.prefix}{name} must {verb}{rule}, got {value!r}{hint}")

    def flag(self, name: str, value: Any, *, allow_none: bool = False, fix: str = "") -> None:
        if not isinstance(value, bool) and not (allow_none and value is None):
            self.wrong_type(name, "True, False or None" if allow_none else "True or False", value, fix=fix)

    def count(self, name: str, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            self.wrong_type(name, "an int >= 1", value)
        if value < 1:
            self.bad_value(name, "an int >= 1", value)

    def seconds(self, name: str, value: Any, *, positive: bool) -> None:
        bound = "> 0" if positive else ">= 0"
        if self.direct:
            what, rule = name, f"a number of seconds {bound}"
        else:  # "rollout(): max_batch_wait (seconds) must be a number >= 0", as interlens has always said
            what, rule = f"{name} (seconds)", f"a number {bound}"
        if not isinstance(value, int | float) or isinstance(value, bool):
            self.wrong_type(what, rule, value)
        if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
            self.bad_value(what, rule, value)


def _check_devices(say: _Say, devices: Any) -> None:
    if devices is None:
        return
    if isinstance(devices, str):
        say.wrong_type(
            "devices",
            "a list of device strings",
            devices,
            got=f"the string {devices!r}",
            fix=f"write devices=[{devices!r}]",
        )
    if not isinstance(devices, Sequence):
        say.wrong_type(
            "devices",
            "None (every visible GPU) or a list of device strings such as ['cuda:0', 'cuda:1']",
            devices,
        )
    # each entry is checked by validate_devices (it asks the machine), before anything runs


def _check_out_dir(say: _Say, out_dir: Any) -> None:
    if out_dir is None:
        return
    if not isinstance(out_dir, str | os.PathLike) or not isinstance(os.fspath(out_dir), str):
        say.wrong_type("out_dir", "a path (str or os.PathLike, e.g. pathlib.Path) or None", out_dir)
    text = os.fspath(out_dir)
    if not text.strip():
        say.bad_value(
            "out_dir",
            "name a directory",
            text,
            verb="",
            fix="pass a path such as out_dir='runs/x' for a resumable run, or leave out_dir=None to keep "
            "results in memory",
        )
