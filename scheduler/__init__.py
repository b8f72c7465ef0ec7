"""The async rollout engine (installed as ``interlens.scheduler``). Never imports interlens' user modules."""

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
