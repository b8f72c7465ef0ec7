"""Anthropic routes of the fake provider: messages and message batches; and the wire's record
(:data:`ANTHROPIC`).

Shapes follow /work/shared/notes/provider_wire_formats.md §2. Two details matter to the SDK: batch
timestamps are RFC 3339 strings, and ``results_url`` must point back at this server (built from the Host
header the client used), because ``messages.batches.results()`` GETs it verbatim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ._fake_provider_core import (
    Ctx,
    FakeWire,
    Route,
    State,
    content_text,
    count_tokens,
    json_response,
    jsonl,
    new_id,
    rfc3339,
)
from ._fake_provider_http import HttpResponse
from ._fake_provider_requests import ANTHROPIC_VERSIONS, validate_message

_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_MAX_BATCH_ROWS = 100_000
_COUNTS = ("processing", "succeeded", "errored", "canceled", "expired")
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """The ``type`` Anthropic's error envelope gives ``status``."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _error_body(status: int, message: str, request_id: str) -> dict[str, Any]:
    error = {"type": error_type(status), "message": message}
    return {"type": "error", "error": error, "request_id": request_id}


@dataclass(slots=True)
class AnthropicBatch:
    id: str
    provider: str  # the wire it was created on
    requests: list[tuple[str, Any]]
    created_at: float
    status: str = "in_progress"
    polls: int = 0
    polls_in_state: int = 0
    ended_at: float | None = None
    cancel_initiated_at: float | None = None
    results: list[dict[str, Any]] | None = None
    version: str | None = "2026-10-21"  # the anthropic-version it was created with: its rows follow it

    @property
    def custom_ids(self) -> tuple[str, ...]:
        return tuple(cid for cid, _ in self.requests)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(_COUNTS, 0)
        if self.results is None:
            counts["processing"] = len(self.requests)
        else:
            for line in self.results:
                counts[line["result"]["type"]] += 1
        return counts

    def wire(self, base_url: str) -> dict[str, Any]:
        ended = self.status == "ended"
        return {
            "id": self.id,
            "type": "message_batch",
            "processing_status": self.status,
            "request_counts": self.counts(),
            "created_at": rfc3339(self.created_at),
            "expires_at": rfc3339(self.created_at + 86_400),
            "ended_at": rfc3339(self.ended_at) if self.ended_at is not None else None,
            "archived_at": None,
            "cancel_initiated_at": (
                rfc3339(self.cancel_initiated_at) if self.cancel_initiated_at is not None else None
            ),
            "results_url": f"{base_url}/v1/messages/batches/{self.id}/results" if ended else None,
        }


def _blocks(body: dict[str, Any]) -> list[tuple[Any, int, bool]]:
    """The prompt as cacheable blocks in Anthropic's order (system, then each message's content blocks)."""
    out: list[tuple[Any, int, bool]] = []

    def add(where: str, content: Any) -> None:
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for part in parts:
            if isinstance(part, dict):
                bare = {k: v for k, v in part.items() if k != "cache_control"}
                out.append(((where, bare), count_tokens(content_text([part])), "cache_control" in part))

    add("system", body.get("system"))
    for msg in body.get("messages") or []:
        if isinstance(msg, dict):
            add(str(msg.get("role")), msg.get("content"))
    return out


def message(state: State, provider: str, body: dict[str, Any], *, tier: str = "standard") -> dict[str, Any]:
    gen = state.generate(body, body.get("max_tokens"))
    read, written = state.cache_lookup(provider, body["model"], _blocks(body), automatic=False)
    out = {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": [{"type": "text", "text": gen.text, "citations": None}],
        "stop_reason": "max_tokens" if gen.truncated else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": gen.prompt_tokens - read - written,  # what was neither read nor written
            "output_tokens": gen.completion_tokens,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
            "service_tier": tier,
        },
    }
    state.usage.append(
        {"provider": provider, "model": body["model"], "batch": tier == "batch", "usage": out["usage"]}
    )
    return out


def _messages(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    problem = validate_message(ctx.json, version=ctx.headers.get("anthropic-version"))
    if problem is not None:
        return ctx.error(400, problem)
    return json_response(message(state, ctx.provider, ctx.json))


def _create_batch(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    body = ctx.json
    requests = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(requests, list) or not requests:
        return ctx.error(400, "requests: must be a non-empty list of {custom_id, params}")
    if len(requests) > _MAX_BATCH_ROWS:
        return ctx.error(400, f"requests: a batch holds at most {_MAX_BATCH_ROWS} requests")
    seen: set[str] = set()
    rows: list[tuple[str, Any]] = []
    for i, item in enumerate(requests):
        cid = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(cid, str) or not _CUSTOM_ID.fullmatch(cid):
            return ctx.error(400, f"requests.{i}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$, got {cid!r}")
        if cid in seen:
            return ctx.error(400, f"requests.{i}.custom_id: {cid!r} is used more than once in this batch")
        if not isinstance(item.get("params"), dict):
            return ctx.error(400, f"requests.{i}.params: must be an object")
        seen.add(cid)
        rows.append((cid, item["params"]))
    version = ctx.headers.get("anthropic-version")
    if version not in ANTHROPIC_VERSIONS:  # the header is checked on the request; the rows when they run
        return ctx.error(400, str(validate_message({}, version=version)))
    batch = AnthropicBatch(
        id=new_id("msgbatch_"), provider=ctx.provider, requests=rows, created_at=state.now(), version=version
    )
    state.batches[ctx.provider][batch.id] = batch
    state.batches_created[ctx.provider] += 1
    return json_response(batch.wire(ctx.base_url))


def _row_result(state: State, batch: AnthropicBatch, cid: str, params: Any) -> dict[str, Any]:
    problem = validate_message(params, version=batch.version)
    rule = state.row_failure(batch.provider, cid, params) if problem is None else None
    if problem is None and rule is None:
        return {"type": "succeeded", "message": message(state, batch.provider, params, tier="batch")}
    status, text = (400, problem) if rule is None else (rule.status, rule.message)
    error = {"type": error_type(status), "message": text}
    return {"type": "errored", "error": {"type": "error", "error": error, "request_id": new_id("req_")}}


def advance(state: State, batch: AnthropicBatch) -> None:
    """One poll: after ``polls_per_state`` polls the batch ends (canceled rows if a cancel was asked)."""
    batch.polls += 1
    if batch.status == "ended":
        return
    batch.polls_in_state += 1
    if batch.polls_in_state < state.polls_per_state:
        return
    if batch.status == "canceling":
        batch.results = [{"custom_id": cid, "result": {"type": "canceled"}} for cid, _ in batch.requests]
    else:
        batch.results = [
            {"custom_id": cid, "result": _row_result(state, batch, cid, p)} for cid, p in batch.requests
        ]
    batch.status, batch.ended_at = "ended", state.now()


def _batch(state: State, ctx: Ctx, m: re.Match[str]) -> HttpResponse:
    batch = state.batches[ctx.provider].get(m["id"])
    if batch is None:
        return ctx.error(404, f"message batch {m['id']!r} not found")
    action = m["action"]
    if ctx.method == "DELETE":
        if batch.status != "ended":
            return ctx.error(
                409, "a batch can be deleted only after it has ended; cancel it first", retry=False
            )
        del state.batches[ctx.provider][batch.id]
        return json_response({"id": batch.id, "type": "message_batch_deleted"})
    if action == "/results":
        if batch.results is None:
            return ctx.error(404, f"results of {batch.id} are not ready: it has not ended")
        return HttpResponse(status=200, body=jsonl(batch.results), content_type="application/x-jsonl")
    if action == "/cancel":
        if batch.status == "ended":
            return ctx.error(409, f"batch {batch.id} has already ended and cannot be canceled", retry=False)
        if batch.status == "in_progress":
            batch.status, batch.polls_in_state, batch.cancel_initiated_at = "canceling", 0, state.now()
    else:
        advance(state, batch)
    return json_response(batch.wire(ctx.base_url))


def _list_batches(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    ordered = list(reversed(state.batches[ctx.provider].values()))
    ids = [b.id for b in ordered]
    try:
        limit = int(ctx.query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        return ctx.error(400, "limit must be an integer between 1 and 1000")
    after, before = ctx.query.get("after_id"), ctx.query.get("before_id")
    if before:
        newer = ordered[: ids.index(before)] if before in ids else []
        page, has_more = newer[-limit:], len(newer) > limit
    else:
        older = ordered[ids.index(after) + 1 :] if after and after in ids else ([] if after else ordered)
        page, has_more = older[:limit], len(older) > limit
    data = [b.wire(ctx.base_url) for b in page]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return json_response({"data": data, "has_more": has_more, "first_id": first, "last_id": last})


ROUTES: tuple[Route, ...] = (
    Route("POST", re.compile(r"/v1/messages"), _messages, generation=True),
    Route("POST", re.compile(r"/v1/messages/batches"), _create_batch),
    Route("GET", re.compile(r"/v1/messages/batches"), _list_batches),
    Route("GET", re.compile(r"/v1/messages/batches/(?P<id>[^/]+)(?P<action>/results)?"), _batch),
    Route("POST", re.compile(r"/v1/messages/batches/(?P<id>[^/]+)(?P<action>/cancel)"), _batch),
    Route("DELETE", re.compile(r"/v1/messages/batches/(?P<id>[^/]+)(?P<action>)"), _batch),
)

ANTHROPIC = FakeWire(
    name="anthropic",
    key_variable="ANTHROPIC_API_KEY",
    url_variable="ANTHROPIC_BASE_URL",
    base_path="",  # the SDK's paths are absolute (/v1/messages): its base URL is the server's root
    routes=ROUTES,
    error_body=_error_body,
    path_prefixes=("/v1/messages",),
    marker_headers=("anthropic-version",),
    key_headers=("x-api-key",),
)
"""Anthropic: messages and message batches, keys in ``x-api-key``, its typed error envelope."""
