"""``RunConfig``: everything ``run_jobs`` needs besides the lineups, in one checked record.

One record, passed as one object from the user's call (``interlens.rollouts`` builds it from the checked
options) through ``run_jobs`` to the run, instead of the same sixteen names spelled again at every layer. Its
:meth:`~RunConfig.check` refuses a bad value before anything is opened or started, naming the field and the
fix; the interlens layer has already checked the user's spelling of each, so these messages are for direct
users of the scheduler.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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

    def check(self) -> None:
        """Refuse a value the run cannot use, naming the field and the fix (before anything is opened)."""
        if not isinstance(self.mode, ExecutionMode):
            raise SchedulerConfigError(f"mode must be an ExecutionMode, got {self.mode!r}")
        for name in ("max_batch_size", "max_concurrency", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SchedulerConfigError(f"{name} must be an int >= 1, got {value!r}")
        wait = self.max_batch_wait
        if not isinstance(wait, int | float) or isinstance(wait, bool) or wait < 0:
            raise SchedulerConfigError(f"max_batch_wait must be a number of seconds >= 0, got {wait!r}")
        if not isinstance(self.versions, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.versions.items()
        ):
            raise SchedulerConfigError(
                f"versions must map str to str (package → version), got {self.versions!r}"
            )
        if self.out_dir is not None and not isinstance(self.out_dir, str | os.PathLike):
            raise SchedulerConfigError(
                f"out_dir must be a path (str or os.PathLike) or None, got {self.out_dir!r}"
            )
        timeout = self.worker_start_timeout
        if not isinstance(timeout, int | float) or not timeout > 0:
            raise SchedulerConfigError(f"worker_start_timeout must be seconds > 0, got {timeout!r}")
        if self.cluster not in (None, "ray"):
            raise SchedulerConfigError(f"cluster must be None (this machine) or 'ray', got {self.cluster!r}")
        if self.cluster is None and self.devices is None:
            raise SchedulerConfigError("devices must be a list of devices (None only with cluster='ray')")
