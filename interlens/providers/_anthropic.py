"""Anthropic: messages and message batches through the official ``anthropic`` SDK.

Anthropic insists on alternating user/assistant messages that start with the user and are never empty, so
the view is folded to that here, the same way the local chat-template path folds a view to what a template
accepts (``_chat_template``). The system block travels apart, as ``system``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from interlens.scheduler.gateway import BatchLimits, BatchRowError, BatchStatus, Failure, SubmittedBatch

from ._base import (
    CONTINUE_TURN,
    OPENING_TURN,
    APIRequest,
    APIResult,
    APISettings,
    Messages,
    Provider,
    ProviderResponseError,
    Shards,
    classify_failure,
    count,
    post_json,
    request_digest,
)

__all__ = ["ANTHROPIC", "AnthropicClient", "body", "fold"]

_BATCH_ENDPOINT = "/v1/messages/batches"
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}
_RETRY_TYPES = frozenset({"rate_limit_error", "overloaded_error", "api_error", "timeout_error"})


def fold(messages: Messages) -> Messages:
    """Alternating turns that start and end with the user, no empty text: consecutive turns of one role are
    merged, an opening user turn is put first when needed, and a trailing own turn gets a user turn after it
    (else Anthropic would *continue* that turn)."""
    merged: list[tuple[str, str]] = []
    for role, content in messages:
        if not content.strip():  # Anthropic refuses empty text blocks; an empty turn says nothing anyway
            continue
        if merged and merged[-1][0] == role:
            merged[-1] = (role, f"{merged[-1][1]}\n\n{content}")
        else:
            merged.append((role, content))
    if not merged or merged[0][0] == "assistant":
        merged.insert(0, ("user", OPENING_TURN))
    if merged[-1][0] == "assistant":
        merged.append(("user", CONTINUE_TURN))
    return tuple(merged)


_BREAKPOINT = {"type": "ephemeral"}


def body(request: APIRequest) -> dict[str, Any]:
    """The messages JSON body; with ``prompt_cache``, two prompt-cache breakpoints (see :func:`_cached`)."""
    settings = request.settings
    messages: list[dict[str, Any]] = [{"role": r, "content": c} for r, c in request.messages]
    out: dict[str, Any] = {"model": request.model, "max_tokens": settings.max_tokens, "messages": messages}
    if request.system:
        out["system"] = request.system
    if settings.prompt_cache:
        _cached(out)
    if settings.stop:
        out["stop_sequences"] = list(settings.stop)
    if settings.temperature is not None:
        out["temperature"] = settings.temperature
    if settings.top_p is not None:
        out["top_p"] = settings.top_p
    return out


def _cached(out: dict[str, Any]) -> None:
    """Mark cache breakpoints: the system block (shared by every turn of the speaker), and the last message.

    A debate resends its history every turn, and the speaker's next request starts with exactly this one's
    messages (the fold keeps earlier messages as they were), so the whole prompt up to the last message is
    what the next turn can read from the cache: 10% of the input price instead of 100%, for a write premium
    of 25% on the part written. Anthropic checks earlier block boundaries for hits by itself; two of its four
    breakpoints are used. A prompt shorter than the model's minimum is simply not cached (no error, no fee).
    """
    if "system" in out:
        out["system"] = [{"type": "text", "text": out["system"], "cache_control": _BREAKPOINT}]
    last = out["messages"][-1]
    last["content"] = [{"type": "text", "text": last["content"], "cache_control": _BREAKPOINT}]


class AnthropicClient:
    """Anthropic messages and message batches."""

    batch_limits = BatchLimits(max_requests=100_000, max_bytes=256 * 1024 * 1024)

    def __init__(
        self, *, provider: str = "anthropic", base_url: str, api_key: str, max_in_flight: int
    ) -> None:
        import anthropic

        self.provider = provider
        self._base_url = base_url
        self._sdk_module = anthropic
        self._shards = Shards(
            lambda http: anthropic.AsyncAnthropic(
                api_key=api_key,
                base_url=base_url,
                max_retries=0,
                http_client=http,
            ),
            max_in_flight,
            base_url=base_url,
        )
        self._sdk = self._shards.control

    def classify(self, exc: BaseException) -> Failure:
        return classify_failure(exc, self._sdk_module)

    async def send(self, request: APIRequest) -> APIResult:
        data, headers = await post_json(
            self._shards,
            "/v1/messages",
            body(request),
            timeout=request.settings.timeout,
            provider="anthropic",
        )
        return self._parse(data, headers.get("request-id"), None)

    def _parse(self, data: Any, request_id: str | None, batch_id: str | None) -> APIResult:
        try:
            text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
            usage = data.get("usage") or {}
            stop = data.get("stop_reason")
        except (KeyError, TypeError, AttributeError) as exc:
            raise ProviderResponseError(f"anthropic sent a malformed message ({exc!r})", True) from exc
        # input_tokens counts only what was neither read from nor written to the cache: add them back.
        read, written = (
            count(usage.get("cache_read_input_tokens")),
            count(usage.get("cache_creation_input_tokens")),
        )
        uncached = usage.get("input_tokens")
        return APIResult(
            text=text,
            finish_reason=_FINISH.get(stop, stop),
            prompt_tokens=None if uncached is None else count(uncached) + read + written,
            output_tokens=usage.get("output_tokens"),
            cache_read_tokens=read,
            cache_write_tokens=written,
            model=data.get("model"),
            request_id=request_id,
            batch_id=batch_id,
        )

    # ------------------------------------------------------------------------------------------- batches
    def row_size(self, request: APIRequest) -> int:
        row = {"custom_id": "r000000", "params": body(request)}
        return len(json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode()) + 1

    def request_hash(self, request: APIRequest) -> str:
        return request_digest(self.provider, self._base_url, _BATCH_ENDPOINT, body(request))

    async def submit_batch(self, rows: Sequence[tuple[str, APIRequest]]) -> SubmittedBatch:
        requests: Any = [{"custom_id": cid, "params": body(request)} for cid, request in rows]
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
                    kind in _RETRY_TYPES,
                    kind in ("rate_limit_error", "overloaded_error"),
                )
            else:  # canceled: on purpose, not retried; expired: the batch window ran out, worth another go
                out[row.custom_id] = BatchRowError(
                    f"anthropic batch row {result.type}", result.type == "expired"
                )
        return out

    async def aclose(self) -> None:
        await self._shards.aclose()


def settings_problem(settings: APISettings) -> str | None:
    """The API version the installed SDK sends decides which sampling fields exist: the 2.x SDKs send
    ``2026-10-21``, which removed ``temperature``/``top_p``/``top_k`` (any value, even the default, is a 400);
    the 1.x SDKs send ``2023-06-01``, which takes them (``temperature`` in [0, 1]). Read from the installed
    package's metadata: the SDK itself is not imported to build a participant."""
    from importlib.metadata import PackageNotFoundError, version

    given = [k for k in ("temperature", "top_p") if getattr(settings, k) is not None]
    if not given:
        return None
    try:
        major = int(version("anthropic").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return None  # no SDK here: the missing-SDK error comes when it is needed
    if major >= 2:
        return (
            f"{' and '.join(f'{k}=' for k in given)} cannot be sent to Anthropic by the installed anthropic "
            f"SDK {version('anthropic')}: its API version (2026-10-21) has no temperature/top_p, and every "
            "request carrying one is refused (400). Drop the setting, or install anthropic<2 (API version "
            "2023-06-01, temperature in [0, 1])"
        )
    if settings.temperature is not None and settings.temperature > 1:
        return f"temperature={settings.temperature} is above Anthropic's range 0..1"
    return None


ANTHROPIC = Provider(
    name="anthropic",
    title="Anthropic",
    sdk="anthropic",
    key_variable="ANTHROPIC_API_KEY",
    url_variable="ANTHROPIC_BASE_URL",
    default_url="https://api.anthropic.com",
    batch=True,
    fold=fold,
    body=body,
    client=AnthropicClient,
    batch_price=0.5,  # "50% of standard API prices" (docs.anthropic.com, Message Batches API pricing)
    settings_problem=settings_problem,
)
