"""``cluster="ray"``: device workers as Ray actors, both ends of the actor link in one module.

Why Ray and not a protocol of our own: a researcher who outgrows one node usually has a Ray cluster (or can
start one on a SLURM allocation), and Ray already places actors on GPUs across nodes, ships code and notices
a dead node. Only the TRANSPORT changes: an actor (:class:`WorkerActor`) runs ``_worker_process.serve``, the
very worker end a spawned process runs (an ``InProcessWorker``, its batcher and engines), and the parent
drives it with ``_subprocess.SubprocessWorker`` (handshake, calls, gate, burial and retry of a dead worker),
given :func:`launcher`'s ``launch``. The messages are ``_wire``'s, pickled exactly as on the pipe; a Ray
call carries a list of them:

    parent → actor   ``down(seq, frames)``   the messages sent in one turn of the parent's loop (the answers
                                               to a batch's turns), in order: the actor queues them by ``seq``
                                               (Ray does not promise an async actor starts calls in order)
    actor → parent   ``uplink()``             one streaming generator per actor, each item the frames sent
                                               since the last one; the parent pulls (no actor lives in it)

So the parent keeps its roles: the only ledger writer (turns come up as ``TurnCall``), the only holder of API
keys and the gateway (``GatewayCall``), placement and retries. Actors run with ``max_restarts=0`` and
``max_task_retries=0``: a Ray restart or retry would hide a death and re-send API turns; instead a lost actor
(``ray.kill``, a crash, its node gone) ends its uplink with ``RayActorError``, its attempts end as
``worker_lost`` and the slot starts a fresh actor, wherever Ray places it. A ``Fatal`` note sent just before
a poisoned actor exits may not arrive: its attempts are lost all the same.

:class:`RaySession` connects: to an initialized Ray, else ``RAY_ADDRESS`` (with ``RAY_AUTH_MODE=token``
unless set, when Ray is not imported yet: Ray reads it at import, and a 2.60 cluster wants a token), else a
private local instance started without the credential-looking variables of this environment (its processes,
actors included, never see an API key); it shuts Ray down only if it initialized it. :func:`ray_plans` turns
``devices`` into actors: one per GPU of the cluster by default (``num_gpus=1``: ``cuda:0`` inside), or
``"cpu"``/``"cuda"`` entries, CPU actors with ``CUDA_VISIBLE_DEVICES=""``. ``ray`` is imported only here,
only when asked for.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import os
import pickle
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any

import anyio

from interlens.store import SecretGuard

from .._errors import DeviceError, SchedulerConfigError, WorkerStartError
from .._placement import DETERMINISTIC_CUDA_ENV, WORKER_CREDENTIALS, WorkerPlan
from ._subprocess import Launch
from ._wire import Init, Message

__all__ = ["RayPlan", "RaySession", "WorkerActor", "actor_options", "launcher", "ray_plans"]


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise SchedulerConfigError(
            f"cluster='ray' needs Ray, which cannot be imported here ({exc}); install it with "
            "`pip install 'interlens[ray]'` (the same Ray version as the cluster's)"
        ) from exc
    return ray


# --- which actors ---


@dataclass(frozen=True)
class RayPlan:
    """One actor: the worker's plan (its name in the parent, ``cuda:0``/``cpu`` inside) and Ray's options."""

    worker: WorkerPlan
    options: dict[str, Any] = field(default_factory=dict)


def ray_plans(devices: list[str] | None, resources: Mapping[str, float]) -> list[RayPlan]:
    """The actors of a run on a cluster with ``resources`` (``ray.cluster_resources()``)."""
    gpus, cpus = int(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    kinds = devices if devices is not None else (["cuda"] * gpus if gpus else ["cpu"])
    n_gpu, n_cpu = kinds.count("cuda"), kinds.count("cpu")
    if n_gpu > gpus:
        raise DeviceError(
            f"devices asks for {n_gpu} GPU workers but the Ray cluster has {gpus} GPU(s); ask for at most "
            f"{gpus}, or devices=None for one worker per GPU"
        )
    # Each GPU actor holds one CPU; CPU actors share the rest (at most one each), so every actor fits.
    cpu_share = min(1.0, max(cpus - n_gpu, 0.0) / n_cpu) if n_cpu else 0.0
    if n_cpu and cpu_share <= 0:
        raise DeviceError(
            f"the Ray cluster has {cpus:g} CPU(s), none left for {n_cpu} CPU worker(s) beside {n_gpu} GPU "
            "worker(s); ask for fewer workers"
        )
    plans = []
    for i, kind in enumerate(kinds):
        name = f"ray/{kind}:{i}"
        if kind == "cuda":  # Ray sets CUDA_VISIBLE_DEVICES to the one GPU it gives the actor
            plans.append(RayPlan(WorkerPlan(name, "cuda:0"), {"num_gpus": 1, "num_cpus": 1}))
        else:  # num_gpus=0 would inherit the node's CUDA_VISIBLE_DEVICES: the actor sets it (``open``)
            env = {"CUDA_VISIBLE_DEVICES": ""}
            plans.append(RayPlan(WorkerPlan(name, "cpu", env), {"num_cpus": cpu_share}))
    return plans


def actor_options(plan: RayPlan, worker: WorkerPlan) -> dict[str, Any]:
    """Ray's options for ``plan``'s actor started as ``worker`` (the plan its slot launches: a
    deterministic run's CUDA worker adds ``DETERMINISTIC_CUDA_ENV``). Those variables go in the actor's
    ``runtime_env``: cuBLAS reads them once, when it starts in a process, and Ray may hand an actor a
    worker process it keeps started (one where a task already ran cuBLAS), so setting them in
    :meth:`WorkerActor.open` could come too late; with a ``runtime_env`` of its own the actor gets a fresh
    process with them from its start (about a second more, only for deterministic CUDA actors). Nothing
    else goes there: the other variables (never an API key: ``WorkerPlan.env`` holds none) are set by
    ``open``."""
    options = dict(plan.options)
    start = {name: worker.env[name] for name in DETERMINISTIC_CUDA_ENV if name in worker.env}
    if start:
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **start}
        options["runtime_env"] = runtime_env
    return options


# --- connecting ---


class RaySession:
    """Ray for one run: joined if initialized, else ``RAY_ADDRESS``, else a private local instance."""

    def __init__(self) -> None:
        self._ours = False
        self.where = ""

    def __enter__(self) -> RaySession:
        address = os.environ.get("RAY_ADDRESS", "").strip()
        if address and "ray" not in sys.modules:  # Ray reads it once, at import
            os.environ.setdefault("RAY_AUTH_MODE", "token")  # else a token-auth cluster refuses the driver
        ray = _ray()
        if ray.is_initialized():
            self.where = "the Ray this process had already initialized"
            return self
        quiet = {"logging_level": logging.WARNING}
        try:
            if address:
                ray.init(address=address, **quiet)
                self.where = f"the Ray cluster at RAY_ADDRESS={address!r}"
            else:
                with _without_credentials():
                    ray.init(address="local", include_dashboard=False, log_to_driver=False, **quiet)
                self.where = "a private local Ray instance"
        except Exception as exc:
            where = f"the Ray cluster at RAY_ADDRESS={address!r}" if address else "a local Ray instance"
            raise WorkerStartError(
                f"cluster='ray' could not connect to {where}: {type(exc).__name__}: {exc}. Is the cluster up "
                "(`ray status`), are Ray and Python the same versions here and there, and, for a cluster "
                "with token auth (Ray's default), is RAY_AUTH_MODE=token set before Ray is imported?"
            ) from exc
        self._ours = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ours:
            self._ours = False
            _ray().shutdown()

    def resources(self) -> dict[str, float]:
        return dict(_ray().cluster_resources())


@contextmanager
def _without_credentials() -> Iterator[None]:
    """The local instance's processes (its actors too) inherit this environment: not its API keys (the
    parent's gateway makes every API call), but the Hub token the actors load weights with."""
    guard = SecretGuard()
    names = [n for n in guard.names if not n.startswith("RAY_") and n not in WORKER_CREDENTIALS]
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# --- the parent's end ---


def launcher(plan: RayPlan, *, start_timeout: float) -> Launch:
    """The ``launch`` of a ``SubprocessWorker`` whose workers are Ray actors made from ``plan`` (started as
    the worker plan the slot gives: :func:`actor_options`)."""

    async def launch(worker: WorkerPlan) -> _ActorLink:
        actor = _actor_class().options(**actor_options(plan, worker)).remote()
        try:
            with anyio.fail_after(start_timeout):  # an actor Ray cannot place waits forever
                pid, node = await actor.open.remote(worker.env)
        except BaseException as exc:
            _kill(actor)
            if not isinstance(exc, Exception):  # cancelled: the run is stopping
                raise
            if not isinstance(exc, TimeoutError):
                raise WorkerStartError(
                    f"the Ray actor for {plan.worker.device!r} could not start: {type(exc).__name__}: {exc}"
                ) from exc
            raise WorkerStartError(
                f"the Ray actor for {plan.worker.device!r} was not started within {start_timeout:g} s "
                f"(worker_start_timeout): the cluster may lack what it asks for ({plan.options}); "
                "`ray status` shows what is free"
            ) from None
        name = f"the Ray actor for device {plan.worker.device!r} (pid {pid} on {node})"
        return _ActorLink(actor, pid, name)

    return launch


def _kill(actor: Any) -> None:
    """End the actor now (idempotent: a dead actor, or Ray already shut down, is left as it is)."""
    try:
        _ray().kill(actor, no_restart=True)
    except Exception:
        pass


@functools.cache
def _actor_class() -> Any:
    return _ray().remote(max_restarts=0, max_task_retries=0)(WorkerActor)


class _ActorChannel:
    """The parent's end of one actor: ``down`` calls in sequence, the uplink generator pulled."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self._seq = count()
        self._uplink = actor.uplink.options(num_returns="streaming").remote()
        self._received: deque[Message] = deque()
        self.ended: str | None = None  # why the uplink ended (the actor died, or was stopped)
        self._batch: tuple[list[bytes], asyncio.Future[None]] | None = None  # frames for the next down call

    async def send(self, *messages: Message) -> None:
        """Messages sent in one turn of the event loop (the answers to a batch's turns) share one call."""
        frames = [pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages]  # may raise: none sent
        if self._batch is None:
            self._batch = ([], asyncio.get_running_loop().create_future())
            asyncio.get_running_loop().call_soon(self._ship)
        self._batch[0].extend(frames)
        await asyncio.shield(self._batch[1])  # a cancelled sender leaves the call (and the others) be

    def _ship(self) -> None:
        assert self._batch is not None
        (frames, done), self._batch = self._batch, None
        ref = self._actor.down.remote(next(self._seq), frames)
        asyncio.get_running_loop().create_task(self._shipped(ref, done))

    @staticmethod
    async def _shipped(ref: Any, done: asyncio.Future[None]) -> None:
        try:
            await ref
        except _ray().exceptions.RayError as exc:
            done.set_exception(anyio.BrokenResourceError(f"the actor is gone: {type(exc).__name__}"))
            done.exception()  # retrieved here: the senders may all have been cancelled meanwhile
        except BaseException:
            done.cancel()
            raise
        else:
            done.set_result(None)

    async def recv(self) -> Message | None:
        ray = _ray()
        while not self._received:
            if self.ended is not None:
                return None
            try:
                frames = await (await self._uplink.__anext__())
            except StopAsyncIteration:
                self.ended = "its uplink ended"
                return None
            except ray.exceptions.RayError as exc:
                self.ended = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip()
                return None
            self._received.extend(pickle.loads(frame) for frame in frames)
        return self._received.popleft()

    async def send_eof(self) -> None:
        """The parent is done with this worker: the actor is killed (its uplink then ends)."""
        _kill(self._actor)

    async def aclose(self) -> None:
        ray = _ray()
        try:
            ray.cancel(self._uplink)
        except Exception:
            pass
        _kill(self._actor)


class _ActorLink:
    def __init__(self, actor: Any, pid: int, name: str) -> None:
        self._conn = _ActorChannel(actor)
        self._actor = actor
        self._pid = pid
        self._name = name

    @property
    def conn(self) -> _ActorChannel:
        return self._conn

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def name(self) -> str:
        return self._name

    async def stop(self, *, grace: float) -> str:
        _kill(self._actor)
        return f"Ray actor ended: {self._conn.ended or 'stopped'}"


# --- the actor's end ---


class _ActorEnd:
    """What ``_worker_process.serve`` sees in an actor: a channel whose ends are the actor's two methods."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def send(self, *messages: Message) -> None:
        frames = [pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages]  # may raise: none sent
        for frame in frames:
            self.outbox.put_nowait(frame)

    async def recv(self) -> Message | None:
        return await self.inbox.get()

    async def send_eof(self) -> None:
        self.outbox.put_nowait(None)

    async def aclose(self) -> None:
        self.outbox.put_nowait(None)


class WorkerActor:
    """The Ray actor (decorated with ``ray.remote`` when launched): a worker process's end, over Ray calls."""

    def __init__(self) -> None:
        self._end: _ActorEnd | None = None
        self._next = 0
        self._held: dict[int, list[bytes]] = {}
        self._task: asyncio.Task[None] | None = None

    async def open(self, env: Mapping[str, str]) -> tuple[int, str]:
        """Set ``env``, start serving (the parent's ``Init`` comes next); return the pid and node address.

        ``env`` is set here, before the worker imports anything, not as Ray's ``runtime_env``: an actor with
        its own ``runtime_env`` cannot use the worker processes Ray keeps started, and starting one costs
        about a second. CUDA reads ``CUDA_VISIBLE_DEVICES`` when it initializes, after this. (Only a
        deterministic CUDA actor's cuBLAS settings are in its ``runtime_env`` too: :func:`actor_options`.)"""
        import ray

        os.environ.update(env)
        self._end = _ActorEnd()
        self._task = asyncio.get_running_loop().create_task(self._serve(self._end))
        return os.getpid(), ray.util.get_node_ip_address()

    async def _serve(self, end: _ActorEnd) -> None:
        from ._worker_process import serve

        try:
            await serve(end)
        finally:
            end.outbox.put_nowait(None)

    async def down(self, seq: int, frames: list[bytes]) -> None:
        assert self._end is not None
        self._held[seq] = frames
        while self._next in self._held:
            for frame in self._held.pop(self._next):
                message = pickle.loads(frame)
                if isinstance(message, Init):
                    message = replace(message, preparation=_here(message.preparation))
                self._end.inbox.put_nowait(message)
            self._next += 1

    async def uplink(self) -> Any:
        """Everything the worker sends, in order: each item is the frames queued since the last one."""
        assert self._end is not None
        outbox = self._end.outbox
        while True:
            first = await outbox.get()
            if first is None:
                return
            frames = [first]
            while not outbox.empty():
                frame = outbox.get_nowait()
                if frame is None:
                    yield frames
                    return
                frames.append(frame)
            yield frames


def _here(preparation: Mapping[str, Any]) -> dict[str, Any]:
    """The parent's spawn preparation as this node can follow it.

    On another node the parent's paths may not exist: its main script is imported only if it is here (else
    main-script hooks run by value), its working directory kept only if it exists, and ``sys.path`` keeps
    the parent's entries found here followed by this worker's own (Ray's ``runtime_env`` working_dir)."""
    parent = [p for p in preparation.get("sys_path", []) if p == "" or os.path.exists(p)]
    sys.path[:] = parent + [p for p in sys.path if p not in parent]  # before looking for the main module
    data = dict(preparation)
    name = data.get("init_main_from_name")
    if name is not None and not _importable(name):
        del data["init_main_from_name"]
    main = data.get("init_main_from_path")
    if main is not None and not os.path.exists(main):
        del data["init_main_from_path"]
    if "dir" in data and not os.path.isdir(data["dir"]):
        del data["dir"]
    data["sys_path"] = list(sys.path)
    return data


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
