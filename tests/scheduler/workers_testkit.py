"""Jobs and engines for runs with worker processes: all of it pickles and imports in a worker.

A worker process imports this module by name (it is on the sys.path the parent hands over), so what the
tests read back — pids, batch sizes, what an init hook left behind — was produced in the worker for real.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from interlens.scheduler import (
    BatchPolicy,
    ExecutionMode,
    JobContext,
    JobResult,
    JobSpec,
    LineupSpec,
    RetryPolicy,
)

#: Filled by :func:`mark_init` in a worker (and read back through each job's analysis).
INIT_MARKS: list[str] = []
#: Engine names in the order their engines were evicted in this process (read back the same way).
EVICTED: list[str] = []
#: Set by a test, read in the parent (where the run's gateway lives): what a :class:`ParentSpec`'s calls run.
PARENT_CALLS: dict[str, Callable[[Any], Awaitable[Any]]] = {}


def mark_init() -> None:
    INIT_MARKS.append(f"init in {os.getpid()}")


def failing_init() -> None:
    raise ImportError("No module named 'missing_probe_lib'")


def hanging_init() -> None:
    time.sleep(3600)  # the worker never reports ready


class PidEngine:
    """Answers with its name, the request, its process id and the size of the batch it was part of."""

    def __init__(self, name: str) -> None:
        self.name = name

    def generate_batch(
        self, requests: Sequence[Any], *, mode: ExecutionMode, cancelled: threading.Event | None = None
    ) -> list[Any]:
        return [{"text": f"{self.name}({r})", "pid": os.getpid(), "batch": len(requests)} for r in requests]


@dataclass(frozen=True)
class PidEngineSpec:
    name: str = "m"

    @property
    def engine_key(self) -> str:
        return self.name

    def load_engine(self, device: str) -> PidEngine:
        return PidEngine(self.name)


@dataclass
class WorkerJob:
    """``turns`` generated turns, each recorded (so durable in the parent) before the next.

    ``checkpoint_at``: after that turn, on attempt 1 only, a gateway call to ``ParentSpec("checkpoint")``
    with ``(job_id, pid)`` (the test decides when it returns). ``kill_worker_at``: SIGKILL its own worker
    process at that turn, every attempt.
    ``noise``: print to stdout and write raw bytes to fds 1 and 2 first (none of it may reach the pipe).
    ``analysis_error``: on attempt 1 only, the analysis fails with ``RuntimeError(analysis_error)`` (as a
    rollout's analyzer's exception comes back: beside a finished conversation).
    """

    turns: int = 2
    engine: PidEngineSpec = field(default_factory=PidEngineSpec)
    needs_device: bool = True
    checkpoint_at: int | None = None
    kill_worker_at: int | None = None
    noise: bool = False
    analysis_error: str | None = None

    async def run(self, ctx: JobContext) -> JobResult:
        if self.noise:
            print(f"hello from {ctx.job_id}", flush=True)
            os.write(1, b"\x00\x00\x00\x08notapickle\n")
            os.write(2, b"\x00\x00\x01\x00stderr noise\n")
        turns = [dict(t) for t in ctx.committed_turns]
        for i in range(len(turns), self.turns):
            if i == self.kill_worker_at:
                os.kill(os.getpid(), signal.SIGKILL)
            out = await ctx.generate(self.engine, f"{ctx.job_id}:{i}")
            turn = {"index": i, "text": out["text"], "batch": out["batch"]}
            await ctx.record_turn(i, turn)
            turns.append(turn)
            if i == self.checkpoint_at and ctx.attempt == 1:
                await ctx.call_gateway(ParentSpec("checkpoint"), (ctx.job_id, os.getpid()))
        analysis = {
            "pid": os.getpid(),
            "attempt": ctx.attempt,
            "committed": len(ctx.committed_turns),
            "init": list(INIT_MARKS),
            "evicted": list(EVICTED),
        }
        if self.analysis_error is not None and ctx.attempt == 1:
            failed = RuntimeError(self.analysis_error)
            return JobResult(
                conversation={"turns": turns}, tokens_generated=len(turns), analysis_error=failed
            )
        return JobResult(conversation={"turns": turns}, tokens_generated=len(turns), analysis=analysis)

    def is_transient(self, exc: BaseException) -> bool:
        return False


@dataclass
class CallingJob:
    """Two concurrent gateway calls to ``ParentSpec("order")``, then one to ``ParentSpec(name)`` for each name
    in ``then``, one by one; returns every answer."""

    then: Sequence[str] = ()
    needs_device: bool = True

    async def run(self, ctx: JobContext) -> JobResult:
        answers: dict[str, Any] = {}

        async def ask(key: str) -> None:
            answers[key] = await ctx.call_gateway(ParentSpec("order"), (ctx.job_id, key))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "first")
            tg.start_soon(ask, "second")
        for name in self.then:
            answers[name] = await ctx.call_gateway(ParentSpec(name), (ctx.job_id, None))
        return JobResult(conversation={"answers": answers})

    def is_transient(self, exc: BaseException) -> bool:
        return False


@dataclass(frozen=True)
class _Final:
    """A failure the gateway does not retry (the ``Failure`` a provider adapter reports)."""

    retryable: bool = False
    rate_limited: bool = False
    retry_after: float | None = None


class ParentClient:
    """Stands in for a provider, in the parent: each request is handed to ``PARENT_CALLS[name]``."""

    provider = "parent"

    def __init__(self, name: str) -> None:
        self.name = name

    async def send(self, request: Any) -> Any:
        return await PARENT_CALLS[self.name](request)

    def classify(self, exc: BaseException) -> _Final:
        return _Final()

    async def aclose(self) -> None:
        pass


@dataclass(frozen=True)
class ParentSpec:
    """An ``APISpec`` of single requests, answered by the test's function in the parent (the gateway's
    process), so a job in a worker process can wait on, or fail by, something the test controls."""

    name: str
    max_in_flight: int = 64
    retry_policy: RetryPolicy = field(default_factory=RetryPolicy)
    batch_policy: BatchPolicy = field(default_factory=BatchPolicy)
    batch_key: None = None
    model_id: str = "parent"

    @property
    def client_key(self) -> tuple[str, str]:
        return ("parent", self.name)

    def open_client(self) -> ParentClient:
        return ParentClient(self.name)


@dataclass
class LockedJob(WorkerJob):
    """Holds a lock: it cannot be pickled, so it cannot reach a worker process."""

    lock: Any = field(default_factory=threading.Lock)


def lineup(name: str, jobs: Sequence[Any]) -> LineupSpec:
    specs = [JobSpec(f"{name}/{i:04d}", name, seed=i, job=job, row_index=i) for i, job in enumerate(jobs)]
    return LineupSpec(name=name, fingerprint=f"fp-{name}", jobs=iter(specs), n_jobs=len(specs))


def one_slot_worker(where: Any, mode: ExecutionMode = ExecutionMode.BATCHED) -> Any:
    """A worker process of one job slot and batches of one (``where``: a device or a ``WorkerPlan``), for
    tests that drive a ``SubprocessWorker`` directly."""
    from interlens.scheduler.workers._subprocess import SubprocessWorker

    return SubprocessWorker(
        where,
        capacity=1,
        mode=mode,
        max_batch_size=1,
        max_batch_wait=0.05,
        hooks=b"",
        start_timeout=60,
    )


def children() -> set[int]:
    """Pids of this process's live (or unreaped) child processes, read from /proc."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.add(int(entry))
    return found


def exited(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not necessarily our child) has exited, waiting up to ``timeout`` seconds.

    Waits on a pidfd, which becomes readable when the process exits: no polling, no sleeping.
    """
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


@dataclass
class EnvJob:
    """Reports what its worker process sees: visible GPUs, thread settings, its device (and torch's threads
    when ``torch_threads``, which imports torch in the worker)."""

    torch_threads: bool = False
    needs_device: bool = True

    async def run(self, ctx: JobContext) -> JobResult:
        from interlens.scheduler import worker_device

        seen: dict[str, Any] = {
            "pid": os.getpid(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "worker_device": worker_device(),
            "ctx_device": ctx.device,
        }
        if self.torch_threads:
            import torch

            seen["torch_threads"] = torch.get_num_threads()
            seen["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
            seen["cublas_workspace"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            seen["cublaslt_workspace"] = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
            seen["env_at_start"] = _start_env("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
        return JobResult(conversation={}, analysis=seen)

    def is_transient(self, exc: BaseException) -> bool:
        return False


def _start_env(*names: str) -> dict[str, str | None]:
    """The process's environment as it was spawned (Linux keeps it in /proc/self/environ; later changes to
    os.environ do not show there): what the worker had before its torch loaded."""
    with open("/proc/self/environ", "rb") as start:
        pairs = dict(p.decode().partition("=")[::2] for p in start.read().split(b"\0") if p)
    return {name: pairs.get(name) for name in names}


class FaultyEngine:
    """Raises ``RuntimeError(error)`` from every batch, as a broken CUDA kernel or a full GPU would."""

    def __init__(self, error: str) -> None:
        self.error = error

    def generate_batch(
        self, requests: Sequence[Any], *, mode: ExecutionMode, cancelled: threading.Event | None = None
    ) -> list[Any]:
        raise RuntimeError(self.error)


@dataclass(frozen=True)
class FaultyEngineSpec(PidEngineSpec):
    """A :class:`FaultyEngine`; each load appends the loading process's pid to the file ``log``."""

    error: str = "CUDA error: device-side assert triggered"
    log: str = ""

    def load_engine(self, device: str) -> Any:
        if self.log:
            with open(self.log, "a") as fh:
                fh.write(f"{os.getpid()}\n")
        return FaultyEngine(self.error)


class EvictableEngine(PidEngine):
    """Records its eviction; answers as "evicted" afterwards (it must never be asked again)."""

    def evict(self) -> None:
        EVICTED.append(self.name)
        self.name = "evicted"


@dataclass(frozen=True)
class EvictableSpec(PidEngineSpec):
    def load_engine(self, device: str) -> EvictableEngine:
        return EvictableEngine(self.name)


class Weights:
    """Stands in for half-loaded weights (weakly referenced by :data:`HALF_LOADED`)."""


#: Weak references to what a failed :class:`HalfLoadSpec` load held when it failed.
HALF_LOADED: list[Any] = []


@dataclass(frozen=True)
class HalfLoadSpec(PidEngineSpec):
    """Its load fails after it allocated its weights, as a load that runs out of memory halfway does."""

    def load_engine(self, device: str) -> PidEngine:
        import weakref

        weights = Weights()
        HALF_LOADED.append(weakref.ref(weights))
        raise MemoryError(f"ran out of memory loading {self.name} on {device}")


@dataclass
class GcJob:
    """Collects garbage, then reports whether the failed load's weights are still alive."""

    needs_device: bool = True

    async def run(self, ctx: JobContext) -> JobResult:
        import gc

        gc.collect()
        return JobResult(conversation={}, analysis={"alive": [ref() is not None for ref in HALF_LOADED]})

    def is_transient(self, exc: BaseException) -> bool:
        return False
