"""The pipe between the parent and a worker process: every message type, the framing, calls with ids.

Why a socket pair of our own and not the worker's stdout: whatever the user's code prints (or a C library
writes to fd 1) goes to the inherited stdout and can never corrupt a message. Every frame is a 4-byte
big-endian length and a pickle; one ``send`` writes its frames at once under a lock, so concurrent senders
never interleave. Calls carry ids, so many are in flight at once and answers come back in any order.

Every message is a small frozen dataclass defined here, and each end ``match``-es on them
(``_subprocess`` is the parent's end, ``_worker_process`` the worker's)::

    parent → worker   Init(preparation, hooks, device, ...)   first message: what to import, hooks, settings
                      Run(req, spec, attempt, committed_turns)   spec: the cloudpickled JobSpec
                      Cancel(req)                   stop that attempt (the run was cancelled)
                      Evict(keys)                   drop those engines: the rest of the run needs none
                      Reply(call, ok, value)        the answer to a worker's Call
                      Blocked(call) | Unblocked(call)   a GatewayCall's row started / stopped waiting on a
                                                    provider batch (the notes a ``Blocker`` gets in-process)
    worker → parent   Ready(pid) | StartFailed(error)
                      Result(req, outcome)          how that attempt ended (an AttemptOutcome)
                      Fatal(error)                  a CUDA error poisoned the process: it exits next
                      Call(call, TurnCall(req, index, turn))              record a turn in the ledger
                      Call(call, GatewayCall(job_id, spec, request, notes))   the run's API gateway

The blocked/unblocked notes travel as they do in-process: the parent's gateway tells a blocker from
:class:`Answers`, which sends the notes in order and always ahead of the call's Reply; :class:`Calls` hands
them to the job's device batcher in the worker. So a batcher counts a job waiting on a provider batch as
blocked exactly while its row waits, in either placement.

A Ray actor (``_ray_worker``) carries the same messages, pickled the same way, over actor calls: both ends
see a :class:`Channel`. Both ends are our own code in processes we started, so unpickling what comes over
the pair (or the actor calls) is trusted.
"""

from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import SocketStream, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream

from .._errors import ParentCallError
from .._outcome import AttemptOutcome, ErrorInfo
from .._protocols import ExecutionMode

if TYPE_CHECKING:
    from ..gateway import Blocker

__all__ = [
    "Answers",
    "Blocked",
    "Call",
    "Calls",
    "Cancel",
    "Channel",
    "Connection",
    "Evict",
    "Fatal",
    "GatewayCall",
    "Init",
    "Message",
    "Ready",
    "Reply",
    "Result",
    "Run",
    "StartFailed",
    "TurnCall",
    "Unblocked",
    "transportable_error",
]

_HEADER = struct.Struct("!I")
_GONE = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


# --- parent → worker ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Init:
    """The first message: what the worker imports and runs before it says :class:`Ready`."""

    preparation: dict[str, Any]  # multiprocessing spawn's preparation data (sys.path, cwd, main module)
    hooks: bytes  # the cloudpickled init hooks (b"": none)
    device: str  # as the worker addresses it ("cuda:0" for the parent's "cuda:3": CUDA_VISIBLE_DEVICES=3)
    capacity: int
    mode: ExecutionMode
    max_batch_size: int
    max_batch_wait: float
    threads: int | None = None  # torch threads (the CPU workers' share of the cores), None: torch's default
    memory_fraction: float | None = None  # of each visible GPU, where workers share it (None: all of it)


@dataclass(frozen=True, slots=True)
class Run:
    """Run one attempt of a job; answered by a :class:`Result` with the same ``req``."""

    req: int
    spec: bytes  # the cloudpickled JobSpec (lambdas and closures travel by value)
    attempt: int
    committed_turns: list[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop attempt ``req``: the run is stopping and no longer waits for its result."""

    req: int


@dataclass(frozen=True, slots=True)
class Evict:
    """Drop these engines: no job left in the run needs them (see ``_eviction``)."""

    keys: frozenset[Any]


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to the worker's :class:`Call` ``call``: its value, or (``ok`` false) the error to raise."""

    call: int
    ok: bool
    value: Any


@dataclass(frozen=True, slots=True)
class Blocked:
    """The gateway call ``call`` now waits on a provider batch (its job's batcher must not wait for it)."""

    call: int


@dataclass(frozen=True, slots=True)
class Unblocked:
    """The row of gateway call ``call`` was delivered (sent before that call's :class:`Reply`)."""

    call: int


# --- worker → parent ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker imported the main module, ran the init hooks and takes jobs."""

    pid: int


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The worker could not start (an import, an init hook); it exits after sending this."""

    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class Fatal:
    """The worker hit an error that leaves its process unusable (a CUDA error other than out-of-memory):
    it exits right after sending this, without the results of its running attempts, so they are retried on a
    fresh process."""

    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class Result:
    """How attempt ``req`` ended."""

    req: int
    outcome: AttemptOutcome


@dataclass(frozen=True, slots=True)
class TurnCall:
    """Record turn ``index`` of attempt ``req`` in the parent's ledger (answered once it is durable)."""

    req: int
    index: int
    turn: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class GatewayCall:
    """A job's ``ctx.call_gateway(spec, request)``, served by the run's gateway in the parent.

    ``notes``: the job's device batcher wants :class:`Blocked` / :class:`Unblocked` for this call.
    """

    job_id: str
    spec: Any
    request: Any
    notes: bool


@dataclass(frozen=True, slots=True)
class Call:
    """A request from the worker that the parent answers with a :class:`Reply` carrying ``call``."""

    call: int
    request: TurnCall | GatewayCall


Message = (
    Init | Run | Cancel | Evict | Reply | Blocked | Unblocked | Ready | StartFailed | Fatal | Result | Call
)
_MESSAGES = (Init, Run, Cancel, Evict, Reply, Blocked, Unblocked, Ready, StartFailed, Fatal, Result, Call)


class Channel(Protocol):
    """What both ends need of a link: :class:`Connection` (a socket pair) or a Ray actor's (``_ray_worker``).

    ``send`` raises ``anyio.BrokenResourceError`` (or OSError) once the other end is gone, or the pickling
    error of a message that does not pickle (then nothing is sent); ``recv`` returns None once it is gone.
    """

    async def send(self, *messages: Message) -> None: ...
    async def recv(self) -> Message | None: ...
    async def send_eof(self) -> None: ...
    async def aclose(self) -> None: ...


class Connection:
    """One end of the pair. ``recv`` returns None once the other end is gone (closed, or its process died)."""

    def __init__(self, stream: SocketStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()

    @classmethod
    async def from_socket(cls, sock: socket.socket) -> Connection:
        return cls(await SocketStream.from_socket(sock))

    async def send(self, *messages: Message) -> None:
        """Send ``messages`` in order, in one write; raises ``anyio.BrokenResourceError`` (or OSError) if the
        other end is gone, or a pickling error (nothing is sent then)."""
        frames = []
        for message in messages:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            frames.append(_HEADER.pack(len(data)) + data)
        async with self._send_lock:
            await self._stream.send(b"".join(frames))

    async def recv(self) -> Message | None:
        try:
            (size,) = _HEADER.unpack(await self._reader.receive_exactly(_HEADER.size))
            data = await self._reader.receive_exactly(size)
        except _GONE:
            return None
        message = pickle.loads(data)
        if not isinstance(message, _MESSAGES):
            raise ValueError(f"malformed message on the worker pipe: {type(message).__name__}")
        return message

    async def send_eof(self) -> None:
        """Tell the other end we are done (it reads EOF) while still reading what it sends."""
        async with self._send_lock:
            await self._stream.send_eof()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


class _Pending:
    __slots__ = ("blocked", "blocker", "done", "ok", "value")

    def __init__(self, blocker: Blocker | None) -> None:
        self.done = anyio.Event()
        self.ok = False
        self.value: Any = None
        self.blocker = blocker
        self.blocked = 0  # Blocked notes not yet undone by an Unblocked one


class Calls:
    """The worker's outgoing calls, awaiting their :class:`Reply` (answered in any order)."""

    def __init__(self, conn: Channel) -> None:
        self._conn = conn
        self._ids = count()
        self._pending: dict[int, _Pending] = {}

    async def call(self, request: TurnCall | GatewayCall, blocker: Blocker | None = None) -> Any:
        """Send ``request``, return the answer or raise the error; ``blocker`` gets the call's notes."""
        call_id = next(self._ids)
        pending = self._pending[call_id] = _Pending(blocker)
        try:
            await self._conn.send(Call(call_id, request))
            await pending.done.wait()
        finally:
            del self._pending[call_id]
            while pending.blocked:  # a note the parent could not send (cancelled, or the parent died)
                self._note(pending, blocked=False)
        if not pending.ok:
            raise pending.value
        return pending.value

    def resolve(self, reply: Reply) -> None:
        pending = self._pending.get(reply.call)
        if pending is not None:  # None: the caller was cancelled meanwhile
            pending.ok, pending.value = reply.ok, reply.value
            pending.done.set()

    def noted(self, note: Blocked | Unblocked) -> None:
        pending = self._pending.get(note.call)
        if pending is not None:  # None: the call ended meanwhile (and undid its notes)
            self._note(pending, blocked=isinstance(note, Blocked))

    @staticmethod
    def _note(pending: _Pending, *, blocked: bool) -> None:
        if pending.blocker is None:
            return
        if blocked:
            pending.blocked += 1
            pending.blocker.block()
        elif pending.blocked:
            pending.blocked -= 1
            pending.blocker.unblock()


class Answers:
    """The parent's answers to one worker's calls: each :class:`Reply`, and the :class:`Blocked` /
    :class:`Unblocked` notes of its gateway calls, sent in order.

    A ``Blocker`` is told synchronously, in the gateway's step, so its notes are queued and written by a task
    of ``task_group``, every note of one step in one write. :meth:`reply` sends the queued notes first, so a
    call's notes always precede its answer: in the worker, every row of a provider batch is unblocked
    before the first of their jobs resumes (and could make its batcher leave without the others).
    """

    def __init__(self, conn: Channel, task_group: TaskGroup) -> None:
        self._conn = conn
        self._tg = task_group
        self._queue: list[Blocked | Unblocked] = []
        self._lock = anyio.Lock()

    async def reply(self, reply: Reply) -> None:
        """Send ``reply`` after every note queued so far; an answer that does not pickle is sent as the
        error it raised. Returns quietly when the worker is gone (its reader buries it)."""
        await self.flush()
        try:
            await self._conn.send(reply)
        except _GONE:
            pass
        except Exception as exc:  # the answer itself does not pickle
            try:
                await self._conn.send(Reply(reply.call, False, transportable_error(exc)))
            except _GONE:
                pass

    def blocker(self, call: int) -> _NoteBlocker:
        """The ``Blocker`` the gateway gets for call ``call``."""
        return _NoteBlocker(self, call)

    def put(self, note: Blocked | Unblocked) -> None:
        if not self._queue:
            self._tg.start_soon(self.flush)
        self._queue.append(note)

    async def flush(self) -> None:
        """Send every queued note; returns once notes queued before it are written (or the worker is gone)."""
        async with self._lock:
            notes, self._queue = self._queue, []
            if notes:
                try:
                    await self._conn.send(*notes)
                except _GONE:
                    pass  # the worker is gone; its reader buries it


class _NoteBlocker:
    __slots__ = ("_call", "_sender")

    def __init__(self, sender: Answers, call: int) -> None:
        self._sender = sender
        self._call = call

    def block(self) -> None:
        self._sender.put(Blocked(self._call))

    def unblock(self) -> None:
        self._sender.put(Unblocked(self._call))


def transportable_error(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives a pickle round trip (so the caller can catch its type), else a
    :class:`ParentCallError` with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return ParentCallError(f"{type(exc).__qualname__}: {exc}")
    return exc
