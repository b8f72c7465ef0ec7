"""Errors the scheduler raises on purpose.

The hierarchy::

    SchedulerError                  base of everything below
    ├── SchedulerConfigError        bad input to run_jobs (also a ValueError); raised before work starts
    │   ├── DeviceError             a device string that does not exist on this machine
    │   └── DuplicateJobError       two lineups with one name, or one job id pulled twice in a run
    ├── EngineLoadError             ``EngineSpec.load_engine`` raised; fails the jobs that needed it
    ├── BatchResultError            ``Engine.generate_batch`` returned the wrong number of results
    └── NoDeviceError               a job with ``needs_device=False`` called ``ctx.generate``

The scheduler never imports interlens, so these are its own classes; interlens translates them at its
boundary (``DeviceError`` here corresponds to ``interlens.DeviceError``).
"""

from __future__ import annotations

__all__ = [
    "BatchResultError",
    "DeviceError",
    "DuplicateJobError",
    "EngineLoadError",
    "NoDeviceError",
    "SchedulerConfigError",
    "SchedulerError",
]


class SchedulerError(Exception):
    """Base class of every error the scheduler raises on purpose."""


class SchedulerConfigError(SchedulerError, ValueError):
    """Bad input to ``run_jobs``: raised as early as it can be detected, before any job starts."""


class DeviceError(SchedulerConfigError):
    """A device string that does not exist on this machine."""


class DuplicateJobError(SchedulerConfigError):
    """Two lineups share a name, or a job id occurs twice in one run."""


class EngineLoadError(SchedulerError):
    """Loading an engine failed; raised from ``ctx.generate`` to every job that needs that engine."""


class BatchResultError(SchedulerError):
    """An engine's ``generate_batch`` broke its contract (one result per request, in order)."""


class NoDeviceError(SchedulerError):
    """A job declared ``needs_device=False`` but asked for a local-model generation."""
