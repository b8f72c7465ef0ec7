"""``SubprocessWorker``: a device worker in a spawned process, driven over a pipe (the parent's side).

One per device when a run has several (``devices=["cuda:0", "cuda:1"]``, or ``["cpu", "cpu"]``): CUDA and
fork do not mix, so the process is spawned (a fresh interpreter), and one process per device keeps each
GPU's allocator, engines and batcher to itself. The parent keeps everything that must have ONE owner: the
ledger (turns come back over the pipe and are durable before the worker hears "ok"), the API gateway its jobs
call (``ctx.call_gateway``: API keys, provider limits, batch rounds), placement and retries. The messages
are ``_wire``'s; this is the parent's end of each exchange.

Faults: the death of the process (SIGKILL, segfault, the OOM killer, or its own exit after a CUDA error that
poisoned it, announced by a ``Fatal`` message) shows up at once as EOF on the pipe; every attempt it was
running ends as ``worker_lost`` (``_run_jobs`` retries it, alone, on a fresh process), and the next attempt
placed here spawns that fresh process. A process that cannot start (bad device, import error, failing init
hook, no "ready" in time) is a :class:`WorkerStartError` that ends the run, never a hang.

How a worker is started is one seam (``launch``: a plan in, a :class:`Link` out): a spawned process over a
socket pair here, or a Ray actor (``_ray_worker``) carrying the same messages over actor calls. Everything
else, the handshake, the calls, the gate and the burial of a dead worker, is this module's for both.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from itertools import count
from multiprocessing import spawn
from types import TracebackType
from typing import Any, Protocol, Self

import anyio
from anyio.abc import Process, TaskGroup

from .._errors import JobPickleError, SchedulerError, WorkerLostError, WorkerStartError
from .._outcome import AttemptOutcome, ErrorInfo
from .._placement import WorkerPlan, plan_workers
from .._protocols import ExecutionMode, JobSpec
from .._signals import Notifier
from .._slots import Slots
from .._worker import CallGateway, RecordTurn
from ._wire import (
    Answers,
    Call,
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
    transportable_error,
)

__all__ = ["Launch", "Link", "SubprocessWorker", "spawn_process"]

#: A worker's first lines: the directory the parent imported interlens from goes first on ``sys.path`` (with
#: ``-c`` the interpreter puts the working directory there, and a source checkout in it, whose ``interlens/``
#: lacks the packages an install maps into it, would shadow the installed package), then the worker module.
#: ``spawn.prepare`` then gives the worker the parent's whole ``sys.path``.
_BOOT = "; ".join(
    [
        "import sys",
        "sys.path.insert(0, sys.argv[1])",
        "from interlens.scheduler.workers._worker_process import main",
        "main()",
    ]
)
_REAP_S = 5.0  # how long a worker that was told to go (or lost its pipe) gets before SIGKILL
_SEND_FAILED = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class Link(Protocol):
    """A started worker as its slot sees it: the channel to it, its name in messages, how to stop it."""

    @property
    def conn(self) -> Channel: ...

    @property
    def pid(self) -> int: ...

    @property
    def name(self) -> str:
        """How messages name it: "the worker process for device 'cpu' (pid 7)"."""
        ...

    async def stop(self, *, grace: float) -> str:
        """Let it end within ``grace`` seconds (told to go, or gone), else kill it; say how it ended."""
        ...


#: Starts one worker of a plan: :func:`spawn_process` here, a Ray actor in ``_ray_worker``.
Launch = Callable[[WorkerPlan], Awaitable[Link]]


class SubprocessWorker(Slots):
    """A placement slot on one device whose jobs run in a worker process, replaced when it dies.

    ``launch``: how a worker is started (default: a spawned process; ``_ray_worker``: a Ray actor).
    """

    def __init__(
        self,
        plan: WorkerPlan | str,
        *,
        capacity: int,
        mode: ExecutionMode,
        max_batch_size: int,
        max_batch_wait: float,
        hooks: bytes,
        start_timeout: float,
        call_gateway: CallGateway | None = None,
        launch: Launch | None = None,
    ) -> None:
        if isinstance(plan, str):
            plan = plan_workers([plan])[0]
        if mode is ExecutionMode.DETERMINISTIC:
            plan = plan.deterministic()  # cuBLAS without split-K, set before the worker's torch loads
        self._plan = plan
        self._device = plan.device
        super().__init__(capacity)
        self._init = partial(  # the preparation data is taken at each spawn
            Init,
            hooks=hooks,
            device=plan.inner,
            capacity=capacity,
            mode=mode,
            max_batch_size=max_batch_size,
            max_batch_wait=max_batch_wait,
            threads=plan.threads,
            memory_fraction=plan.memory_fraction,
        )
        self._call_gateway = call_gateway
        self._launch: Launch = spawn_process if launch is None else launch
        self._start_timeout = start_timeout
        self._ids = count()
        self._gate = _Gate()
        self._child: _Child | None = None
        self._spawn_lock = anyio.Lock()
        self._start_error: WorkerStartError | None = None
        self._first = anyio.Event()
        self._tg: TaskGroup | None = None
        #: Every process this slot started, in order (pids), for diagnostics and tests.
        self.pids: list[int] = []

    @property
    def device(self) -> str:
        return self._device

    async def __aenter__(self) -> Self:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._first_start)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        with anyio.CancelScope(shield=True):
            child = self._child
            if child is not None and not child.closed:
                try:
                    await child.conn.send_eof()  # the worker exits on EOF; the reader then reaps it
                except _SEND_FAILED:
                    pass
                with anyio.move_on_after(_REAP_S + 1):
                    await child.gone.wait()
                if not child.gone.is_set():
                    await child.link.stop(grace=0)
        self._tg.cancel_scope.cancel()  # the reader and call tasks: every one of them catches its own errors
        await self._tg.__aexit__(None, None, None)  # not ``exc``: anyio would wrap it in an ExceptionGroup
        return None

    async def _first_start(self) -> None:
        try:
            await self._current()
        except WorkerStartError:
            pass  # kept in self._start_error and raised by started()
        finally:
            self._first.set()

    async def started(self) -> None:
        await self._first.wait()
        if self._start_error is not None:
            raise self._start_error

    async def run_attempt(
        self,
        spec: JobSpec,
        *,
        attempt: int,
        committed_turns: Sequence[Mapping[str, Any]],
        record_turn: RecordTurn,
        exclusive: bool = False,
    ) -> AttemptOutcome:
        import cloudpickle  # ships lambdas and closures (a ScriptedParticipant's replies) by value

        try:
            payload = cloudpickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            error = JobPickleError(
                f"job {spec.job_id!r} cannot be sent to the worker process for {self._device!r} "
                f"({type(exc).__name__}: {exc}). What a job holds must pickle: cloudpickle ships lambdas "
                "and closures by value, but not locks, open files, sockets or loaded models; load heavy "
                "things in the worker instead (a lazy model participant, an init hook)"
            )
            return AttemptOutcome(error=ErrorInfo.from_exception(error))
        async with self._gate.hold(exclusive=exclusive):
            child = await self._current()
            req = next(self._ids)
            pending = child.attempts[req] = _Attempt(record_turn)
            try:
                try:
                    await child.conn.send(Run(req, payload, attempt, list(committed_turns)))
                except _SEND_FAILED:
                    pass  # it died: its reader buries it and ends this attempt as lost
                await pending.done.wait()
            except BaseException:  # cancelled: the run is stopping; tell the worker to drop the job
                child.attempts.pop(req, None)
                if not child.closed:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                        try:
                            await child.conn.send(Cancel(req))
                        except _SEND_FAILED:
                            pass
                raise
            assert pending.outcome is not None
            return pending.outcome

    async def evict(self, keys: frozenset[Hashable]) -> None:
        child = self._child
        if child is not None and not child.closed:  # no process, no engines: nothing to start for this
            try:
                await child.conn.send(Evict(keys))
            except _SEND_FAILED:
                pass

    async def _current(self) -> _Child:
        """The live worker process, spawning one if there is none (one spawn at a time)."""
        async with self._spawn_lock:
            if self._start_error is not None:
                raise self._start_error
            if self._child is None or self._child.closed:
                try:
                    self._child = await self._spawn()
                except Exception as exc:  # no retry storm: every later placement here fails the same way
                    if not isinstance(exc, WorkerStartError):
                        why = f"{type(exc).__name__}: {exc}"
                        error = WorkerStartError(
                            f"a worker process for {self._device!r} could not be started: {why}"
                        )
                        error.__cause__ = exc
                        exc = error
                    self._start_error = exc
                    raise exc from exc.__cause__
            return self._child

    async def _spawn(self) -> _Child:
        assert self._tg is not None
        link = await self._launch(self._plan)
        self.pids.append(link.pid)
        what, conn = link.name, link.conn
        try:
            await conn.send(self._init(preparation=_preparation()))
            with anyio.fail_after(self._start_timeout):
                message = await conn.recv()
        except TimeoutError:
            await link.stop(grace=0)
            raise WorkerStartError(
                f"{what} did not report ready within {self._start_timeout:g} s (worker_start_timeout); its "
                "output above may say why (a slow import or init hook?)"
            ) from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await link.stop(grace=0)
            raise
        match message:
            case Ready():
                pass
            case StartFailed(err):
                await link.stop(grace=_REAP_S)
                raise WorkerStartError(
                    f"{what} could not start: {err.type}: {err.message}\n\n"
                    f"Traceback in the worker:\n{err.traceback}"
                )
            case None:
                status = await link.stop(grace=_REAP_S)
                raise WorkerStartError(f"{what} exited during start-up ({status}); its output above says why")
            case _:
                await link.stop(grace=0)
                raise WorkerStartError(f"{what} sent {type(message).__name__} before it was ready")
        child = _Child(link, Answers(conn, self._tg))
        self._tg.start_soon(self._read, child, name=f"interlens worker {link.pid} reader")
        return child

    async def _read(self, child: _Child) -> None:
        assert self._tg is not None
        why: str | None = None
        try:
            while True:
                match await child.conn.recv():
                    case None:
                        break
                    case Result(req, outcome):
                        pending = child.attempts.pop(req, None)
                        if pending is not None:
                            pending.outcome = outcome
                            pending.done.set()
                    case Fatal(err):  # it exits next: its attempts are lost and retried elsewhere
                        child.fatal = (
                            "it hit a CUDA error that leaves its process unusable "
                            f"({err.type}: {err.message}); a fresh worker process replaces it"
                        )
                    case Call(call_id, TurnCall() as turn):
                        self._tg.start_soon(self._answer, child, call_id, turn)
                    case Call(call_id, GatewayCall() as api):
                        self._tg.start_soon(self._serve_gateway, child, call_id, api)
                    case message:
                        raise ValueError(f"unexpected message {type(message).__name__}")
        except Exception as exc:  # a worker talking nonsense cannot be trusted with more jobs
            why = f"it broke the pipe protocol: {type(exc).__name__}: {exc}"
        finally:
            with anyio.CancelScope(shield=True):
                await self._bury(child, why)

    async def _serve_gateway(self, child: _Child, call_id: int, api: GatewayCall) -> None:
        # An API call can wait for a provider batch for hours: it is stopped when its process dies (the
        # attempt is lost and retried elsewhere), not left holding a place in the gateway's rounds.
        with anyio.CancelScope() as scope:
            child.scopes.add(scope)
            try:
                await self._answer(child, call_id, api)
            finally:
                child.scopes.discard(scope)

    async def _answer(self, child: _Child, call_id: int, request: TurnCall | GatewayCall) -> None:
        try:
            match request:
                case TurnCall(req, index, turn):
                    pending = child.attempts.get(req)
                    if pending is None:
                        raise RuntimeError("the attempt this turn belongs to is no longer running")
                    await pending.record_turn(index, turn)
                    reply = Reply(call_id, True, None)
                case GatewayCall(job_id, spec, api_request, notes):
                    if self._call_gateway is None:
                        raise SchedulerError(
                            f"job {job_id!r} called ctx.call_gateway(...) but the run has no gateway"
                        )
                    blocker = child.answers.blocker(call_id) if notes else None
                    result = await self._call_gateway(job_id, spec, api_request, blocker)
                    reply = Reply(call_id, True, result)
        except Exception as exc:
            reply = Reply(call_id, False, transportable_error(exc))
        await child.answers.reply(reply)  # after the Blocked/Unblocked notes of this call

    async def _bury(self, child: _Child, why: str | None) -> None:
        """The process is gone (or must go): reap it and end its attempts as lost."""
        child.closed = True
        if self._child is child:
            self._child = None
        for scope in child.scopes:  # its jobs' API calls: nobody is left to answer
            scope.cancel()
        await child.conn.aclose()  # EOF for a worker still alive (we were cancelled): it exits at once
        status = await child.link.stop(grace=_REAP_S if why is None else 0)
        lost = ErrorInfo(
            WorkerLostError.__name__,
            f"{child.link.name} died while running this job ({why or child.fatal or status})",
            "",
        )
        for pending in child.attempts.values():
            pending.outcome = AttemptOutcome(error=lost, transient=True, worker_lost=True)
            pending.done.set()
        child.attempts.clear()
        child.gone.set()


class _Attempt:
    __slots__ = ("done", "outcome", "record_turn")

    def __init__(self, record_turn: RecordTurn) -> None:
        self.record_turn = record_turn
        self.done = anyio.Event()
        self.outcome: AttemptOutcome | None = None


class _Child:
    """One live worker (a process, an actor) and its channel."""

    def __init__(self, link: Link, answers: Answers) -> None:
        self.link = link
        self.conn = link.conn
        self.answers = answers  # replies to its calls, after the Blocked/Unblocked notes of its API calls
        self.attempts: dict[int, _Attempt] = {}
        self.scopes: set[anyio.CancelScope] = set()  # its jobs' API calls being served in the parent
        self.closed = False
        self.gone = anyio.Event()
        self.fatal: str | None = None  # why it said it must go (a ``Fatal`` message), before it went


class _Gate:
    """Attempts share the worker, except an exclusive one: it waits until it is alone and keeps others out.

    Waiting exclusive attempts go first (new shared ones queue behind them), so a job retried alone after its
    worker died is not starved by a steady stream of new jobs.
    """

    def __init__(self) -> None:
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._changed = Notifier()

    @asynccontextmanager
    async def hold(self, *, exclusive: bool) -> AsyncIterator[None]:
        if exclusive:
            self._waiting += 1
            try:
                while self._shared or self._exclusive:
                    await self._changed.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        else:
            while self._exclusive or self._waiting:
                await self._changed.wait()
            self._shared += 1
        try:
            yield
        finally:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._changed.notify()


class _ProcessLink:
    """A spawned worker process and its end of the socket pair."""

    def __init__(self, process: Process, conn: Connection, device: str) -> None:
        self.process = process
        self._conn = conn
        self.name = f"the worker process for device {device!r} (pid {process.pid})"

    @property
    def conn(self) -> Connection:
        return self._conn

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self, *, grace: float) -> str:
        return _describe(await _reap(self.process, grace=grace))


async def spawn_process(plan: WorkerPlan) -> _ProcessLink:
    """Start ``python -c <boot> FD`` for ``plan``: a fresh interpreter on the other end of a socket pair."""
    ours, theirs = socket.socketpair()
    try:
        fd = theirs.fileno()
        process = await anyio.open_process(
            [sys.executable, "-c", _BOOT, _interlens_root(), str(fd)],
            stdin=subprocess.DEVNULL,
            stdout=None,  # inherited: the worker's prints go where the parent's go, never into the pipe
            stderr=None,
            pass_fds=(fd,),
            env=plan.process_env(os.environ),  # its own GPU(s) only; its share of the cores
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    try:
        conn = await Connection.from_socket(ours)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _reap(process, grace=0)
        raise
    return _ProcessLink(process, conn, plan.device)


def _interlens_root() -> str:
    """The ``sys.path`` entry this process imported the interlens package from."""
    package = sys.modules[__name__.partition(".")[0]]
    return os.path.dirname(os.path.dirname(os.path.abspath(package.__file__ or "")))


def _preparation() -> dict[str, Any]:
    """What multiprocessing's spawn hands a child: sys.path, cwd, argv and how to import the main module."""
    data = spawn.get_preparation_data("interlens-worker")
    data["authkey"] = bytes(data["authkey"])  # refuses to pickle unless multiprocessing itself is spawning
    return data


async def _reap(process: Process, *, grace: float) -> int:
    """Wait up to ``grace`` seconds for ``process`` to exit, then SIGKILL it; return its exit status."""
    status: int | None = None
    with anyio.CancelScope(shield=True):
        if process.returncode is None and grace > 0:
            with anyio.move_on_after(grace):
                await process.wait()
        if process.returncode is None:
            try:
                process.kill()
            except ProcessLookupError:
                pass
        status = await process.wait()
    assert status is not None
    return status


def _describe(status: int) -> str:
    if status >= 0:
        return f"exit status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    hint = {
        "SIGKILL": "; the kernel's out-of-memory killer, or someone, killed it",
        "SIGSEGV": "; a crash in native code",
        "SIGABRT": "; native code aborted",
        "SIGBUS": "; a crash in native code",
    }.get(name, "")
    return f"killed by {name}{hint}"
