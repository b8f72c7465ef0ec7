"""The async rollout engine (installed as ``interlens.scheduler``). Never imports interlens' user modules."""

from ._protocols import Engine, EngineSpec, ExecutionMode, Job, JobContext, JobResult, JobSpec, LineupSpec

__all__ = [
    "Engine",
    "EngineSpec",
    "ExecutionMode",
    "Job",
    "JobContext",
    "JobResult",
    "JobSpec",
    "LineupSpec",
]
