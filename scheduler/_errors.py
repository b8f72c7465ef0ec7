"""Every error the scheduler raises on purpose, in one place.

The hierarchy::

    SchedulerError                  base of everything below
    ├── SchedulerConfigError        bad input to run_jobs (also a ValueError); raised before work starts
    │   ├── DeviceError             a device string that does not exist on this machine
    │   └── DuplicateJobError       two lineups with one name, or one job id pulled twice in a run
    ├── EngineLoadError             ``EngineSpec.load_engine`` raised; fails the jobs that needed it
    ├── BatchResultError            ``Engine.generate_batch`` returned the wrong number of results
    ├── NoDeviceError               a job with ``needs_device=False`` called ``ctx.generate``
    ├── WorkerStartError            a worker process could not start (bad device, import error, init hook)
    ├── WorkerLostError             a job's worker process died under it (recorded on the job, not raised)
    ├── JobPickleError              a job cannot be sent to (or rebuilt in) a worker process
    ├── ParentCallError             a worker's call to the parent (a gateway call, a turn to record) failed
    │                               with an exception that cannot be sent back over the pipe as itself
    └── ProviderCallError           a hosted-model call failed for good (the API gateway's, defined there)

    BatchCancelled                  an engine stopped a batch because its ``cancelled`` event was set (an
                                    Exception of the engine contract, not a failure: never reaches a job)

The API gateway's own row error (``BatchRowError``: one row of a provider batch failed) is the gateway's
and lives with it. The scheduler never imports interlens, so these are its own classes; interlens translates
them at its boundary (``DeviceError`` here corresponds to ``interlens.DeviceError``).
"""

from __future__ import annotations

__all__ = [
    "BatchCancelled",
    "BatchResultError",
    "DeviceError",
    "DuplicateJobError",
    "EngineLoadError",
    "JobPickleError",
    "NoDeviceError",
    "ParentCallError",
    "SchedulerConfigError",
    "SchedulerError",
    "WorkerLostError",
    "WorkerStartError",
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


class WorkerStartError(SchedulerError):
    """A worker process could not start: it died, timed out, or its set-up (imports, init hooks) raised."""


class WorkerLostError(SchedulerError):
    """A worker process died while running a job. Stored as the job's error type when it fails for good."""


class JobPickleError(SchedulerError):
    """A job could not be pickled for a worker process, or could not be unpickled there."""


class ParentCallError(SchedulerError):
    """A worker's call to the parent raised an exception that could not be sent back as itself."""


class BatchCancelled(Exception):
    """Raised by an engine that stopped a batch because its ``cancelled`` event was set."""
