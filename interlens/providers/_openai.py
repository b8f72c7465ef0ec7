"""OpenAI and OpenRouter: chat completions through the official ``openai`` SDK, and OpenAI's batch API.

OpenRouter speaks OpenAI's chat completions on its own endpoint, so one client serves both; it differs in
four places, all here: it still takes ``max_tokens`` (OpenAI deprecated it for ``max_completion_tokens``,
which reasoning models require), it may answer 200 with an error mid-generation, it has no batch API, and a
request for log-probabilities must ask it to route to hosts that give them (``provider.require_parameters``).
Both accept messages in any order, so the view is sent as it is (an empty one gets an opening user turn).

The same client serves OpenAI-compatible servers (vLLM, SGLang, llama.cpp) at a ``base_url``: such a server
usually runs without a key (``api_key=None`` here), and then no ``Authorization`` header is sent at all (the
SDK insists on a key, so it gets a placeholder that every request omits explicitly).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from interlens.scheduler.gateway import BatchLimits, BatchRowError, BatchStatus, Failure, SubmittedBatch

from .._core import ConfigurationError
from ._base import (
    OPENING_TURN,
    RATE_LIMIT_STATUSES,
    RETRY_STATUSES,
    APIRequest,
    APIResult,
    Messages,
    Provider,
    ProviderResponseError,
    Shards,
    classify_failure,
    count,
    is_local_endpoint,
    post_json,
    request_digest,
    row_error,
)

__all__ = ["OPENAI", "OPENROUTER", "OpenAIClient", "body", "live_body"]

_BATCH_ENDPOINT: Final = "/v1/chat/completions"
_DONE = frozenset({"completed", "failed", "expired", "cancelled"})
_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter"}


def fold(messages: Messages) -> Messages:
    """Any order is accepted; only an empty chat is refused, so it gets an opening user turn."""
    return messages or (("user", OPENING_TURN),)


def body(request: APIRequest) -> dict[str, Any]:
    """The chat completions JSON body (the system block as the first message)."""
    settings = request.settings
    messages = [{"role": role, "content": content} for role, content in request.messages]
    if request.system:
        messages.insert(0, {"role": "system", "content": request.system})
    out: dict[str, Any] = {"model": request.model, "messages": messages}
    # OpenAI deprecated max_tokens for chat (reasoning models refuse it); OpenRouter still uses it.
    out["max_tokens" if request.provider == "openrouter" else "max_completion_tokens"] = settings.max_tokens
    if settings.stop:
        out["stop"] = list(settings.stop)
    if settings.temperature is not None:
        out["temperature"] = settings.temperature
    if settings.top_p is not None:
        out["top_p"] = settings.top_p
    if settings.seed is not None:
        out["seed"] = settings.seed
    if settings.record_tokens:
        out["logprobs"] = True
        # no alternatives asked; but llama.cpp's Python server (llama-cpp-python) answers logprobs only when
        # top_logprobs is set, and 0 is valid everywhere (OpenAI: 0-20)
        out["top_logprobs"] = 0
        if request.provider == "openrouter":
            # route only to hosts that honour every parameter sent: a turn asked for log-probabilities is
            # not paid for without them (none such: the request fails, 404, saying so)
            out["provider"] = {"require_parameters": True}
    return out


def live_body(request: APIRequest, *, local: bool) -> dict[str, Any]:
    """:func:`body` as a live request sends it: to a server on a local or private host (a self-hosted
    OpenAI-compatible server) the output cap goes under both names, ``max_tokens`` beside
    ``max_completion_tokens``, since some servers know only the older one and would ignore the cap
    (llama.cpp's Python server, llama-cpp-python 0.3.36: a 24-token turn ran to 231). OpenAI itself, and
    any other public host, gets the one name its reasoning models require."""
    out = body(request)
    if local and "max_completion_tokens" in out:
        out["max_tokens"] = out["max_completion_tokens"]
    return out


def _token_logprobs(logprobs: Any) -> tuple[tuple[str, float], ...] | None:
    """A choice's ``logprobs.content`` as (token text, log-probability) pairs; None where the answer has
    none (not asked, or a server that ignores the field) or where they cannot be read."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    pairs = []
    for entry in content:
        token = entry.get("token") if isinstance(entry, dict) else None
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not isinstance(value, int | float) or isinstance(value, bool):
            return None
        pairs.append((token, float(value)))
    return tuple(pairs)


def _json_line(custom_id: str, request: APIRequest) -> str:
    line = {"custom_id": custom_id, "method": "POST", "url": _BATCH_ENDPOINT, "body": body(request)}
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False)


class OpenAIClient:
    """OpenAI, and OpenRouter (the OpenAI SDK on OpenRouter's endpoint; it has no batch API)."""

    batch_limits = BatchLimits(max_requests=50_000, max_bytes=200 * 1024 * 1024)

    def __init__(self, *, provider: str, base_url: str, api_key: str | None, max_in_flight: int) -> None:
        import openai

        self.provider = provider
        # No key: the SDK still wants one, so a placeholder, and every request omits the header it makes.
        self._headers: dict[str, Any] | None = None if api_key else {"Authorization": openai.Omit()}
        self._base_url = base_url
        self._local = is_local_endpoint(base_url)  # a self-hosted server: both names of the output cap
        self._sdk_module = openai
        headers = {"X-Title": "interlens"} if provider == "openrouter" else None
        self._shards = Shards(
            lambda http: openai.AsyncOpenAI(
                api_key=api_key or "no-key",
                base_url=base_url,
                max_retries=0,
                http_client=http,
                default_headers=headers,
            ),
            max_in_flight,
            base_url=base_url,
        )
        self._sdk = self._shards.control
        self._last: dict[str, Any] = {}  # batch id -> the poll that found it done (saves a GET)

    def classify(self, exc: BaseException) -> Failure:
        return classify_failure(exc, self._sdk_module)

    async def send(self, request: APIRequest) -> APIResult:
        data, headers = await post_json(
            self._shards,
            "/chat/completions",
            live_body(request, local=self._local),
            timeout=request.settings.timeout,
            provider=self.provider,
            headers=self._headers,
        )
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
                status is not None and (status in RETRY_STATUSES or status >= 500),
                status in RATE_LIMIT_STATUSES,
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
        details = usage.get("prompt_tokens_details") or {}
        return APIResult(
            text=text,
            finish_reason=_FINISH.get(finish, finish),
            prompt_tokens=usage.get("prompt_tokens"),
            output_tokens=usage.get("completion_tokens"),
            model=data.get("model"),
            request_id=request_id,
            batch_id=batch_id,
            cache_read_tokens=count(details.get("cached_tokens") if isinstance(details, dict) else None),
            token_logprobs=_token_logprobs(choice.get("logprobs")),
        )

    # ------------------------------------------------------------------------------------------- batches
    def row_size(self, request: APIRequest) -> int:
        return len(_json_line("r000000", request).encode()) + 1

    def request_hash(self, request: APIRequest) -> str:
        return request_digest(self.provider, self._base_url, _BATCH_ENDPOINT, body(request))

    async def submit_batch(self, rows: Sequence[tuple[str, APIRequest]]) -> SubmittedBatch:
        if not _PROVIDERS[self.provider].batch:
            raise ConfigurationError(f"{self.provider} has no batch API; use batch=False")
        content = "".join(_json_line(cid, request) + "\n" for cid, request in rows).encode()
        upload = await self._sdk.files.create(
            file=("interlens-batch.jsonl", content, "application/jsonl"),
            purpose="batch",
            extra_headers=self._headers,
        )
        batch = await self._sdk.batches.create(
            input_file_id=upload.id,
            endpoint=_BATCH_ENDPOINT,
            completion_window="24h",
            extra_headers=self._headers,
        )
        return SubmittedBatch(
            batch.id, batch.status, {"input_file_id": upload.id, "endpoint": _BATCH_ENDPOINT}
        )

    async def poll_batch(self, batch_id: str, meta: Mapping[str, Any]) -> BatchStatus:
        batch = await self._sdk.batches.retrieve(batch_id, extra_headers=self._headers)
        done = batch.status in _DONE
        if done:
            self._last[batch_id] = batch
        return BatchStatus(batch.status, done)

    async def batch_results(self, batch_id: str, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        batch = self._last.pop(batch_id, None) or await self._sdk.batches.retrieve(
            batch_id, extra_headers=self._headers
        )
        if batch.status == "failed":
            errors = getattr(batch.errors, "data", None) or []
            reasons = "; ".join(f"line {e.line}: {e.message}" for e in errors[:5]) or "no reason given"
            return {"*": BatchRowError(f"openai batch {batch_id} failed validation: {reasons}")}
        out: dict[str, Any] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:
                continue
            content = await self._sdk.files.content(file_id, extra_headers=self._headers)
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
        return row_error(status, f"openai batch row HTTP {status}: {message}")

    async def aclose(self) -> None:
        await self._shards.aclose()


OPENAI = Provider(
    name="openai",
    title="OpenAI",
    sdk="openai",
    key_variable="OPENAI_API_KEY",
    url_variable="OPENAI_BASE_URL",
    default_url="https://api.openai.com/v1",
    batch=True,
    fold=fold,
    body=body,
    client=OpenAIClient,
    batch_price=0.5,  # "50% lower costs" than the synchronous API (platform.openai.com/docs/guides/batch)
    keyless_local=True,  # the OpenAI-compatible servers (vLLM, SGLang, llama.cpp, transformers serve)
    accepts_seed=True,
    token_logprobs=True,
)

OPENROUTER = Provider(
    name="openrouter",
    title="OpenRouter",
    sdk="openai",
    key_variable="OPENROUTER_API_KEY",
    url_variable="OPENROUTER_BASE_URL",
    default_url="https://openrouter.ai/api/v1",
    batch=False,
    fold=fold,
    body=body,
    client=OpenAIClient,
    accepts_seed=True,  # passed through to the models that take one
    token_logprobs=True,  # passed through; a model whose host gives none answers without (tokens_missing)
)

#: The providers this module speaks for, by name (what a client built for one of them is).
_PROVIDERS = {p.name: p for p in (OPENAI, OPENROUTER)}
