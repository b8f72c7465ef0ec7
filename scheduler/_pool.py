"""Building a run's workers: in-process for one device, one spawned process per device for several.

Kept apart from ``_run_jobs`` (which places and drives jobs) because what it decides is where code runs: a
single device keeps everything in this process (no pickling, no start-up cost); several devices get one
worker process each (seeing only its own GPUs, with its share of the CPU cores: ``_placement``), started
concurrently, so a run fails fast, before any job starts, when one of them
cannot start. Init hooks run once per worker before its first job: in each worker process, or here once
for an in-process run. ``cluster="ray"``: the device workers are Ray actors (``workers._ray_worker``),
however many, driven by the same ``SubprocessWorker``; the host worker stays here.

A hook defined in the main script travels by NAME and is looked up in the worker's copy of the main module
(each worker imports it, as spawn does), exactly as a registered analyzer is: sent by value (cloudpickle),
it would run against a private copy of the script's globals, so the probe it loads into a global would be
invisible to the analyzer that reads it.
"""

from __future__ import annotations

import functools
import pickle
import sys
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio

from ._errors import SchedulerConfigError, WorkerStartError
from ._placement import WorkerPlan, plan_workers, set_worker_device
from ._protocols import ExecutionMode, WorkerInit
from ._worker import CallGateway, InProcessWorker, Worker

__all__ = ["open_workers", "refuse_while_bootstrapping"]


async def open_workers(
    stack: AsyncExitStack,
    *,
    devices: Sequence[str] | None,
    mode: ExecutionMode,
    max_batch_size: int,
    max_concurrency: int,
    max_batch_wait: float,
    worker_init: Sequence[WorkerInit],
    start_timeout: float,
    call_gateway: CallGateway | None = None,
    on_poisoned: Callable[[str, BaseException], None] | None = None,
    cluster: str | None = None,
) -> tuple[list[Worker], list[Worker]]:
    """Enter the device workers and the host worker into ``stack``; return (device workers, host workers).

    ``call_gateway`` serves every worker's ``ctx.call_gateway`` in this process (the run's API gateway).
    ``on_poisoned(device, error)`` is told when a device worker IN THIS PROCESS hits a CUDA error that leaves
    the process unusable (a worker process is replaced instead; nothing can replace this one).
    """
    settings: dict[str, Any] = {
        "mode": mode,
        "max_batch_size": max_batch_size,
        "max_batch_wait": max_batch_wait,
        "call_gateway": call_gateway,
    }
    device_workers: list[Worker] = []
    if cluster is not None or devices is None or len(devices) > 1:
        from .workers import Launch, SubprocessWorker

        hooks = _pickle_hooks(worker_init)
        launches: list[tuple[WorkerPlan, Launch | None]]
        if cluster == "ray":
            from .workers import RaySession, launcher, ray_plans

            session = stack.enter_context(RaySession())  # closed after the actors (the stack unwinds)
            launches = [
                (p.worker, launcher(p, start_timeout=start_timeout))
                for p in ray_plans(None if devices is None else list(devices), session.resources())
            ]
        else:
            assert devices is not None
            launches = [(plan, None) for plan in plan_workers(devices)]
        for plan, launch in launches:
            worker: Worker = SubprocessWorker(
                plan,
                capacity=max_batch_size,
                hooks=hooks,
                start_timeout=start_timeout,
                launch=launch,
                **settings,
            )
            device_workers.append(await stack.enter_async_context(worker))
        errors: list[WorkerStartError] = []

        async def started(worker: Worker) -> None:
            try:
                await worker.started()
            except WorkerStartError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:  # started concurrently, so start-up costs one spawn
            for worker in device_workers:
                tg.start_soon(started, worker)
        if errors:
            raise errors[0]
    else:
        set_worker_device(devices[0])  # for the hooks and jobs of this run, as a worker process would say
        stack.callback(set_worker_device, None)
        _run_hooks_here(worker_init)
        for device in devices:
            fatal = None if on_poisoned is None else functools.partial(on_poisoned, device)
            worker = InProcessWorker(device, capacity=max_batch_size, on_fatal=fatal, **settings)
            device_workers.append(await stack.enter_async_context(worker))
    host = InProcessWorker(None, capacity=max_concurrency, **settings)
    return device_workers, [await stack.enter_async_context(host)]


def refuse_while_bootstrapping() -> None:
    """A run started while a worker process imports the user's main module would spawn workers forever."""
    worker_process = sys.modules.get(f"{__package__}.workers._worker_process")
    if worker_process is not None and worker_process.bootstrapping():
        raise SchedulerConfigError(
            "a run was started while a worker process was importing your main module: guard the code that "
            'starts runs with `if __name__ == "__main__":` (workers import the main module, as '
            "multiprocessing's spawn does, so that names registered at import time exist in them)"
        )


@dataclass(frozen=True)
class _MainHook:
    """A main-script hook, called in the worker as the function of that name in the worker's main module.

    There it shares its globals with everything else the script defines (the analyzers registered at
    import time included). ``fallback`` is the function itself, sent by value, for a worker whose main
    module has no such name (the function was defined under ``if __name__ == "__main__":``).
    """

    name: str
    fallback: WorkerInit

    def __call__(self) -> object:
        fn = getattr(sys.modules.get("__main__"), self.name, None)
        return (fn if callable(fn) else self.fallback)()


def _main_imported_by_workers() -> bool:
    """Whether a worker process imports this process's main module (``spawn.prepare`` in the worker)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:  # `python -m pkg.script`: imported by name, except a package's __main__
        return spec_name != "__main__" and not spec_name.endswith(".__main__")
    return getattr(main, "__file__", None) is not None  # a script path (not a REPL or a notebook)


def _by_name(hook: WorkerInit) -> WorkerInit:
    """``hook`` as a :class:`_MainHook` when it is a top-level function of a main script workers import."""
    name = getattr(hook, "__qualname__", None)
    if (
        getattr(hook, "__module__", None) != "__main__"
        or not isinstance(name, str)
        or not name.isidentifier()  # nested ("f.<locals>.g") or a method: only top-level names resolve
        or getattr(sys.modules.get("__main__"), name, None) is not hook
        or not _main_imported_by_workers()
    ):
        return hook
    return _MainHook(name, hook)


def _pickle_hooks(hooks: Sequence[WorkerInit]) -> bytes:
    import cloudpickle

    for hook in hooks:
        try:
            cloudpickle.dumps(hook)
        except Exception as exc:
            raise SchedulerConfigError(
                f"the worker init hook {hook!r} cannot be sent to the worker processes "
                f"({type(exc).__name__}: {exc}); use a module-level function, or a closure over values that "
                "pickle"
            ) from exc
    if not hooks:
        return b""
    return bytes(cloudpickle.dumps([_by_name(hook) for hook in hooks], protocol=pickle.HIGHEST_PROTOCOL))


def _run_hooks_here(hooks: Sequence[WorkerInit]) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise WorkerStartError(f"the worker init hook {hook!r} failed: {why}") from exc
