"""What each worker process sees: its GPU(s) as ``cuda:0..k-1``, its share of the CPU cores.

Why: a worker that sees every GPU has ``cuda:0`` as its current device, so whatever defaults to "cuda" (an
init hook, module-level code of the main script that every worker re-imports, a library using the current
device) would land on GPU 0 in all eight processes of an 8-GPU node. So each CUDA worker is spawned with
``CUDA_VISIBLE_DEVICES`` naming only its device(s), and inside it they are ``cuda:0`` (``cuda:0..k-1`` for a
group). Likewise several CPU workers would each start one torch thread per core and fight over them: each
gets ``cores // cpu_workers`` threads (``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` for the spawn, and
``torch.set_num_threads`` in the worker). A thread count the user set in ``OMP_NUM_THREADS`` is kept.

Workers that share a GPU (``devices=["cuda:0", "cuda:0"]``) each get an equal share of its memory
(:attr:`WorkerPlan.memory_fraction`, applied with ``torch.cuda.set_per_process_memory_fraction`` before the
init hooks): otherwise each reads the whole device's free memory as its own budget and an out-of-memory
caused by the other is learnt as its own ceiling. CUDA workers also start with the caching allocator's
``expandable_segments`` (static KV caches of changing sizes fragment fixed segments), unless the user set the
allocator's configuration.

A device GROUP is one worker over several GPUs (one model split across them with ``device_map="auto"``):
written ``["cuda:0", "cuda:1"]`` in ``devices`` and named ``"cuda:0,cuda:1"`` everywhere else (the ledger,
``ctx.device``, ``load_engine``). :func:`worker_device` tells code in a worker (an init hook) its device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from interlens.store import SecretGuard

__all__ = [
    "DETERMINISTIC_CUDA_ENV",
    "WORKER_CREDENTIALS",
    "WorkerPlan",
    "group_members",
    "plan_workers",
    "set_worker_device",
    "worker_device",
]

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: The caching allocator's configuration (the second is torch's newer name): one set by the user is kept.
_ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_device: str | None = None

#: A CUDA worker of a deterministic run starts with cuBLAS's split-K off: a fixed small workspace for cuBLAS
#: and none for cuBLASLt, so a matrix product's reduction order is set by its shape, not by the workspace the
#: heuristics had (vLLM's batch-invariant mode does the same on Hopper). Both are read once, when cuBLAS
#: starts, and hold for the whole process: hence a worker process of its own, with them in its environment
#: before torch loads. These values override the parent's (the verdicts on disk are keyed by them).
DETERMINISTIC_CUDA_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def worker_device() -> str | None:
    """The device of the worker this code runs in, as the worker addresses it; None outside a worker.

    In a CUDA worker process that is ``"cuda:0"`` (its one visible GPU; ``"cuda:0,cuda:1"`` for a group of
    two), so an init hook can load a probe with ``.to(interlens.worker_device())``. In a single-device run
    (no worker process) it is that device while the init hooks run and jobs run.
    """
    return _device


def set_worker_device(device: str | None) -> None:
    global _device
    _device = device


def group_members(device: str) -> list[str]:
    """``"cuda:0,cuda:1"`` -> ``["cuda:0", "cuda:1"]``; a single device -> ``[device]``."""
    return device.split(",")


@dataclass(frozen=True)
class WorkerPlan:
    """How one worker process is started.

    ``device``: its name in the parent (placement, the ledger). ``inner``: the name the worker uses, after
    ``CUDA_VISIBLE_DEVICES`` renumbered its GPUs from 0. ``env``: variables set on top of the parent's.
    ``threads``: torch threads in the worker (None: torch's default). ``memory_fraction``: the share of each
    of its GPUs' memory it may allocate, where workers share a GPU (None: the whole device).
    """

    device: str
    inner: str
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    memory_fraction: float | None = None

    def deterministic(self) -> WorkerPlan:
        """This plan for a deterministic run: a CUDA worker gets :data:`DETERMINISTIC_CUDA_ENV` (a CPU worker
        is unchanged: its kernels read no such setting)."""
        if not self.inner.startswith("cuda"):
            return self
        return replace(self, env={**self.env, **DETERMINISTIC_CUDA_ENV})

    def process_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The complete environment of the spawned process: ``base`` (the parent's) plus :attr:`env`, less its
        credential-looking variables (API keys: the parent's gateway makes every API call, so a worker has
        no use for one) except :data:`WORKER_CREDENTIALS`, which the worker loads weights with."""
        dropped = {name for name in SecretGuard(base).names if name not in WORKER_CREDENTIALS}
        return {**{k: v for k, v in base.items() if k not in dropped}, **self.env}


#: Credentials a worker needs itself: the Hugging Face Hub token loads gated weights (Llama, Gemma).
WORKER_CREDENTIALS = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})


def plan_workers(
    devices: Sequence[str], *, cores: int | None = None, environ: Mapping[str, str] | None = None
) -> list[WorkerPlan]:
    """One :class:`WorkerPlan` per entry of ``devices`` (already validated), for worker processes.

    ``cores``: the CPU cores this process may use (default: its affinity mask). ``environ``: the parent's
    environment (default ``os.environ``); a ``CUDA_VISIBLE_DEVICES`` already set there is honoured, so
    ``cuda:1`` of a parent that sees ``"4,5"`` is physical GPU 5.
    """
    environ = os.environ if environ is None else environ
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cpu_workers = sum(1 for d in devices if d == "cpu")
    threads = None
    if cpu_workers and not any(environ.get(var) for var in _THREAD_VARS):
        threads = max(1, cores // cpu_workers)
    plans = [_plan_one(d, threads=threads, environ=environ) for d in devices]
    sharing: dict[str, int] = {}  # physical GPU -> the workers that use it
    for plan in plans:
        for gpu in _physical(plan):
            sharing[gpu] = sharing.get(gpu, 0) + 1
    shared = []
    for plan in plans:
        most = max((sharing[gpu] for gpu in _physical(plan)), default=1)
        shared.append(replace(plan, memory_fraction=1 / most) if most > 1 else plan)
    return shared


def _physical(plan: WorkerPlan) -> list[str]:
    visible = plan.env.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else []


def _plan_one(device: str, *, threads: int | None, environ: Mapping[str, str]) -> WorkerPlan:
    if device == "cpu":
        if threads is None:
            return WorkerPlan(device, device)
        env = dict.fromkeys(_THREAD_VARS, str(threads))
        return WorkerPlan(device, device, env, threads)
    members = group_members(device)
    if not all(m.startswith("cuda") for m in members):
        return WorkerPlan(device, device)  # "mps": one per machine, nothing to hide
    indices = [int(m.partition(":")[2] or 0) for m in members]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        parent = [v.strip() for v in visible.split(",") if v.strip()]
        physical = [parent[i] if i < len(parent) else str(i) for i in indices]
    else:
        physical = [str(i) for i in indices]
    inner = ",".join(f"cuda:{k}" for k in range(len(indices)))
    env = {"CUDA_VISIBLE_DEVICES": ",".join(physical)}
    if not any(environ.get(var) for var in _ALLOC_VARS):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return WorkerPlan(device, inner, env)
