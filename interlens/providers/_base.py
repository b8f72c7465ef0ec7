"""The provider-neutral request and result, and the client plumbing every provider module shares.

A request is built from the speaker's :class:`View` in the job (wherever it runs) and carries no secret, so it
pickles across a worker pipe; the gateway in the parent hands it to the provider's client, whose module
(``_provider_openai``, ``_provider_anthropic``) turns it into that provider's JSON body and reads the answer
back into an :class:`APIResult`, equally plain. What lives here is what the providers have in common: the
description a provider module gives of itself (:class:`Provider`), the client shards over small connection
pools, the SDKs' retry rule, the request digest a rerun compares before re-attaching to a batch row, and the
one POST path.

Clients are built in the parent, at first use, and the key stays inside the SDK client: never in a request,
a result, a log line or the ledger. Single requests go through the SDK's generic ``post`` with the JSON body
we built and a raw response that we parse ourselves: the typed ``create`` spends about a millisecond per call
transforming arguments and building models, which caps a 64-wide run on a small machine. There is one parsing
path, the users' one: the tests run it too, against a fake provider that validates what we send and answers
like the provider.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from interlens.scheduler.gateway import BatchRowError, Failure, ProviderClient, retry_after_seconds

from ._settings import APISettings

__all__ = [
    "CONTINUE_TURN",
    "OPENING_TURN",
    "APIRequest",
    "APIResult",
    "Messages",
    "Provider",
    "ProviderResponseError",
    "Shards",
    "classify_failure",
    "count",
    "is_local_endpoint",
    "post_json",
    "request_digest",
    "row_error",
    "tls_context",
]

OPENING_TURN = "Begin."
"""The user message put first when a view has none (Anthropic needs one; an empty chat is refused)."""

CONTINUE_TURN = "Continue."
"""The user message after a trailing own turn on Anthropic, which would otherwise *continue* that turn."""

Messages = tuple[tuple[str, str], ...]  # (role, content)

RETRY_STATUSES = frozenset({408, 409, 429})
RATE_LIMIT_STATUSES = frozenset({429, 529})


@dataclass(frozen=True, slots=True, kw_only=True)
class APIRequest:
    """One turn for a hosted model: everything but the key and the endpoint (those live in the parent).

    ``messages`` are already folded to what ``provider`` accepts; ``settings`` is the participant's record
    whole, with the turn's output cap and seed put in; the provider's module builds the body from both.
    ``turn``: the conversation's turn index (None: an ephemeral sample), the batch map's key.
    """

    provider: str
    model: str
    system: str | None
    messages: Messages
    settings: APISettings
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class APIResult:
    """A provider's answer to one request, normalized across providers.

    Usage as the provider reported it (never re-tokenized): ``prompt_tokens`` is every input token, of
    which ``cache_read_tokens`` were read from the provider's prompt cache and ``cache_write_tokens``
    written to it (Anthropic's ``cache_creation_input_tokens``; OpenAI reports no writes).
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    output_tokens: int | None
    model: str | None = None
    request_id: str | None = None
    batch_id: str | None = None
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    #: Each generated token's text and log-probability as the provider reported them, where asked
    #: (``APISettings.record_tokens``) and given; None where the answer carried none.
    token_logprobs: tuple[tuple[str, float], ...] | None = None


class ProviderResponseError(Exception):
    """A response that is an error although its HTTP status is not (OpenRouter's 200-with-error), or one that
    cannot be read. ``retryable``/``rate_limited`` follow the status code it carries."""

    def __init__(self, message: str, retryable: bool = False, rate_limited: bool = False) -> None:
        super().__init__(message, retryable, rate_limited)  # all in args: pickles across a worker pipe

    @property
    def retryable(self) -> bool:
        return bool(self.args[1])

    @property
    def rate_limited(self) -> bool:
        return bool(self.args[2])

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class Provider:
    """What a provider module tells the rest of interlens about one provider name.

    ``fold``: the (role, content) pairs of a view as the provider accepts them (the system block goes apart);
    ``body``: the JSON request body of an :class:`APIRequest`; ``client``: builds the gateway's
    :class:`ProviderClient` from ``(provider=, base_url=, api_key=, max_in_flight=)``; ``batch``: whether the
    provider has a batch API; ``title``: its name in messages. Keys and endpoints come from
    ``key_variable``/``url_variable`` (the names the official SDKs read), else ``default_url``.
    ``batch_price``: the batch API's price as a fraction of the live one, as the provider documents it
    (1.0: no documented discount), applied by cost estimates to batch turns. ``settings_problem``: what is
    wrong with a participant's :class:`APISettings` for this provider as the installed SDK talks to it (None:
    nothing), so a setting every request would be refused for fails at construction, not on every turn.

    Capabilities, read by the participant, the registry and the CLI instead of comparing provider names:
    ``batch`` (above), ``keyless_local`` (an endpoint on a local or private host is called without a key
    when none is set: OpenAI-compatible servers such as vLLM or ``transformers serve``), ``accepts_seed``
    (a request can carry a sampling seed, chat completions' ``seed``), ``token_logprobs`` (an answer can
    carry each generated token's log-probability, chat completions' ``logprobs``: what ``record_tokens``
    needs). ``sdk``: the official SDK's package, whose version a run records.
    """

    name: str
    title: str
    sdk: str
    key_variable: str
    url_variable: str
    default_url: str
    batch: bool
    fold: Callable[[Messages], Messages]
    body: Callable[[APIRequest], dict[str, Any]]
    client: Callable[..., ProviderClient]
    batch_price: float = 1.0
    settings_problem: Callable[[APISettings], str | None] = lambda settings: None
    keyless_local: bool = False
    accepts_seed: bool = False
    token_logprobs: bool = False


def is_local_endpoint(url: str) -> bool:
    """Whether ``url``'s host is this machine or a private network (``localhost``, 127.0.0.0/8, ::1, 10/8,
    172.16/12, 192.168/16, fc00::/7): where OpenAI-compatible servers (vLLM, SGLang, llama.cpp) run, by
    default without an API key."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


_SHARD_SIZE = 8

_TLS: dict[tuple[str, str | None, str | None], Any] = {}
_TLS_LOCK = threading.Lock()


def tls_context(base_url: str) -> Any:
    """The ``ssl.SSLContext`` the client shards for ``base_url`` use, built once per process and shared.

    Why: loading the system's CA store takes ~16 ms, and a run's gateway opens its clients anew (their
    connections belong to the run's event loop), so a context per client cost every run that much on its
    first API turn. An ``SSLContext`` is safe to share between clients, threads and event loops; it is keyed
    by the variables ``httpx2`` reads the CA store from (``SSL_CERT_FILE``, ``SSL_CERT_DIR``), so changing
    them between runs still takes effect. An ``http://`` endpoint (a local OpenAI-compatible server, the fake
    provider) never speaks TLS: our HTTP clients follow no redirects and use no proxy. It gets a context that
    verifies certificates against an EMPTY trust store, built without reading the CA store, so a TLS peer is
    never trusted through it (it fails closed rather than verifying nothing).
    """
    plain = base_url[:7].lower() == "http://"
    env = os.environ
    key = ("http", None, None) if plain else ("https", env.get("SSL_CERT_FILE"), env.get("SSL_CERT_DIR"))
    with _TLS_LOCK:
        context = _TLS.get(key)
        if context is None:
            if plain:
                import ssl

                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname, no CAs
            else:
                import httpx2

                context = httpx2.create_ssl_context()
            _TLS[key] = context
        return context


class Shards:
    """One provider client as several SDK clients over small connection pools, used least-loaded first.

    Why: httpcore's pool scans every one of its connections on each request (a syscall per idle one), so one
    pool of 64 connections costs a few tenths of a millisecond per request, most of the client's budget at
    64 requests per 50 ms. Pools of ``_SHARD_SIZE`` keep that scan short. The gateway's limiter bounds the
    total in flight, and least-loaded placement keeps every shard within its pool. Shards open on demand
    (live use needs one) and share the process's TLS context for their endpoint (:func:`tls_context`); shard 0
    has spare connections for batch control calls.
    Each SDK client runs on an ``httpx2.AsyncClient(trust_env=False)`` with the SDK's retries OFF (``make``
    sees to that): the gateway retries, so every 429 reaches its adaptive limiter.
    """

    def __init__(self, make: Any, max_in_flight: int, *, base_url: str) -> None:
        self._make = make
        self._count = -(-max_in_flight // _SHARD_SIZE)
        self._size = -(-max_in_flight // self._count)
        self._tls = tls_context(base_url)
        self.clients: list[Any] = []
        self.load: list[int] = []
        self._open()

    def _open(self) -> None:
        import httpx2

        size = self._size + (4 if not self.clients else 1)
        limits = httpx2.Limits(max_connections=size, max_keepalive_connections=size)
        timeout = httpx2.Timeout(600.0, connect=10.0)
        http = httpx2.AsyncClient(trust_env=False, verify=self._tls, limits=limits, timeout=timeout)
        self.clients.append(self._make(http))
        self.load.append(0)

    @property
    def control(self) -> Any:
        return self.clients[0]

    def pick(self) -> int:
        """The least-loaded shard (opening another when all are full); its load is counted up."""
        load = self.load
        best = 0
        for i in range(1, len(load)):
            if load[i] < load[best]:
                best = i
        if load[best] >= self._size and len(load) < self._count:
            self._open()
            best = len(load) - 1
        load[best] += 1
        return best

    async def aclose(self) -> None:
        for client in self.clients:
            await client.close()


def classify_failure(exc: BaseException, sdk: Any) -> Failure:
    """The SDKs' own retry rule (408/409/429/5xx, connection errors, ``x-should-retry``), as a Failure."""
    if isinstance(exc, ProviderResponseError):
        return Failure(exc.retryable, exc.rate_limited)
    if isinstance(exc, BatchRowError):
        return exc.failure
    if isinstance(exc, sdk.APIStatusError):
        status, headers = exc.status_code, exc.response.headers
        override = headers.get("x-should-retry")
        if override in ("true", "false"):
            retryable = override == "true"
        else:
            retryable = status in RETRY_STATUSES or status >= 500
        return Failure(retryable, status in RATE_LIMIT_STATUSES, retry_after_seconds(headers))
    if isinstance(exc, sdk.APIConnectionError):  # timeouts included
        return Failure(True)
    return Failure(False)


def count(value: Any) -> int:
    """A usage field as a token count: a non-negative int, else 0 (missing, null, or not a number)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def row_error(status: int | None, message: str) -> BatchRowError:
    """A failed batch row with an HTTP status, retryable by the same rule as a single call."""
    retryable = status is not None and (status in RETRY_STATUSES or status >= 500)
    return BatchRowError(message, retryable, status in RATE_LIMIT_STATUSES)


def request_digest(provider: str, base_url: str, endpoint: str, body: Mapping[str, Any]) -> str:
    """sha256 of one batch row's request as it is sent: provider, endpoint and the full JSON body, as
    canonical JSON (sorted keys, no spaces), so that any other prompt, model or parameter gives another hash.

    A rerun compares it before re-attaching a job to a batch row an earlier run submitted: an old answer
    must never be delivered to a new question. The custom id (it changes with the round) is left out, and so
    is every credential: the key travels in the SDK client's headers, and the base URL is reduced to scheme,
    host, port and path (no user info, no query).
    """
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    host = url.hostname or ""
    where = f"{url.scheme}://{host}{f':{url.port}' if url.port else ''}{url.path}"
    canonical = {"provider": provider, "base_url": where, "endpoint": endpoint, "body": body}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


async def post_json(
    shards: Shards,
    path: str,
    body: Mapping[str, Any],
    *,
    timeout: float,
    provider: str,
    headers: Mapping[str, Any] | None = None,
) -> tuple[Any, Any]:
    """POST one request body through the least-loaded client shard; the decoded JSON body and the headers.

    Goes through the SDK's generic ``post`` (not the typed ``create``) to skip response model building, the
    largest per-request cost on the client; a body that is not JSON is a retryable provider error.
    ``headers`` are the request's own (an omitted ``Authorization`` for an endpoint called without a key).
    """
    import httpx2

    shard = shards.pick()
    options: dict[str, Any] = {"timeout": timeout}
    if headers:
        options["headers"] = headers
    try:
        response = await shards.clients[shard].post(path, cast_to=httpx2.Response, body=body, options=options)
    finally:
        shards.load[shard] -= 1
    try:
        return json.loads(response.content), response.headers
    except ValueError as exc:
        raise ProviderResponseError(f"{provider} sent a body that is not JSON: {exc}", True) from exc
