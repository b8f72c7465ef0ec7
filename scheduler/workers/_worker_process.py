"""The worker process: what a spawned child runs (``python -c "...; main()" FD``).

It imports the user's main module the way multiprocessing's spawn does (so names registered at import time
exist here), runs the init hooks, then serves jobs from the pipe with an :class:`InProcessWorker` for its
device: the same class, batcher and engine cache as in the parent, so jobs co-step here exactly as they
would in-process. Turns go back to the parent (the ledger's only writer) and are durable when acknowledged;
API calls go to the parent's gateway, whose Blocked/Unblocked notes reach the job's device batcher as they
would in-process. The messages are ``_wire``'s; this is the worker's end of each exchange.

A worker never outlives its parent: EOF on the pipe (the parent closed it, or died and the kernel closed it)
ends the process at once with ``os._exit``, and a watchdog thread ends it if it is re-parented while its
loop is stuck. Ctrl-C is ignored here: the parent catches it and shuts the workers down in order. A CUDA
error other than out-of-memory (a device-side assert) poisons the process: the worker sends ``Fatal`` and
exits without its running attempts' results, so the parent retries them on a fresh process.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import spawn
from typing import Any, NoReturn

import anyio

from .._errors import JobPickleError
from .._outcome import AttemptOutcome, ErrorInfo
from .._placement import DETERMINISTIC_CUDA_ENV, set_worker_device
from .._protocols import ExecutionMode, JobSpec
from .._worker import InProcessWorker
from ..gateway import Blocker
from ._wire import (
    Blocked,
    Calls,
    Cancel,
    Channel,
    Connection,
    Evict,
    Fatal,
    GatewayCall,
    Init,
    Ready,
    Reply,
    Result,
    Run,
    StartFailed,
    TurnCall,
    Unblocked,
)

__all__ = ["bootstrapping", "main", "serve"]

_bootstrapping = False
_WATCHDOG_S = 0.5
_EXIT_FATAL = 70  # the exit status of a worker that left because a CUDA error poisoned it


def bootstrapping() -> bool:
    """True while this worker is importing the user's main module (a run started then is a mistake)."""
    return _bootstrapping


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[-1]))
    _watch_parent(os.getppid())
    code = 1
    try:
        code = anyio.run(_serve, sock)
    finally:
        _exit(code)


def _exit(code: int) -> NoReturn:
    """Leave now: no interpreter teardown waiting on a generate thread or a library's atexit hooks."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(_WATCHDOG_S)
        os._exit(0)  # re-parented: the parent is dead; no job result can reach anyone

    threading.Thread(target=watch, name="interlens-parent-watchdog", daemon=True).start()


async def _serve(sock: socket.socket) -> int:
    return await serve(await Connection.from_socket(sock))


async def serve(conn: Channel) -> int:
    """Serve the parent at the other end of ``conn``: an :class:`Init` first, then jobs until it goes.

    The whole worker end, whatever carries the messages: the socket pair here, a Ray actor's queues there
    (``_ray_worker``), so an actor hosts exactly what a worker process hosts."""
    init = await conn.recv()
    if not isinstance(init, Init):
        return 1
    try:
        _prepare(init)
    except BaseException as exc:  # an import error, a failing init hook, even SystemExit: report it
        await conn.send(StartFailed(ErrorInfo.from_exception(exc)))
        return 1
    return await _Server(conn, init).serve()


def _prepare(init: Init) -> None:
    global _bootstrapping
    set_worker_device(init.device)  # before the main module's import: its code may ask
    preparation = dict(init.preparation)
    _bootstrapping = True
    try:
        spawn.prepare(preparation)  # sys.path, cwd, and the main module as __mp_main__
    except Exception as exc:
        main = preparation.get("init_main_from_path") or preparation.get("init_main_from_name")
        raise RuntimeError(
            f"importing your main module {main} in the worker failed with {type(exc).__name__}: {exc}. "
            "Workers import it (as multiprocessing's spawn does); is the code that starts the run guarded by "
            '`if __name__ == "__main__":`?'
        ) from exc
    finally:
        _bootstrapping = False
    if init.threads is not None and "torch" in sys.modules:  # else OMP_NUM_THREADS, set for the spawn, holds
        sys.modules["torch"].set_num_threads(init.threads)
    if init.memory_fraction is not None:
        _share_gpus(init.memory_fraction)
    if init.mode is ExecutionMode.DETERMINISTIC and init.device.startswith("cuda"):
        _deterministic_cuda()
    hooks = pickle.loads(init.hooks) if init.hooks else ()
    for hook in hooks:
        hook()


def _deterministic_cuda() -> None:
    """A CUDA worker of a deterministic run: cuBLAS without split-K (``DETERMINISTIC_CUDA_ENV``, in the
    spawned process's environment from the start; set here too where a launcher could not, before the
    first matrix product: cuBLAS reads it when it starts) and torch's deterministic algorithms where an op
    has one. Ops without one warn instead of failing the run: a row's tokens are still compared alone and
    together by the engine's self-test before rows co-step. A run in your own process (one device) leaves
    your process's settings alone."""
    for name, value in DETERMINISTIC_CUDA_ENV.items():
        os.environ.setdefault(name, value)
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)


def _share_gpus(fraction: float) -> None:
    """Cap this worker's allocator at its share of each visible GPU (workers share the GPU), before the init
    hooks and the model allocate anything."""
    import torch

    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(fraction, index)


class _Server:
    def __init__(self, conn: Channel, init: Init) -> None:
        self._conn = conn
        self._calls = Calls(conn)
        self._init = init
        self._scopes: dict[int, anyio.CancelScope] = {}
        self._fatal: BaseException | None = None
        self._dying = anyio.Event()

    def _on_fatal(self, exc: BaseException) -> None:
        """A CUDA error poisoned this process: no result may leave it any more (its running attempts are
        retried on a fresh process); :meth:`_die` tells the parent why and exits."""
        if self._fatal is None:
            self._fatal = exc
            self._dying.set()

    async def _die(self) -> None:
        await self._dying.wait()
        assert self._fatal is not None
        try:
            await self._conn.send(Fatal(ErrorInfo.from_exception(self._fatal)))
        finally:
            _exit(_EXIT_FATAL)

    async def serve(self) -> int:
        init = self._init
        worker = InProcessWorker(
            init.device,
            capacity=init.capacity,
            mode=init.mode,
            max_batch_size=init.max_batch_size,
            max_batch_wait=init.max_batch_wait,
            call_gateway=self._call_gateway,
            on_fatal=self._on_fatal,
        )
        async with worker, anyio.create_task_group() as tg:
            tg.start_soon(self._die)
            await self._conn.send(Ready(os.getpid()))
            while True:
                match await self._conn.recv():
                    case None:  # the parent is done with us, or dead: nothing left to report to
                        _exit(0)
                    case Run() as run:
                        tg.start_soon(self._run, worker, run)
                    case Reply() as reply:
                        self._calls.resolve(reply)
                    case Blocked() | Unblocked() as note:
                        self._calls.noted(note)
                    case Evict(keys):  # done before the next message: a job it brings may load a model
                        await worker.evict(keys)
                    case Cancel(req):
                        scope = self._scopes.get(req)
                        if scope is not None:
                            scope.cancel()
                    case message:
                        raise ValueError(f"unexpected message {type(message).__name__} from the parent")
        return 0  # pragma: no cover (the loop only ends through _exit)

    async def _call_gateway(self, job_id: str, spec: Any, request: Any, blocker: Blocker | None) -> Any:
        """The gateway is the parent's (keys, limits, batch rounds, the ledger): the pair crosses the pipe.

        ``blocker`` cannot cross it: the parent's gateway tells a stand-in, whose Blocked/Unblocked notes
        come back and are handed to ``blocker`` here."""
        return await self._calls.call(GatewayCall(job_id, spec, request, blocker is not None), blocker)

    async def _run(self, worker: InProcessWorker, run: Run) -> None:
        outcome: AttemptOutcome | None = None
        with anyio.CancelScope() as scope:
            self._scopes[run.req] = scope
            try:
                outcome = await self._attempt(worker, run.req, run.spec, run.attempt, run.committed_turns)
            finally:
                self._scopes.pop(run.req, None)
        if outcome is None or self._fatal is not None:  # cancelled, or this process is going: no result
            return
        try:
            await self._conn.send(Result(run.req, outcome))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            error = JobPickleError(f"the job's outcome cannot be sent back to the parent: {exc}")
            bad = AttemptOutcome(error=ErrorInfo.from_exception(error))
            await self._conn.send(Result(run.req, bad))

    async def _attempt(
        self,
        worker: InProcessWorker,
        req: int,
        payload: bytes,
        attempt: int,
        committed: Sequence[Mapping[str, Any]],
    ) -> AttemptOutcome:
        try:
            spec = pickle.loads(payload)
            if not isinstance(spec, JobSpec):
                raise TypeError(f"expected a JobSpec, got {type(spec).__name__}")
        except Exception as exc:
            error = JobPickleError(
                f"the job could not be rebuilt in the worker process ({type(exc).__name__}: {exc}); the "
                "code it refers to must be importable there (a module on sys.path, or your main script)"
            )
            return AttemptOutcome(error=ErrorInfo.from_exception(error))

        async def record_turn(index: int, turn: Mapping[str, Any]) -> None:
            await self._calls.call(TurnCall(req, index, turn))

        worker.admit()
        try:
            return await worker.run_attempt(
                spec, attempt=attempt, committed_turns=committed, record_turn=record_turn
            )
        finally:
            worker.leave()
