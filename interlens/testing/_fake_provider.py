"""``FakeProviderServer``: a real loopback HTTP server speaking the OpenAI, Anthropic and OpenRouter formats.

Tests of hosted-model code drive the *official* SDKs against it, so the whole client path (serialization,
retries, timeouts, batch polling) is exercised for real; only the outside world is faked. The server runs on
its own thread, so a test's event loop stays free, and keeps all state (files, batches) itself, so a batch
created by one client can be polled by another, even from a fresh process after the first was killed.

The server knows no provider by name: each provider's wire is a :class:`FakeWire` record in its route module,
listed in ``_fake_provider_registry``, and the server reads the records (which wire a request is for, its
routes, credentials, error envelope, base URL and environment variables).

    with FakeProviderServer(latency=0.05) as server:
        client = AsyncOpenAI(base_url=server.openai_base_url, api_key="sk-test")
        server.fail_next(1, status=429, retry_after=0.01)
        ...
        assert server.max_concurrency <= 16
"""

from __future__ import annotations

import functools
import json
import re
import time
import traceback
from collections.abc import Callable
from typing import Any, Self, overload

from . import _fake_provider_openai as _openai
from ._fake_provider_core import (
    BatchSnapshot,
    Ctx,
    FakeWire,
    Fault,
    ReplyFn,
    RequestRecord,
    Route,
    RowPredicate,
    RowRule,
    State,
    check_positive,
    count_tokens,
    default_reply,
    error_response,
    new_id,
    redact,
)
from ._fake_provider_http import Connection, HttpRequest, HttpResponse, Server
from ._fake_provider_registry import registered

__all__ = ["BatchSnapshot", "FakeProviderServer", "RequestRecord", "count_tokens", "default_reply"]

_MALFORMED_BODY = b'{"id": "chatcmpl-truncated", "choices": [{"message": '
_MAX_HOLD = 300.0


def _check_count(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (how many upcoming requests to affect), got {n!r}")
    return n


def _check_status(status: int, *, low: int = 400) -> int:
    if isinstance(status, bool) or not isinstance(status, int) or not low <= status <= 599:
        raise ValueError(f"status must be an HTTP error status in [{low}, 599], got {status!r}")
    return status


def _authenticated(wire: FakeWire, headers: dict[str, str]) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return True
    return any(headers.get(name, "").strip() for name in wire.key_headers)


class _WireBaseURL:
    """A ``<name>_base_url`` property: :meth:`FakeProviderServer.base_url_for` the wire ``<name>``.

    The wire's name is read from the attribute's, so the properties the SDK tests use name no provider in
    code (a new wire needs none: ``base_url_for(name)`` and ``env()`` cover it).
    """

    def __set_name__(self, owner: type, attribute: str) -> None:
        self._wire = attribute.removesuffix("_base_url")
        self.__doc__ = f"The base URL to give the {self._wire} SDK (its wire's base path on this server)."

    @overload
    def __get__(self, server: None, owner: type | None = None) -> _WireBaseURL: ...

    @overload
    def __get__(self, server: FakeProviderServer, owner: type | None = None) -> str: ...

    def __get__(self, server: FakeProviderServer | None, owner: type | None = None) -> _WireBaseURL | str:
        return self if server is None else server.base_url_for(self._wire)


class FakeProviderServer:
    """Loopback fake of the OpenAI, Anthropic and OpenRouter HTTP APIs, with fault injection and meters.

    Args:
        latency: seconds every generation request (chat completion / message) waits before answering; other
            routes (files, batches) answer at once so polling tests stay fast. Change later with
            :meth:`set_latency`.
        polls_per_state: GETs of a batch needed per state change. OpenAI batches go validating → in_progress
            → finalizing → completed (or failed when the input file is invalid); Anthropic batches go
            in_progress → ended. Results are computed when the batch finishes, by ``reply``.
        reply: maps a request body (chat/messages body, or a batch row's body) to the reply text. The default
            is :func:`default_reply`. Called on a server thread under its lock: keep it fast, and do not
            wait on the server from inside it.
        hold_timeout: the longest a request waits while the server is :meth:`hold`-ing (the server never hangs
            forever on a forgotten :meth:`release`).
        require_auth: False serves requests that carry no credentials, like an OpenAI-compatible local
            server (vLLM, SGLang, llama.cpp) started without an API key; ``RequestRecord.authenticated``
            still says whether a request sent any.
    """

    def __init__(
        self,
        *,
        latency: float = 0.0,
        polls_per_state: int = 1,
        reply: ReplyFn | None = None,
        hold_timeout: float = 60.0,
        require_auth: bool = True,
    ) -> None:
        check_positive("latency", latency, upper=_MAX_HOLD)
        if isinstance(polls_per_state, bool) or not isinstance(polls_per_state, int) or polls_per_state < 1:
            raise ValueError(f"polls_per_state must be an int >= 1, got {polls_per_state!r}")
        if reply is not None and not callable(reply):
            raise TypeError(f"reply must be a callable body -> str, got {type(reply).__name__}")
        if not isinstance(require_auth, bool):
            raise TypeError(f"require_auth must be True or False, got {require_auth!r}")
        self._require_auth = require_auth
        self._hold_timeout = check_positive("hold_timeout", hold_timeout, allow_zero=False, upper=_MAX_HOLD)
        self._wires = registered()
        self._state = State(
            providers=self._wires.names, latency=float(latency), polls_per_state=polls_per_state, reply=reply
        )
        self._server = Server(self._handle)
        self._phase = "new"
        self._held = False
        self._waiters: set[Connection] = set()

    # -- lifecycle

    def start(self) -> Self:
        """Bind 127.0.0.1 on a free port and serve from a background thread; returns self."""
        if self._phase != "new":
            raise RuntimeError(f"FakeProviderServer is {self._phase}; a server starts once: create a new one")
        self._server.start()
        self._phase = "running"
        return self

    def stop(self) -> None:
        """Close the listening socket and abort every connection, in-flight requests included. Idempotent."""
        if self._phase == "running":
            self._phase = "stopped"
            self._server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses

    @property
    def port(self) -> int:
        if self._phase != "running":
            raise RuntimeError(
                "FakeProviderServer is not running: call start() or use `with FakeProviderServer()`"
            )
        return self._server.port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base_url_for(self, provider: str) -> str:
        """The base URL to give ``provider``'s SDK: the server's root and its wire's base path (without
        ``/v1`` for Anthropic, whose SDK's paths are absolute)."""
        return f"{self.base_url}{self._wires[self._provider(provider)].base_path}"

    openai_base_url = _WireBaseURL()
    anthropic_base_url = _WireBaseURL()
    openrouter_base_url = _WireBaseURL()

    def env(self, api_key: str = "sk-test") -> dict[str, str]:
        """Environment variables that point every provider's client here (for ``monkeypatch.setenv``): each
        wire's key and base-URL variables, the ones its SDK reads."""
        if not isinstance(api_key, str) or not api_key:
            raise ValueError("api_key must be a non-empty string (the fake accepts any key, but needs one)")
        out: dict[str, str] = {}
        for wire in self._wires:
            out[wire.key_variable] = api_key
            out[wire.url_variable] = self.base_url_for(wire.name)
        return out

    # -- fault injection (thread-safe; each fault is consumed by the requests it hits)

    def fail_next(
        self,
        n: int,
        *,
        status: int = 500,
        retry_after: float | None = None,
        retry_after_ms: float | None = None,
        should_retry: bool | None = None,
        message: str | None = None,
        provider: str | None = None,
        path: str | None = None,
    ) -> None:
        """Answer the next ``n`` matching requests with ``status`` in the provider's error envelope.

        ``retry_after`` / ``retry_after_ms`` / ``should_retry`` set the ``retry-after``, ``retry-after-ms``
        and ``x-should-retry`` headers the SDKs obey (use small delays: the Anthropic SDK honours any value).
        ``provider`` and ``path`` (exact, or an fnmatch pattern like ``"/v1/batches/*"``) narrow the match.
        """
        headers: dict[str, str] = {}
        if retry_after is not None:
            headers["retry-after"] = repr(check_positive("retry_after", retry_after, upper=_MAX_HOLD))
        if retry_after_ms is not None:
            ms = check_positive("retry_after_ms", retry_after_ms, upper=_MAX_HOLD * 1000)
            headers["retry-after-ms"] = repr(ms)
        if should_retry is not None:
            headers["x-should-retry"] = "true" if should_retry else "false"
        text = message or f"injected failure (HTTP {status}) from FakeProviderServer.fail_next"
        fault = Fault(
            "fail", _check_count(n), self._check_provider(provider), path, _check_status(status), headers
        )
        fault.message = text
        self._add_fault(fault)

    def timeout_next(
        self, n: int, *, seconds: float = 30.0, provider: str | None = None, path: str | None = None
    ) -> None:
        """Hold the next ``n`` matching requests for ``seconds`` (or until the client hangs up or the server
        stops), then answer normally: longer than a short client timeout, but never forever."""
        secs = check_positive("seconds", seconds, allow_zero=False, upper=_MAX_HOLD)
        self._add_fault(Fault("timeout", _check_count(n), self._check_provider(provider), path, seconds=secs))

    def malformed_next(
        self,
        n: int,
        *,
        content_type: str = "application/json",
        provider: str | None = None,
        path: str | None = None,
    ) -> None:
        """Answer the next ``n`` matching requests with HTTP 200 and a truncated, invalid JSON body."""
        fault = Fault(
            "malformed", _check_count(n), self._check_provider(provider), path, content_type=content_type
        )
        self._add_fault(fault)

    def _add_fault(self, fault: Fault) -> None:
        if fault.path is not None and not (isinstance(fault.path, str) and fault.path.startswith("/")):
            raise ValueError(f"path must be a request path like '/v1/chat/completions', got {fault.path!r}")
        with self._state.lock:
            self._state.faults.append(fault)

    def fail_batch_rows(
        self,
        predicate: RowPredicate,
        *,
        status: int = 400,
        message: str = "injected batch row failure from FakeProviderServer.fail_batch_rows",
        provider: str | None = None,
    ) -> None:
        """Make every batch row with ``predicate(custom_id, body) == True`` fail with ``status``.

        The rule stays until :meth:`clear_faults`. OpenAI rows land in the error file with that status code;
        Anthropic rows come back ``errored``. Rows that are not matched succeed as usual.
        """
        if not callable(predicate):
            raise TypeError("predicate must be a callable (custom_id, body) -> bool")
        rule = RowRule(predicate, _check_status(status), message, self._check_provider(provider))
        with self._state.lock:
            self._state.row_rules.append(rule)

    def clear_faults(self) -> None:
        """Drop pending faults and batch-row rules."""
        with self._state.lock:
            self._state.faults.clear()
            self._state.row_rules.clear()

    def set_latency(self, seconds: float) -> None:
        """Change the per-generation-request latency; applies to requests that arrive from now on."""
        value = check_positive("latency", seconds, upper=_MAX_HOLD)
        with self._state.lock:
            self._state.latency = value

    def hold(self) -> None:
        """Make generation requests wait (counted in flight) until :meth:`release` or ``hold_timeout``.

        This lets a test line up N concurrent requests deterministically: hold, fire N, wait until
        ``in_flight == N``, release.
        """
        with self._state.lock:
            self._held = True

    def release(self) -> None:
        """Let every held request (and later ones) through."""
        with self._state.lock:
            self._held = False
            waiters, self._waiters = self._waiters, set()
        for conn in waiters:
            conn.wake()

    # -- observation

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request since start (or :meth:`reset_meters`), in arrival order; credentials redacted."""
        with self._state.lock:
            return list(self._state.records)

    @property
    def in_flight(self) -> int:
        with self._state.lock:
            return sum(self._state.in_flight.values())

    def in_flight_for(self, provider: str) -> int:
        with self._state.lock:
            return self._state.in_flight[self._provider(provider)]

    @property
    def max_concurrency(self) -> int:
        """The most requests in flight at once (any provider) since start or :meth:`reset_meters`."""
        with self._state.lock:
            return self._state.max_total

    def max_concurrency_for(self, provider: str) -> int:
        with self._state.lock:
            return self._state.max_in_flight[self._provider(provider)]

    @property
    def batches_created(self) -> dict[str, int]:
        """Batches created per provider since start or :meth:`reset_meters`."""
        with self._state.lock:
            return {p: n for p, n in self._state.batches_created.items()}

    def batch_count(self, provider: str) -> int:
        with self._state.lock:
            return self._state.batches_created[self._provider(provider)]

    @property
    def batches(self) -> dict[str, BatchSnapshot]:
        """Every batch the server holds, by id (snapshots: polling does not change them afterwards)."""
        with self._state.lock:
            return {
                b.id: BatchSnapshot(b.id, provider, b.status, b.custom_ids, b.polls)
                for provider, store in self._state.batches.items()
                for b in store.values()
            }

    @staticmethod
    def token_logprobs(text: str) -> list[tuple[str, float]]:
        """The tokens and log-probabilities this server reports for a chat completion that answered
        ``text`` and was asked ``logprobs: true``: each word with the whitespace before it (they join to
        ``text``), each one's log-probability a fixed function of it (made up)."""
        return _openai.token_logprobs(text)

    @property
    def reported_usage(self) -> list[dict[str, Any]]:
        """The usage of every answer given since start or :meth:`reset_meters`, live or as a batch row, as
        the response reported it: ``{"provider", "model", "batch", "usage"}`` (the provider's own object)."""
        with self._state.lock:
            return [dict(entry) for entry in self._state.usage]

    @property
    def handler_errors(self) -> list[str]:
        """Tracebacks of exceptions raised while answering (e.g. by ``reply``); those requests got a 500."""
        with self._state.lock:
            return list(self._state.errors)

    def reset_meters(self) -> None:
        """Forget recorded requests, batch-creation counts and concurrency peaks (peaks restart at the
        current in-flight count). Batches, files and faults are kept."""
        with self._state.lock:
            self._state.records.clear()
            self._state.usage.clear()
            self._state.batches_created = dict.fromkeys(self._state.providers, 0)
            self._state.max_in_flight = dict(self._state.in_flight)
            self._state.max_total = sum(self._state.in_flight.values())

    def wait_until(self, predicate: Callable[[FakeProviderServer], bool], *, timeout: float = 10.0) -> None:
        """Block until ``predicate(server)`` is true; it is re-checked whenever a request starts or ends.

        Raises TimeoutError after ``timeout`` seconds. From async code use :meth:`await_until`, which keeps
        the event loop (and so the clients under test) running.
        """
        check_positive("timeout", timeout, allow_zero=False)
        with self._state.changed:
            if not self._state.changed.wait_for(lambda: predicate(self), timeout):
                raise TimeoutError(
                    f"FakeProviderServer condition not met within {timeout} s "
                    f"(in_flight={self.in_flight}, requests={len(self._state.records)})"
                )

    async def await_until(
        self, predicate: Callable[[FakeProviderServer], bool], *, timeout: float = 10.0
    ) -> None:
        """:meth:`wait_until` for async tests: waits in a worker thread so the event loop keeps running."""
        import anyio.to_thread

        wait = functools.partial(self.wait_until, predicate, timeout=timeout)
        await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)

    def _check_provider(self, provider: str | None) -> str | None:
        if provider is not None and provider not in self._wires:
            names = ", ".join(self._wires.names)
            raise ValueError(f"provider must be one of {names} or None (any), got {provider!r}")
        return provider

    def _provider(self, provider: str) -> str:
        checked = self._check_provider(provider)
        if checked is None:
            raise ValueError(f"provider must be one of {', '.join(self._wires.names)}, got None")
        return checked

    # -- request handling (server thread)

    def _handle(self, req: HttpRequest, conn: Connection) -> HttpResponse | None:
        wire = self._wires.classify(req.path, req.headers)
        payload: Any = None
        bad_json = False
        if req.body and "json" in req.headers.get("content-type", ""):
            try:
                payload = json.loads(req.body)
            except ValueError:
                bad_json = True
        authed = _authenticated(wire, req.headers)
        record = RequestRecord(
            provider=wire.name,
            method=req.method,
            path=req.path,
            query=req.query,
            headers=redact(req.headers),
            json=payload,
            time=time.monotonic(),
            authenticated=authed,
            connection=conn.id,
        )
        ctx = Ctx(
            wire=wire,
            method=req.method,
            path=req.path,
            query=req.query,
            headers=req.headers,
            body=req.body,
            json=payload,
            request_id=new_id("req_"),
            base_url=f"http://{req.headers.get('host') or f'127.0.0.1:{self._server.port}'}",
        )
        self._state.begin(record)
        status: int | None = None
        try:
            resp = self._respond(ctx, conn, authed, bad_json)
            if resp is not None:
                resp.headers.setdefault("x-request-id", ctx.request_id)
                resp.headers.setdefault("request-id", ctx.request_id)
                status = resp.status
            return resp
        finally:
            self._state.end(record, status)

    def _respond(self, ctx: Ctx, conn: Connection, authed: bool, bad_json: bool) -> HttpResponse | None:
        if not authed and self._require_auth:
            keys = ctx.wire.key_headers
            how = " or ".join(("Authorization: Bearer <key>", *keys)) if keys else "Bearer <key>"
            return ctx.error(401, f"missing credentials: send {how}")
        if bad_json:
            return ctx.error(400, "request body is not valid JSON")
        fault = self._state.take_fault(ctx.provider, ctx.path)
        if fault is not None and fault.kind == "fail":
            headers = dict(fault.headers)
            return error_response(ctx.wire, fault.status, fault.message, ctx.request_id, headers=headers)
        if fault is not None and fault.kind == "malformed":
            return HttpResponse(status=200, body=_MALFORMED_BODY, content_type=fault.content_type)
        if fault is not None and not conn.wait(fault.seconds):
            return None  # simulated timeout: the client gave up first
        found = self._route(ctx)
        if isinstance(found, HttpResponse):
            return found
        route, match = found
        if route.generation and not self._delay(conn):
            return None
        with self._state.lock:
            try:
                return route.handler(self._state, ctx, match)
            except Exception as exc:
                self._state.errors.append(traceback.format_exc())
                msg = f"FakeProviderServer failed to answer: {type(exc).__name__}: {exc}"
                return ctx.error(500, msg, retry=False)

    def _route(self, ctx: Ctx) -> tuple[Route, re.Match[str]] | HttpResponse:
        allowed = []
        for route in ctx.wire.routes:
            match = route.pattern.fullmatch(ctx.path)
            if match is not None and route.method == ctx.method:
                return route, match
            if match is not None:
                allowed.append(route.method)
        if allowed:
            return ctx.error(405, f"{ctx.method} is not allowed on {ctx.path}; use {' or '.join(allowed)}")
        return ctx.error(404, f"FakeProviderServer has no {ctx.provider} route {ctx.method} {ctx.path}")

    def _delay(self, conn: Connection) -> bool:
        """Hold gate, then latency; False if the client hung up meanwhile."""
        with self._state.lock:
            held = self._held
            if held:
                self._waiters.add(conn)  # before the first check: a release in between still wakes it
            latency = self._state.latency
        try:
            if held and not conn.wait(self._hold_timeout, until=lambda: not self._held):
                return False
        finally:
            with self._state.lock:
                self._waiters.discard(conn)
        return conn.wait(latency)
