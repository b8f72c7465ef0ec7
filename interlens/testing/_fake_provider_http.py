"""The fake provider's HTTP layer: the standard library's ``ThreadingHTTPServer``, one thread per connection.

The stdlib parses requests and writes responses; this module adds only what a fake of a hosted API needs on
top: a waiting request notices when its client hangs up (so a simulated timeout ends as soon as the SDK gives
up instead of pinning a thread), can be woken early (``FakeProviderServer.release``), and :meth:`Server.stop`
ends every connection, idle kept-alive ones and in-flight requests included, then joins their threads.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

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
    """The handler's view of its client connection: waits that end early when the client hangs up."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket) -> None:
        self.id = next(Connection._ids)
        """Distinct per TCP connection, so tests can see keep-alive reuse."""
        self.closed = False
        self._sock = sock
        self._wake_r, self._wake_w = socket.socketpair()

    def wake(self) -> None:
        """Make a current (or the next) :meth:`wait` re-check its condition; callable from any thread."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def wait(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Wait ``seconds``, or less once ``until()`` is true (re-checked on :meth:`wake`); return True if
        the client is still there. A readable socket with nothing to read is a client that hung up."""
        deadline = time.monotonic() + seconds
        watch: list[socket.socket] = [self._sock, self._wake_r]
        while not self.closed:
            remaining = deadline - time.monotonic()
            if (until is not None and until()) or remaining <= 0:
                return True
            ready, _, _ = select.select(watch, [], [], remaining)
            if self._wake_r in ready:
                self._wake_r.recv(4096)
            if self._sock in ready:
                try:
                    self.closed = not self._sock.recv(1, socket.MSG_PEEK)
                except OSError:
                    self.closed = True
                watch = [self._wake_r]  # bytes of a next request: not a hang-up, stop watching
        return False

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()


Handler = Callable[[HttpRequest, Connection], HttpResponse | None]


class _RequestHandler(BaseHTTPRequestHandler):
    """Adapts one stdlib connection to :data:`Handler`; keep-alive is the stdlib's HTTP/1.1 default."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # head and body are two writes: no wait for the client's delayed ACK
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        self.conn = Connection(self.connection)
        self.server.track(self, add=True)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self.server.track(self, add=False)
        self.conn.close()

    def log_message(self, format: str, *args: object) -> None:
        """Silence the per-request access log on stderr."""

    def _serve(self) -> None:
        body = self._read_body()
        if body is None:
            return
        url = urlsplit(self.path)
        req = HttpRequest(
            method=self.command.upper(),
            path=url.path,
            query=dict(parse_qsl(url.query, keep_blank_values=True)),
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
        )
        resp = self.server.handler(req, self.conn)
        if resp is None or self.conn.closed:
            self.close_connection = True  # the client left (or the server is stopping): answer no one
            return
        self.send_response(resp.status, _EXTRA_REASONS.get(resp.status))
        self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(resp.body)))
        self.send_header("Connection", "close" if self.close_connection else "keep-alive")
        for name, value in resp.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(resp.body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _read_body(self) -> bytes | None:
        """The request body, ``Content-Length`` or chunked; None (and a 400 sent) if it is malformed."""
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                chunks: list[bytes] = []
                while size := int(self.rfile.readline(1024).split(b";")[0].strip(), 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline(8)
                self.rfile.readline(8)
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("content-length") or 0))
        except ValueError:
            self.send_error(400, "malformed Content-Length or chunk size")
            return None


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True  # joined by Server.stop, with a timeout, rather than by server_close
    request_queue_size = 2048  # tests open 64+ connections at once

    def __init__(self, handler: Handler) -> None:
        super().__init__(("127.0.0.1", 0), _RequestHandler)
        self.handler = handler
        self.stopping = False
        self._lock = threading.Lock()
        self._live: dict[_RequestHandler, threading.Thread] = {}

    def track(self, handler: _RequestHandler, *, add: bool) -> None:
        with self._lock:
            if add and not self.stopping:
                self._live[handler] = threading.current_thread()
            elif add:  # accepted while stopping: end it at once
                handler.conn.closed = True
                handler.close_connection = True
                with contextlib.suppress(OSError):
                    handler.connection.shutdown(socket.SHUT_RDWR)
            else:
                self._live.pop(handler, None)

    def handle_error(self, request: object, client_address: object) -> None:
        """A write to a connection that :meth:`abort_all` shut is expected; anything else is reported."""
        if not self.stopping:
            super().handle_error(request, client_address)  # type: ignore[arg-type]

    def abort_all(self) -> list[threading.Thread]:
        """Shut every live connection down (readers see EOF, waits end); return the threads to join."""
        with self._lock:
            self.stopping = True
            live = dict(self._live)
        for handler in live:
            handler.conn.closed = True
            handler.conn.wake()
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)
        return list(live.values())


class Server:
    """Serves ``handler`` on 127.0.0.1 (a free port) from a background thread; start/stop from any thread."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._httpd: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> None:
        self._httpd = _HttpServer(self._handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="FakeProviderServer"
        )
        self._thread.daemon = True
        self._thread.start()

    def stop(self, *, timeout: float = 10.0) -> None:
        httpd, thread = self._httpd, self._thread
        if httpd is None or thread is None:
            return
        deadline = time.monotonic() + timeout
        httpd.shutdown()  # no new connections are accepted after this returns
        thread.join(timeout)
        for worker in httpd.abort_all():
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                raise RuntimeError(f"a FakeProviderServer connection did not stop within {timeout} s")
        httpd.server_close()
