"""Provider adapters over the official async SDKs (the gateway's ``ProviderClient``s).

Each adapter owns one SDK client on an ``httpx2.AsyncClient(trust_env=False)`` sized to the in-flight limit,
with the SDK's retries OFF: the gateway retries, so every 429 reaches its adaptive limiter. Keys and
endpoints come from the environment the way the SDKs read them (``OPENAI_API_KEY``/``OPENAI_BASE_URL``,
``ANTHROPIC_*``, ``OPENROUTER_*``); an adapter is built in the parent, at first use, and the key stays
inside the SDK client: never in a request, a result, a log line or the ledger.

Single requests go through the SDK's generic ``post`` with the JSON body we built and a raw response that we
parse ourselves: the typed ``create`` spends about a millisecond per call transforming arguments and
building models, which caps a 64-wide run on a small machine. There is one parsing path, the users' one:
the tests run it too, against a fake provider that validates what we send and answers like the provider.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final

from interlens.scheduler._gateway import (
    BatchLimits,
    BatchRowError,
    BatchStatus,
    Failure,
    SubmittedBatch,
    retry_after_seconds,
)

from ._api_request import APIRequest, APIResult, ProviderResponseError
from ._exceptions import ConfigurationError

__all__ = ["ENVIRONMENT", "PROVIDERS", "open_client", "read_api_key", "resolve_base_url"]

PROVIDERS = ("openai", "anthropic", "openrouter")

#: provider -> (key variable, endpoint variable, default endpoint)
ENVIRONMENT: dict[str, tuple[str, str, str]] = {
    "openai": ("OPENAI_API_KEY", "OPENAI_BASE_URL", "https://api.openai.com/v1"),
    "anthropic": ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "https://api.anthropic.com"),
    "openrouter": ("OPENROUTER_API_KEY", "OPENROUTER_BASE_URL", "https://openrouter.ai/api/v1"),
}

_RETRY_STATUSES = frozenset({408, 409, 429})
_RATE_LIMIT_STATUSES = frozenset({429, 529})
_OPENAI_BATCH_ENDPOINT: Final = "/v1/chat/completions"
_OPENAI_DONE = frozenset({"completed", "failed", "expired", "cancelled"})
_OPENAI_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter"}
_ANTHROPIC_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}
_ANTHROPIC_RETRY_TYPES = frozenset({"rate_limit_error", "overloaded_error", "api_error", "timeout_error"})


def resolve_base_url(provider: str, base_url: str | None) -> str:
    """An explicit ``base_url`` wins, then the provider's ``*_BASE_URL`` variable, then the public one."""
    _, variable, default = ENVIRONMENT[provider]
    return (base_url or os.environ.get(variable) or default).rstrip("/")


def read_api_key(provider: str, *, who: str) -> str:
    variable = ENVIRONMENT[provider][0]
    key = os.environ.get(variable, "").strip()
    if not key:
        raise ConfigurationError(
            f"{who} needs an API key for {provider}: set the environment variable {variable} "
            "(read from the environment at first use, never stored)"
        )
    return key


_SHARD_SIZE = 8


class _Shards:
    """One provider client as several SDK clients over small connection pools, used least-loaded first.

    Why: httpcore's pool scans every one of its connections on each request (a syscall per idle one), so one
    pool of 64 connections costs a few tenths of a millisecond per request, most of the client's budget at
    64 requests per 50 ms. Pools of ``_SHARD_SIZE`` keep that scan short. The gateway's limiter bounds the
    total in flight, and least-loaded placement keeps every shard within its pool. Shards open on demand
    (live use needs one) and share one TLS context; shard 0 has spare connections for batch control calls.
    """

    def __init__(self, make: Any, max_in_flight: int) -> None:
        import httpx2

        self._make = make
        self._count = -(-max_in_flight // _SHARD_SIZE)
        self._size = -(-max_in_flight // self._count)
        self._tls = httpx2.create_ssl_context()
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


def open_client(provider: str, *, base_url: str | None, max_in_flight: int, who: str) -> Any:
    """The adapter for ``provider`` (called by the gateway, in the parent, at first use)."""
    key = read_api_key(provider, who=who)
    url = resolve_base_url(provider, base_url)
    if provider == "anthropic":
        return AnthropicClient(base_url=url, api_key=key, max_in_flight=max_in_flight)
    return OpenAIClient(provider=provider, base_url=url, api_key=key, max_in_flight=max_in_flight)


def _classify(exc: BaseException, sdk: Any) -> Failure:
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
            retryable = status in _RETRY_STATUSES or status >= 500
        return Failure(retryable, status in _RATE_LIMIT_STATUSES, retry_after_seconds(headers))
    if isinstance(exc, sdk.APIConnectionError):  # timeouts included
        return Failure(True)
    return Failure(False)


def _row_error(status: int | None, message: str) -> BatchRowError:
    retryable = status is not None and (status in _RETRY_STATUSES or status >= 500)
    return BatchRowError(message, retryable, status in _RATE_LIMIT_STATUSES)


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


def _json_line(custom_id: str, request: APIRequest) -> str:
    line = {"custom_id": custom_id, "method": "POST", "url": _OPENAI_BATCH_ENDPOINT, "body": request.body()}
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False)


class OpenAIClient:
    """OpenAI, and OpenRouter (the OpenAI SDK on OpenRouter's endpoint; it has no batch API)."""

    batch_limits = BatchLimits(max_requests=50_000, max_bytes=200 * 1024 * 1024)

    def __init__(self, *, provider: str, base_url: str, api_key: str, max_in_flight: int) -> None:
        import openai

        self.provider = provider
        self._base_url = base_url
        self._sdk_module = openai
        headers = {"X-Title": "interlens"} if provider == "openrouter" else None
        self._shards = _Shards(
            lambda http: openai.AsyncOpenAI(
                api_key=api_key,
                base_url=base_url,
                max_retries=0,
                http_client=http,
                default_headers=headers,
            ),
            max_in_flight,
        )
        self._sdk = self._shards.control
        self._last: dict[str, Any] = {}  # batch id -> the poll that found it done (saves a GET)

    def classify(self, exc: BaseException) -> Failure:
        return _classify(exc, self._sdk_module)

    async def send(self, request: APIRequest) -> APIResult:
        data, headers = await _post_json(self._shards, "/chat/completions", request, provider=self.provider)
        return self._parse(data, headers.get("x-request-id"), None)

    def _parse(self, data: Any, request_id: str | None, batch_id: str | None) -> APIResult:
        if not isinstance(data, dict):
            raise ProviderResponseError(
                f"{self.provider} sent a {type(data).__name__}, not a completion", True
            )
        error = data.get("error")
        choices: Any = data.get("choices")
        if isinstance(error, dict) and not choices:  # OpenRouter: an error after a 200 (mid-generation)
            code = error.get("code")
            status = code if isinstance(code, int) else None
            raise ProviderResponseError(
                f"{self.provider} answered 200 with an error: {error.get('message', error)}",
                status is not None and (status in _RETRY_STATUSES or status >= 500),
                status in _RATE_LIMIT_STATUSES,
            )
        try:
            choice = choices[0]
            finish = choice.get("finish_reason")
            if finish == "error":
                raise ProviderResponseError(
                    f"{self.provider} reported finish_reason='error' mid-generation", True
                )
            text = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ProviderResponseError(
                f"{self.provider} sent a malformed completion ({exc!r})", True
            ) from exc
        usage = data.get("usage") or {}
        return APIResult(
            text=text,
            finish_reason=_OPENAI_FINISH.get(finish, finish),
            prompt_tokens=usage.get("prompt_tokens"),
            output_tokens=usage.get("completion_tokens"),
            model=data.get("model"),
            request_id=request_id,
            batch_id=batch_id,
        )

    # ------------------------------------------------------------------------------------------- batches
    def row_size(self, request: APIRequest) -> int:
        return len(_json_line("r000000", request).encode()) + 1

    def request_hash(self, request: APIRequest) -> str:
        return request_digest(self.provider, self._base_url, _OPENAI_BATCH_ENDPOINT, request.body())

    async def submit_batch(self, rows: Sequence[tuple[str, APIRequest]]) -> SubmittedBatch:
        if self.provider != "openai":
            raise ConfigurationError(f"{self.provider} has no batch API; use batch=False")
        content = "".join(_json_line(cid, request) + "\n" for cid, request in rows).encode()
        upload = await self._sdk.files.create(
            file=("interlens-batch.jsonl", content, "application/jsonl"), purpose="batch"
        )
        batch = await self._sdk.batches.create(
            input_file_id=upload.id, endpoint=_OPENAI_BATCH_ENDPOINT, completion_window="24h"
        )
        return SubmittedBatch(
            batch.id, batch.status, {"input_file_id": upload.id, "endpoint": _OPENAI_BATCH_ENDPOINT}
        )

    async def poll_batch(self, batch_id: str, meta: Mapping[str, Any]) -> BatchStatus:
        batch = await self._sdk.batches.retrieve(batch_id)
        done = batch.status in _OPENAI_DONE
        if done:
            self._last[batch_id] = batch
        return BatchStatus(batch.status, done)

    async def batch_results(self, batch_id: str, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        batch = self._last.pop(batch_id, None) or await self._sdk.batches.retrieve(batch_id)
        if batch.status == "failed":
            errors = getattr(batch.errors, "data", None) or []
            reasons = "; ".join(f"line {e.line}: {e.message}" for e in errors[:5]) or "no reason given"
            return {"*": BatchRowError(f"openai batch {batch_id} failed validation: {reasons}")}
        out: dict[str, Any] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:
                continue
            content = await self._sdk.files.content(file_id)
            for line in content.text.splitlines():
                if line.strip():
                    row = json.loads(line)
                    out[row["custom_id"]] = self._row(row, batch_id)
        return out

    def _row(self, row: Mapping[str, Any], batch_id: str) -> Any:
        response = row.get("response") or {}
        status = response.get("status_code")
        if status == 200:
            try:
                return self._parse(response.get("body"), response.get("request_id"), batch_id)
            except ProviderResponseError as exc:
                return exc
        error = row.get("error") or (response.get("body") or {}).get("error") or {}
        message = error.get("message", "no message") if isinstance(error, dict) else str(error)
        code = error.get("code") if isinstance(error, dict) else None
        if status is None:  # expired or cancelled before it ran
            retryable = code in ("batch_expired", "request_timeout")
            return BatchRowError(f"openai batch row {code or 'failed'}: {message}", retryable)
        return _row_error(status, f"openai batch row HTTP {status}: {message}")

    async def aclose(self) -> None:
        await self._shards.aclose()


class AnthropicClient:
    """Anthropic messages and message batches."""

    provider = "anthropic"
    batch_limits = BatchLimits(max_requests=100_000, max_bytes=256 * 1024 * 1024)

    def __init__(self, *, base_url: str, api_key: str, max_in_flight: int) -> None:
        import anthropic

        self._base_url = base_url
        self._sdk_module = anthropic
        self._shards = _Shards(
            lambda http: anthropic.AsyncAnthropic(
                api_key=api_key,
                base_url=base_url,
                max_retries=0,
                http_client=http,
            ),
            max_in_flight,
        )
        self._sdk = self._shards.control

    def classify(self, exc: BaseException) -> Failure:
        return _classify(exc, self._sdk_module)

    async def send(self, request: APIRequest) -> APIResult:
        data, headers = await _post_json(self._shards, "/v1/messages", request, provider="anthropic")
        return self._parse(data, headers.get("request-id"), None)

    def _parse(self, data: Any, request_id: str | None, batch_id: str | None) -> APIResult:
        try:
            text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
            usage = data.get("usage") or {}
            stop = data.get("stop_reason")
        except (KeyError, TypeError, AttributeError) as exc:
            raise ProviderResponseError(f"anthropic sent a malformed message ({exc!r})", True) from exc
        return APIResult(
            text=text,
            finish_reason=_ANTHROPIC_FINISH.get(stop, stop),
            prompt_tokens=usage.get("input_tokens"),
            output_tokens=usage.get("output_tokens"),
            model=data.get("model"),
            request_id=request_id,
            batch_id=batch_id,
        )

    # ------------------------------------------------------------------------------------------- batches
    def row_size(self, request: APIRequest) -> int:
        row = {"custom_id": "r000000", "params": request.body()}
        return len(json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode()) + 1

    def request_hash(self, request: APIRequest) -> str:
        return request_digest(self.provider, self._base_url, "/v1/messages/batches", request.body())

    async def submit_batch(self, rows: Sequence[tuple[str, APIRequest]]) -> SubmittedBatch:
        requests: Any = [{"custom_id": cid, "params": request.body()} for cid, request in rows]
        batch = await self._sdk.messages.batches.create(requests=requests)
        return SubmittedBatch(batch.id, batch.processing_status, {})

    async def poll_batch(self, batch_id: str, meta: Mapping[str, Any]) -> BatchStatus:
        batch = await self._sdk.messages.batches.retrieve(batch_id)
        return BatchStatus(batch.processing_status, batch.processing_status == "ended")

    async def batch_results(self, batch_id: str, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        out: dict[str, Any] = {}
        async for row in await self._sdk.messages.batches.results(batch_id):
            result = row.result
            if result.type == "succeeded":
                try:
                    out[row.custom_id] = self._parse(result.message.model_dump(), None, batch_id)
                except ProviderResponseError as exc:
                    out[row.custom_id] = exc
            elif result.type == "errored":
                error = getattr(result.error, "error", None)
                kind = getattr(error, "type", "error")
                message = getattr(error, "message", str(result.error))
                out[row.custom_id] = BatchRowError(
                    f"anthropic batch row errored ({kind}): {message}",
                    kind in _ANTHROPIC_RETRY_TYPES,
                    kind in ("rate_limit_error", "overloaded_error"),
                )
            else:  # canceled: on purpose, not retried; expired: the batch window ran out, worth another go
                out[row.custom_id] = BatchRowError(
                    f"anthropic batch row {result.type}", result.type == "expired"
                )
        return out

    async def aclose(self) -> None:
        await self._shards.aclose()


async def _post_json(shards: _Shards, path: str, request: APIRequest, *, provider: str) -> tuple[Any, Any]:
    """POST one request through the least-loaded client shard; the decoded JSON body and the headers.

    Goes through the SDK's generic ``post`` (not the typed ``create``) to skip response model building, the
    largest per-request cost on the client; a body that is not JSON is a retryable provider error.
    """
    import httpx2

    shard = shards.pick()
    try:
        response = await shards.clients[shard].post(
            path, cast_to=httpx2.Response, body=request.body(), options={"timeout": request.timeout}
        )
    finally:
        shards.load[shard] -= 1
    try:
        return json.loads(response.content), response.headers
    except ValueError as exc:
        raise ProviderResponseError(f"{provider} sent a body that is not JSON: {exc}", True) from exc
