"""The pipe between the parent and a worker process: length-framed pickled messages, calls with ids.

Why a socket pair of our own and not the worker's stdout: whatever the user's code prints (or a C library
writes to fd 1) goes to the inherited stdout and can never corrupt a message. Every frame is a 4-byte
big-endian length and a pickle; one frame is written by one ``send`` under a lock, so concurrent senders
never interleave. Requests carry ids, so many are in flight at once and answers come back in any order.

Messages are tuples whose first item names them::

    parent → worker   ("init", config)              first message: preparation data, init hooks, settings
                      ("run", req, spec, attempt, committed_turns)    spec: the cloudpickled JobSpec
                      ("cancel", req)               stop that attempt (the run was cancelled)
                      ("reply", call, ok, value)    answer to a worker's ("call", ...)
    worker → parent   ("ready", pid) | ("start_failed", ErrorInfo)
                      ("result", req, AttemptOutcome)
                      ("call", call, kind, payload) "record_turn" (the ledger), "service" (call_parent),
                                                    "gateway" (call_gateway: the run's API gateway)

Both ends are our own code in processes we started, so unpickling what comes over the pair is trusted.
"""

from __future__ import annotations

import pickle
import socket
import struct
from itertools import count
from typing import Any

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from ._errors import ParentCallError

__all__ = ["Calls", "Connection", "transportable_error"]

_HEADER = struct.Struct("!I")
_GONE = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


class Connection:
    """One end of the pair. ``recv`` returns None once the other end is gone (closed, or its process died)."""

    def __init__(self, stream: SocketStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()

    @classmethod
    async def from_socket(cls, sock: socket.socket) -> Connection:
        return cls(await SocketStream.from_socket(sock))

    async def send(self, message: tuple[Any, ...]) -> None:
        """Send one message; raises ``anyio.BrokenResourceError`` (or OSError) if the other end is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _HEADER.pack(len(data)) + data
        async with self._send_lock:
            await self._stream.send(frame)

    async def recv(self) -> tuple[Any, ...] | None:
        try:
            (size,) = _HEADER.unpack(await self._reader.receive_exactly(_HEADER.size))
            data = await self._reader.receive_exactly(size)
        except _GONE:
            return None
        message = pickle.loads(data)
        if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
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
    __slots__ = ("done", "ok", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.ok = False
        self.value: Any = None


class Calls:
    """Outgoing calls awaiting their ("reply", id, ok, value), answered in any order."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._ids = count()
        self._pending: dict[int, _Pending] = {}

    async def call(self, kind: str, payload: Any) -> Any:
        call_id = next(self._ids)
        pending = self._pending[call_id] = _Pending()
        try:
            await self._conn.send(("call", call_id, kind, payload))
            await pending.done.wait()
        finally:
            self._pending.pop(call_id, None)
        if not pending.ok:
            raise pending.value
        return pending.value

    def resolve(self, call_id: int, ok: bool, value: Any) -> None:
        pending = self._pending.get(call_id)
        if pending is not None:  # None: the caller was cancelled meanwhile
            pending.ok, pending.value = ok, value
            pending.done.set()


def transportable_error(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives a pickle round trip (so the caller can catch its type), else a
    :class:`ParentCallError` with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return ParentCallError(f"{type(exc).__qualname__}: {exc}")
    return exc
