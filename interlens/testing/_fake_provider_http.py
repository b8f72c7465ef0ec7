"""A minimal HTTP/1.1 server on asyncio, run in its own thread, for the fake provider.

Why not ``http.server.ThreadingHTTPServer``: the fake must hold 64+ slow requests open at once (latency,
simulated timeouts) cheaply, notice when a client hangs up mid-request (so a simulated timeout ends as soon as
the SDK gives up, instead of pinning a thread), and shut down promptly even with idle keep-alive connections.
One asyncio loop in a dedicated thread does all three; the test's own event loop stays free.

Only what the official SDKs send is supported: ``Content-Length`` or chunked request bodies, keep-alive,
no pipelining guarantees beyond in-order handling on one connection, no ``Expect: 100-continue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl, urlsplit

_MAX_HEAD = 64 * 1024
_EXTRA_REASONS = {529: "Site Overloaded"}


@dataclass(slots=True)
class HttpRequest:
    """One parsed request. Header names are lower-cased; ``path`` excludes the query string."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes


@dataclass(slots=True)
class HttpResponse:
    """What a handler returns; the server adds Content-Length and Connection itself."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class Connection:
    """The handler's view of the client connection: lets a slow handler notice the client has gone."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(Connection._ids)
        """Distinct per TCP connection, so tests can see keep-alive reuse."""
        self.closed = asyncio.Event()

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until the client hangs up; return True if the client is still there."""
        if self.closed.is_set():
            return False
        if seconds <= 0:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.closed.wait(), timeout=seconds)
        return not self.closed.is_set()

    async def wait_for(self, event: asyncio.Event, timeout: float) -> bool:
        """Wait until ``event`` is set (or ``timeout`` passes); return True if the client is still there."""
        waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.closed.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return not self.closed.is_set()


Handler = Callable[[HttpRequest, Connection], Awaitable[HttpResponse | None]]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _HttpProtocol(asyncio.Protocol):
    """One client connection: buffers bytes, serves requests in order, one task per connection."""

    def __init__(self, handler: Handler, live: set[_HttpProtocol]) -> None:
        self._handler = handler
        self._live = live
        self._buffer = bytearray()
        self._data = asyncio.Event()
        self._eof = False
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self.conn = Connection()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._live.add(self)
        self._task = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        self._buffer.extend(data)
        self._data.set()

    def eof_received(self) -> bool:
        self._gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()
        self._live.discard(self)

    def _gone(self) -> None:
        self._eof = True
        self._data.set()
        self.conn.closed.set()

    def abort(self) -> None:
        """Drop the connection now (server shutdown); the serving task ends with it."""
        if self._task is not None:
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()

    async def _read_until(self, delim: bytes, limit: int) -> bytes | None:
        while True:
            idx = self._buffer.find(delim)
            if idx >= 0:
                out = bytes(self._buffer[: idx + len(delim)])
                del self._buffer[: idx + len(delim)]
                return out
            if len(self._buffer) > limit:
                raise _BadRequest(431, "request head too large")
            if self._eof:
                return None
            self._data.clear()
            await self._data.wait()

    async def _read_exact(self, n: int) -> bytes | None:
        while len(self._buffer) < n:
            if self._eof:
                return None
            self._data.clear()
            await self._data.wait()
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def _read_request(self) -> HttpRequest | None:
        head = await self._read_until(b"\r\n\r\n", _MAX_HEAD)
        if head is None:
            return None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, f"malformed request line {lines[0]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise _BadRequest(400, f"malformed header line {line!r}")
            headers[name.strip().lower()] = value.strip()
        if parts[2] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers.setdefault("connection", "close")
        body = await self._read_body(headers)
        if body is None:
            return None
        url = urlsplit(parts[1])
        return HttpRequest(
            method=parts[0].upper(),
            path=url.path,
            query=dict(parse_qsl(url.query, keep_blank_values=True)),
            headers=headers,
            body=body,
        )

    async def _read_body(self, headers: dict[str, str]) -> bytes | None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size_line = await self._read_until(b"\r\n", 1024)
                if size_line is None:
                    return None
                try:
                    size = int(size_line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise _BadRequest(400, "malformed chunk size") from None
                chunk = await self._read_exact(size + 2)
                if chunk is None:
                    return None
                if size == 0:
                    return b"".join(chunks)
                chunks.append(chunk[:-2])
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise _BadRequest(400, "malformed Content-Length") from None
        return await self._read_exact(length)

    def _write(self, resp: HttpResponse, *, close: bool) -> None:
        assert self._transport is not None
        try:
            reason = HTTPStatus(resp.status).phrase
        except ValueError:
            reason = _EXTRA_REASONS.get(resp.status, "Unknown")
        head = [
            f"HTTP/1.1 {resp.status} {reason}",
            f"Content-Type: {resp.content_type}",
            f"Content-Length: {len(resp.body)}",
            f"Connection: {'close' if close else 'keep-alive'}",
        ]
        head += [f"{k}: {v}" for k, v in resp.headers.items()]
        self._transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + resp.body)

    async def _serve(self) -> None:
        try:
            while not self._eof or self._buffer:
                try:
                    req = await self._read_request()
                except _BadRequest as exc:
                    body = f'{{"error":{{"message":"{exc}"}}}}'.encode()
                    self._write(HttpResponse(status=exc.status, body=body), close=True)
                    break
                if req is None:
                    break
                try:
                    resp = await self._handler(req, self.conn)
                except Exception as exc:  # a handler bug must not kill the connection silently
                    body = f'{{"error":{{"message":"fake server bug: {type(exc).__name__}"}}}}'.encode()
                    self._write(HttpResponse(status=500, body=body), close=True)
                    raise
                if resp is None or self.conn.closed.is_set():
                    break
                close = req.headers.get("connection", "").lower() == "close"
                self._write(resp, close=close)
                if close:
                    break
        finally:
            if self._transport is not None and not self._transport.is_closing():
                self._transport.close()


class LoopServer:
    """Runs an asyncio HTTP server on 127.0.0.1 in a daemon thread; start/stop are called from any thread."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.port = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def start(self, *, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="FakeProviderServer", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"FakeProviderServer did not start listening within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"FakeProviderServer failed to start: {self._error!r}") from self._error

    def stop(self, *, timeout: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop already finished on its own
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"FakeProviderServer thread did not stop within {timeout} s")

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the server loop (thread-safe); a no-op once the loop has finished."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to start() if it happens before ready
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        live: set[_HttpProtocol] = set()
        server = await self._loop.create_server(
            lambda: _HttpProtocol(self._handler, live), host="127.0.0.1", port=0, backlog=2048
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for proto in list(live):
                proto.abort()
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
