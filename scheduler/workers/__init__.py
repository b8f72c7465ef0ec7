"""The process seam: device workers that run in another process (spawned here, or a Ray actor).

A run on one device keeps everything in this process (``_worker.InProcessWorker``). A run on several devices,
or on a Ray cluster, puts each device worker in a process of its own; everything that takes is here, so the
rest of the scheduler (placement, retries, the ledger, the gateway) sees only a ``Worker`` and never a pipe:

    ``_subprocess``      :class:`SubprocessWorker`, the parent's end: spawns the process (or, given a
                         ``launch``, an actor), hands it jobs, answers its calls, buries it when it dies
    ``_worker_process``  the worker's end (``python -c ... main()``, or ``serve`` inside an actor): an
                         ``InProcessWorker`` of its own, serving the jobs the parent sends
    ``_wire``            every message between the two ends, their framing and the calls with ids
    ``_ray_worker``      ``cluster="ray"``: the same two ends carried over Ray actor calls

Imported only when a run starts worker processes (``_pool.open_workers``), so ``import interlens`` and a
single-device run never load it. A worker process imports its modules by these paths
(``interlens.scheduler.workers._worker_process``); parent and worker are always the same installed code.
"""

from ._ray_worker import RaySession, launcher, ray_plans
from ._subprocess import Launch, Link, SubprocessWorker, spawn_process
from ._worker_process import bootstrapping

__all__ = [
    "Launch",
    "Link",
    "RaySession",
    "SubprocessWorker",
    "bootstrapping",
    "launcher",
    "ray_plans",
    "spawn_process",
]
