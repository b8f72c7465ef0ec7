"""The async rollout engine (installed as ``interlens.scheduler``). Never imports interlens' user modules.

The face is lazy (PEP 562): each name below loads the private module that defines it on first use, and is
kept in this module's globals. The contract (``_protocols``: jobs, engines, the execution mode) and the errors
(``_errors``) import nothing heavy, so the floors that only speak to the scheduler (``interlens._core``,
``engine``, ``providers``) load them alone; the run loop, the batcher and the process and Ray workers load
when a run starts.
"""

from __future__ import annotations

import typing

from ._lazy import lazy_face as _lazy_face

if typing.TYPE_CHECKING:
    from ._bridge import run_sync
    from ._config import RunConfig
    from ._devices import available_devices, check_ray_devices, validate_devices
    from ._errors import (
        BatchResultError,
        DeviceError,
        DuplicateJobError,
        EngineLoadError,
        JobPickleError,
        NoDeviceError,
        ParentCallError,
        SchedulerConfigError,
        SchedulerError,
        WorkerLostError,
        WorkerStartError,
    )
    from ._openmp import release_openmp_pool
    from ._outcome import ErrorInfo, JobOutcome, RunOutcome
    from ._placement import worker_device
    from ._protocols import (
        BatchCancelled,
        Engine,
        EngineSpec,
        ExecutionMode,
        Job,
        JobContext,
        JobResult,
        JobSpec,
        LineupSpec,
    )
    from ._run_jobs import run_jobs
    from ._worker import HOST_DEVICE
    from .gateway import (
        AdaptiveLimiter,
        APISpec,
        BatchPolicy,
        BatchRowError,
        Gateway,
        ProviderCallError,
        ProviderClient,
        RetryPolicy,
    )

#: Each exported name -> the module that defines it (the gateway's names: its own lazy face).
_EXPORTS: dict[str, str] = {
    "run_sync": "._bridge",
    "RunConfig": "._config",
    "available_devices": "._devices",
    "check_ray_devices": "._devices",
    "validate_devices": "._devices",
    "BatchResultError": "._errors",
    "DeviceError": "._errors",
    "DuplicateJobError": "._errors",
    "EngineLoadError": "._errors",
    "JobPickleError": "._errors",
    "NoDeviceError": "._errors",
    "ParentCallError": "._errors",
    "SchedulerConfigError": "._errors",
    "SchedulerError": "._errors",
    "WorkerLostError": "._errors",
    "WorkerStartError": "._errors",
    "release_openmp_pool": "._openmp",
    "ErrorInfo": "._outcome",
    "JobOutcome": "._outcome",
    "RunOutcome": "._outcome",
    "worker_device": "._placement",
    "BatchCancelled": "._protocols",
    "Engine": "._protocols",
    "EngineSpec": "._protocols",
    "ExecutionMode": "._protocols",
    "Job": "._protocols",
    "JobContext": "._protocols",
    "JobResult": "._protocols",
    "JobSpec": "._protocols",
    "LineupSpec": "._protocols",
    "run_jobs": "._run_jobs",
    "HOST_DEVICE": "._worker",
    "AdaptiveLimiter": ".gateway",
    "APISpec": ".gateway",
    "BatchPolicy": ".gateway",
    "BatchRowError": ".gateway",
    "Gateway": ".gateway",
    "ProviderCallError": ".gateway",
    "ProviderClient": ".gateway",
    "RetryPolicy": ".gateway",
}

__all__ = [
    "HOST_DEVICE",
    "APISpec",
    "AdaptiveLimiter",
    "BatchCancelled",
    "BatchPolicy",
    "BatchResultError",
    "BatchRowError",
    "DeviceError",
    "DuplicateJobError",
    "Engine",
    "EngineLoadError",
    "EngineSpec",
    "ErrorInfo",
    "ExecutionMode",
    "Gateway",
    "Job",
    "JobContext",
    "JobOutcome",
    "JobPickleError",
    "JobResult",
    "JobSpec",
    "LineupSpec",
    "NoDeviceError",
    "ParentCallError",
    "ProviderCallError",
    "ProviderClient",
    "RetryPolicy",
    "RunConfig",
    "RunOutcome",
    "SchedulerConfigError",
    "SchedulerError",
    "WorkerLostError",
    "WorkerStartError",
    "available_devices",
    "check_ray_devices",
    "release_openmp_pool",
    "run_jobs",
    "run_sync",
    "validate_devices",
    "worker_device",
]


__getattr__, __dir__ = _lazy_face(__name__, _EXPORTS)
