"""Shared state, records and wire helpers of the fake provider server, and :class:`FakeWire`, the record a
provider's route module describes its wire with.

Everything mutable lives in :class:`State`, guarded by one re-entrant lock, because it is written by the
server's connection threads and read (meters, records, batch states) or configured (faults) from the test's
thread. Handlers run synchronously under the lock; only waits (latency, holds, simulated timeouts) happen
outside it. Nothing here knows a provider by name: meters and batch stores are keyed by the names of the
wires a server was built with (``_fake_provider_registry``), and what differs between providers (routes,
error envelope, credentials, base path) is read from their :class:`FakeWire`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from ._fake_provider_http import HttpResponse

ReplyFn = Callable[[dict[str, Any]], str]
RowPredicate = Callable[[str, dict[str, Any]], bool]

_SECRET_HINTS = ("auth", "key", "token", "secret", "cookie")


@dataclass(slots=True)
class RequestRecord:
    """One request as the server saw it; credentials are redacted before the record is made.

    ``status`` is None while the request is in flight (or if the client hung up before a response).
    ``time`` is ``time.monotonic()`` at arrival, so records can be compared with each other.
    ``connection`` identifies the TCP connection (equal ids: a kept-alive connection was reused).
    """

    provider: str
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    json: Any
    time: float
    authenticated: bool
    connection: int
    status: int | None = None


@dataclass(frozen=True, slots=True)
class BatchSnapshot:
    """A provider batch as held by the server (a copy: later polls do not change it)."""

    id: str
    provider: str
    status: str
    custom_ids: tuple[str, ...]
    polls: int
    """GETs of this batch so far (each one may advance its state)."""


@dataclass(slots=True)
class Fault:
    kind: Literal["fail", "timeout", "malformed"]
    remaining: int
    provider: str | None
    path: str | None
    status: int = 500
    headers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    content_type: str = "application/json"
    message: str = ""

    def matches(self, provider: str, path: str) -> bool:
        import fnmatch

        if self.provider is not None and self.provider != provider:
            return False
        return self.path is None or self.path == path or fnmatch.fnmatchcase(path, self.path)


@dataclass(frozen=True, slots=True)
class RowRule:
    predicate: RowPredicate
    status: int
    message: str
    provider: str | None


@dataclass(frozen=True, slots=True)
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    truncated: bool


def count_tokens(text: str) -> int:
    """The fake's token count: whitespace-separated words. Stable, so tests can predict usage exactly."""
    return len(text.split())


def content_text(content: Any) -> str:
    """Plain text of a message ``content`` (a string, or a list of OpenAI/Anthropic text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return " ".join(texts)
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """All prompt text of a chat/messages body (Anthropic ``system`` included), for token counting."""
    parts = [content_text(body.get("system"))]
    for msg in body.get("messages") or []:
        if isinstance(msg, dict):
            parts.append(content_text(msg.get("content")))
    return " ".join(p for p in parts if p)


def default_reply(body: dict[str, Any]) -> str:
    """The default reply: names the last user message and hashes the whole prompt.

    Deterministic, and different for every distinct conversation history, so a test can check that each
    result landed on the conversation that asked for it: ``default_reply(request_body)`` gives the expected
    text.
    """
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    users = [m for m in messages if m.get("role") == "user"] or messages
    last = " ".join(content_text(users[-1].get("content")).split()) if users else ""
    canon = json.dumps({"system": body.get("system"), "messages": messages}, sort_keys=True, default=str)
    digest = hashlib.sha256(canon.encode()).hexdigest()[:8]
    return f"reply to {last[:40]} [{digest}]"


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def rfc3339(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def redact(headers: dict[str, str]) -> dict[str, str]:
    """Copy of ``headers`` with every credential-looking value replaced, keeping the auth scheme visible."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        if any(h in name for h in _SECRET_HINTS):
            scheme, sep, _ = value.partition(" ")
            out[name] = f"{scheme} ***" if sep and scheme.lower() in ("bearer", "basic") else "***"
        else:
            out[name] = value
    return out


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> HttpResponse:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return HttpResponse(status=status, body=body, headers=dict(headers or {}))


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    """JSONL with a newline after every line and never a blank line (a blank line breaks the SDK decoder)."""
    return "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()


def error_response(
    wire: FakeWire,
    status: int,
    message: str,
    request_id: str,
    *,
    headers: dict[str, str] | None = None,
    retry: bool | None = None,
) -> HttpResponse:
    """``status`` with ``message`` in the error envelope of ``wire`` (the SDKs read different parts of it)."""
    hdrs = dict(headers or {})
    if retry is not None:
        hdrs.setdefault("x-should-retry", "true" if retry else "false")
    return json_response(wire.error_body(status, message, request_id), status, hdrs)


def check_positive(name: str, value: float, *, allow_zero: bool = True, upper: float | None = None) -> float:
    """Validate a duration-like number early, with a message that says what to pass instead."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be <= {upper} (keep tests bounded), got {value!r}")
    return float(value)


class State:
    """All mutable server state; every method is called with ``lock`` held or takes it itself."""

    def __init__(
        self, *, providers: tuple[str, ...], latency: float, polls_per_state: int, reply: ReplyFn | None
    ) -> None:
        self.providers = providers
        """The names of the server's wires: the keys of the meters and of the batch stores."""
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.latency = latency
        self.polls_per_state = polls_per_state
        self.reply: ReplyFn = reply or default_reply
        self.records: list[RequestRecord] = []
        self.in_flight: dict[str, int] = dict.fromkeys(providers, 0)
        self.max_in_flight: dict[str, int] = dict.fromkeys(providers, 0)
        self.max_total = 0
        self.batches_created: dict[str, int] = dict.fromkeys(providers, 0)
        self.faults: list[Fault] = []
        self.row_rules: list[RowRule] = []
        self.errors: list[str] = []
        #: Usage of every answer given (live or as a batch row), as reported: the meter tests compare with.
        self.usage: list[dict[str, Any]] = []
        #: Prompt prefixes in the provider's cache: (provider, model, sha256 of the prefix's blocks).
        self.prompt_cache: set[tuple[str, str, str]] = set()
        # Provider resources; the provider modules own their shapes. A batch has ``id``, ``status``,
        # ``polls`` and ``custom_ids`` (what :class:`BatchSnapshot` shows of it).
        self.files: dict[str, Any] = {}
        self.batches: dict[str, dict[str, Any]] = {name: {} for name in providers}
        """Each wire's batches by id (empty for a wire without a batch API)."""

    def begin(self, record: RequestRecord) -> None:
        with self.changed:
            self.records.append(record)
            p = record.provider
            self.in_flight[p] += 1
            self.max_in_flight[p] = max(self.max_in_flight[p], self.in_flight[p])
            self.max_total = max(self.max_total, sum(self.in_flight.values()))
            self.changed.notify_all()

    def end(self, record: RequestRecord, status: int | None) -> None:
        with self.changed:
            record.status = status
            self.in_flight[record.provider] -= 1
            self.changed.notify_all()

    def take_fault(self, provider: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining > 0 and fault.matches(provider, path):
                    fault.remaining -= 1
                    self.faults = [f for f in self.faults if f.remaining > 0]
                    return fault
            return None

    def row_failure(self, provider: str, custom_id: str, body: dict[str, Any]) -> RowRule | None:
        for rule in self.row_rules:
            if (rule.provider is None or rule.provider == provider) and rule.predicate(custom_id, body):
                return rule
        return None

    def generate(self, body: dict[str, Any], max_tokens: Any) -> Generation:
        """Run the reply function and apply ``max_tokens`` (truncating to that many words)."""
        text = self.reply(body)
        if not isinstance(text, str):
            raise TypeError(f"reply function must return str, got {type(text).__name__}")
        words = text.split()
        truncated = isinstance(max_tokens, int) and 0 < max_tokens < len(words)
        if truncated:
            text = " ".join(words[:max_tokens])
        return Generation(text, count_tokens(prompt_text(body)), count_tokens(text), truncated)

    def cache_lookup(
        self, provider: str, model: str, blocks: list[tuple[Any, int, bool]], *, automatic: bool
    ) -> tuple[int, int]:
        """(tokens read from the cache, tokens written to it) for a prompt made of ``blocks``.

        Each block is (its content without cache markers, its tokens, whether it carries a breakpoint).
        Anthropic (``automatic=False``) caches the prefix ending at each breakpoint, and a request reads the
        longest cached prefix ending at a block boundary up to its last breakpoint; it writes from there to
        that breakpoint. OpenAI (``automatic=True``) caches every message-boundary prefix by itself and
        reports reads only. Simplified: no minimum length, no 128-token steps, no expiry.
        """
        digest = hashlib.sha256(model.encode())
        prefixes: list[tuple[str, int, bool]] = []
        total = 0
        for content, tokens, marked in blocks:
            digest.update(json.dumps(content, sort_keys=True, default=str).encode())
            total += tokens
            prefixes.append((digest.hexdigest(), total, marked))
        last = len(prefixes) if automatic else max((i + 1 for i, p in enumerate(prefixes) if p[2]), default=0)
        read = 0
        for key, tokens, _ in prefixes[:last]:
            if (provider, model, key) in self.prompt_cache:
                read = tokens
        written = 0
        for key, tokens, marked in prefixes[:last]:
            if automatic or marked:
                self.prompt_cache.add((provider, model, key))
                written = tokens
        return read, 0 if automatic else max(written - read, 0)

    def now(self) -> float:
        return time.time()


@dataclass(frozen=True, slots=True)
class Ctx:
    """One request being handled: what the provider modules need besides the state."""

    wire: FakeWire
    """The wire the request was classified to: its name is the request's provider."""
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    json: Any
    request_id: str
    base_url: str
    """``http://<Host header>``: URLs the server hands out point back at itself, as the client reached it."""

    @property
    def provider(self) -> str:
        return self.wire.name

    def error(self, status: int, message: str, *, retry: bool | None = None) -> HttpResponse:
        return error_response(self.wire, status, message, self.request_id, retry=retry)


class Route(NamedTuple):
    """One endpoint: ``pattern`` must match the whole path; ``generation`` routes get latency and holds."""

    method: str
    pattern: re.Pattern[str]
    handler: Callable[[State, Ctx, re.Match[str]], HttpResponse]
    generation: bool = False


@dataclass(frozen=True, slots=True)
class FakeWire:
    """One provider's wire format as the fake server speaks it: everything the server decides per provider.

    Each route module describes its wire(s) with one (``_fake_provider_openai``: OpenAI and OpenRouter;
    ``_fake_provider_anthropic``), and ``_fake_provider_registry`` lists them, like ``Provider`` records in
    ``interlens/providers/_registry.py``; the server reads the record instead of comparing names.

    ``name``: the provider's name (``RequestRecord.provider``, fault filters, meters, ``<name>_base_url``).
    ``key_variable``/``url_variable``: the environment variables its SDK reads (``FakeProviderServer.env``).
    ``base_path``: what its base URL adds to the server's root (``/v1``; empty where the SDK's paths are
    absolute, as Anthropic's ``/v1/messages`` are). ``routes``: its endpoints. ``error_body``: its error
    envelope from ``(status, message, request id)``.

    Which wire a request is for: the one with the longest of ``path_prefixes`` the path starts with, else the
    first whose ``marker_headers`` (headers only its SDK sends) the request carries, else the ``fallback``
    wire (exactly one; the OpenAI-compatible one, whose paths other servers share). ``key_headers``: headers
    that carry a key besides ``Authorization: Bearer`` (Anthropic's ``x-api-key``).
    """

    name: str
    key_variable: str
    url_variable: str
    base_path: str
    routes: tuple[Route, ...]
    error_body: Callable[[int, str, str], dict[str, Any]]
    path_prefixes: tuple[str, ...] = ()
    marker_headers: tuple[str, ...] = ()
    key_headers: tuple[str, ...] = ()
    fallback: bool = False
