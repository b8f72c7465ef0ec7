"""OpenAI (and OpenRouter) routes of the fake provider: chat completions, files, batches; and the two wires'
records (:data:`OPENAI`, :data:`OPENROUTER`).

Shapes follow /work/shared/notes/provider_wire_formats.md §1 and §3, so the official SDK accepts them with
strict response validation. Batches advance one state per GET of the batch (``polls_per_state`` GETs per
state), which makes polling loops deterministic without any wall-clock waiting. The two wires share the chat
completions handler; what differs between them is a :class:`_Chat` record (strict parameters, automatic
prompt caching, OpenRouter's extra fields), not a comparison of names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
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
)
from ._fake_provider_http import HttpResponse
from ._fake_provider_requests import validate_chat

_BATCH_ENDPOINTS = (
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
)
_FILE_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
_MAX_BATCH_ROWS = 50_000
_NEXT = {"validating": "in_progress", "in_progress": "finalizing", "finalizing": "completed"}
_TERMINAL = ("completed", "failed", "expired", "cancelled")
_ERROR_TYPES = {401: "invalid_request_error", 403: "invalid_request_error", 429: "requests"}
_ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 429: "rate_limit_exceeded"}


@dataclass(frozen=True, slots=True)
class _Chat:
    """What differs between the chat-completions wires this module serves.

    ``strict``: unknown parameters are refused (OpenAI); OpenRouter takes any and ignores what a model does
    not support. ``prompt_cache``: prompts are cached by themselves and reads reported as ``cached_tokens``.
    ``routing_fields``: the fields OpenRouter adds to an answer (the SDK keeps them in ``model_extra``).
    """

    strict: bool
    prompt_cache: bool
    routing_fields: bool


_OPENAI_CHAT = _Chat(strict=True, prompt_cache=True, routing_fields=False)
_OPENROUTER_CHAT = _Chat(strict=False, prompt_cache=False, routing_fields=True)


def error_type(status: int) -> str:
    """The ``type`` OpenAI's error envelope gives ``status``."""
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _error_body(status: int, message: str, request_id: str) -> dict[str, Any]:
    code = _ERROR_CODES.get(status)
    return {"error": {"message": message, "type": error_type(status), "param": None, "code": code}}


def _openrouter_error_body(status: int, message: str, request_id: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "metadata": {}}}


@dataclass(slots=True)
class StoredFile:
    meta: dict[str, Any]
    content: bytes


@dataclass(slots=True)
class OpenAIBatch:
    id: str
    provider: str  # the wire it was created on
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, Any] | None
    created_at: int
    rows: list[tuple[str, dict[str, Any]]]
    errors: list[dict[str, Any]]
    status: str = "validating"
    polls: int = 0
    polls_in_state: int = 0
    stamps: dict[str, int] = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    completed: int = 0
    failed: int = 0
    usage: dict[str, Any] | None = None

    @property
    def custom_ids(self) -> tuple[str, ...]:
        return tuple(cid for cid, _ in self.rows)

    def wire(self) -> dict[str, Any]:
        total = len(self.rows) if self.status != "validating" and self.status != "failed" else 0
        model = self.rows[0][1].get("model") if self.rows else None
        out: dict[str, Any] = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "created_at": self.created_at,
            "expires_at": self.created_at + 86_400,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "errors": {"object": "list", "data": self.errors} if self.status == "failed" else None,
            "request_counts": {"total": total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
            "model": model if isinstance(model, str) else None,
            "usage": self.usage,
        }
        for stamp in (
            "in_progress",
            "finalizing",
            "completed",
            "failed",
            "expired",
            "cancelling",
            "cancelled",
        ):
            out[f"{stamp}_at"] = self.stamps.get(stamp)
        return out


def chat_completion(
    state: State, provider: str, body: dict[str, Any], chat: _Chat, *, batch: bool = False
) -> dict[str, Any]:
    gen = state.generate(body, body.get("max_completion_tokens", body.get("max_tokens")))
    finish = "length" if gen.truncated else "stop"
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish,
        "logprobs": _logprobs(gen.text) if body.get("logprobs") is True else None,
        "message": {"role": "assistant", "content": gen.text, "refusal": None, "annotations": []},
    }
    blocks = [
        (m, count_tokens(content_text(m.get("content"))), False)
        for m in body.get("messages") or []
        if isinstance(m, dict)
    ]
    cached = 0
    if chat.prompt_cache:
        cached = state.cache_lookup(provider, body["model"], blocks, automatic=True)[0]
    usage: dict[str, Any] = {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    out: dict[str, Any] = {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(state.now()),
        "model": body["model"],
        "choices": [choice],
        "usage": usage,
        "service_tier": "default",
        "system_fingerprint": "fp_fakeprovider",
    }
    if chat.routing_fields:
        out["provider"] = "FakeProvider"
        choice["native_finish_reason"] = finish
        usage["cost"] = 0.0
    state.usage.append({"provider": provider, "model": body["model"], "batch": batch, "usage": usage})
    return out


def token_logprobs(text: str) -> list[tuple[str, float]]:
    """The tokens the fake provider reports for a reply ``text`` (each word with the whitespace before it;
    they join to ``text``) and their log-probabilities: made up, but a fixed function of the token, so a
    test computes what a turn must have recorded from its text."""
    return [(token, -(sum(token.encode()) % 997) / 97) for token in re.findall(r"\s*\S+", text)]


def _logprobs(text: str) -> dict[str, Any]:
    """A choice's ``logprobs`` as chat completions answer ``logprobs: true`` (no ``top_logprobs`` asked)."""
    content = [
        {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}
        for token, value in token_logprobs(text)
    ]
    return {"content": content, "refusal": None}


def _chat_route(chat: _Chat) -> Callable[[State, Ctx, re.Match[str]], HttpResponse]:
    """The chat completions handler of a wire that answers like ``chat``."""

    def handle(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
        problem = validate_chat(ctx.json, strict=chat.strict)
        if problem is not None:
            return ctx.error(400, problem)
        return json_response(chat_completion(state, ctx.provider, ctx.json, chat))

    return handle


_openai_chat = _chat_route(_OPENAI_CHAT)
_openrouter_chat = _chat_route(_OPENROUTER_CHAT)


def _multipart(ctx: Ctx) -> tuple[dict[str, str], tuple[str, bytes] | None] | str:
    """Form fields and the (filename, bytes) file part of a multipart body, or a problem description."""
    ctype = ctx.headers.get("content-type", "")
    head = Message()
    head["content-type"] = ctype
    boundary = head.get_param("boundary")
    if not ctype.startswith("multipart/form-data") or not isinstance(boundary, str):
        return f"file uploads must be multipart/form-data with a boundary, got Content-Type {ctype!r}"
    fields: dict[str, str] = {}
    upload: tuple[str, bytes] | None = None
    for part in ctx.body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        raw_head, _, content = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        content = content.removesuffix(b"\r\n")
        disp = Message()
        for line in raw_head.decode("utf-8", "replace").split("\r\n"):
            hname, _, value = line.partition(":")
            if hname.strip().lower() == "content-disposition":
                disp["content-disposition"] = value.strip()
        name = disp.get_param("name", header="content-disposition")
        filename = disp.get_filename()
        if filename is not None:
            upload = (filename, content)
        elif isinstance(name, str):
            fields[name] = content.decode("utf-8", "replace")
    return fields, upload


def _upload(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    parsed = _multipart(ctx)
    if isinstance(parsed, str):
        return ctx.error(400, parsed)
    fields, upload = parsed
    purpose = fields.get("purpose")
    if purpose not in _FILE_PURPOSES:
        return ctx.error(400, f"'purpose' must be one of {', '.join(_FILE_PURPOSES)}; got {purpose!r}")
    if upload is None:
        return ctx.error(400, "missing the 'file' part (a multipart part with a filename)")
    return json_response(_store_file(state, upload[0], upload[1], purpose).meta)


def _store_file(state: State, filename: str, content: bytes, purpose: str) -> StoredFile:
    fid = new_id("file-")
    meta = {
        "id": fid,
        "object": "file",
        "bytes": len(content),
        "created_at": int(state.now()),
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }
    state.files[fid] = stored = StoredFile(meta, content)
    return stored


def _file(state: State, ctx: Ctx, m: re.Match[str]) -> HttpResponse:
    stored = state.files.get(m["id"])
    if stored is None:
        return ctx.error(404, f"No such File object: {m['id']}")
    if ctx.method == "DELETE":
        del state.files[m["id"]]
        return json_response({"id": m["id"], "object": "file", "deleted": True})
    if m["content"]:
        return HttpResponse(status=200, body=stored.content, content_type="application/octet-stream")
    return json_response(stored.meta)


def _list_files(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    data = [f.meta for f in reversed(state.files.values())]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return json_response(
        {"object": "list", "data": data, "has_more": False, "first_id": first, "last_id": last}
    )


def _parse_rows(
    content: bytes, endpoint: str
) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Rows of a batch input file and the validation errors the real API would report for it."""
    rows: list[tuple[str, dict[str, Any]]] = []
    errors: list[dict[str, Any]] = []

    def err(code: str, line: int, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "line": line, "message": message, "param": param})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        err("invalid_file_format", 1, "the batch input file is not UTF-8 text")
        return rows, errors
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        err("empty_file", 1, "the batch input file has no requests")
    seen: set[str] = set()
    for no, line in enumerate(lines, start=1):
        before = len(errors)
        try:
            obj = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            err("invalid_json_line", no, f"line {no} is not a JSON object (blank lines are not allowed)")
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            err(
                "missing_required_parameter",
                no,
                f"line {no}: custom_id must be a non-empty string",
                "custom_id",
            )
        elif cid in seen:
            err(
                "duplicate_custom_id", no, f"line {no}: custom_id {cid!r} is used more than once", "custom_id"
            )
        if obj.get("method") != "POST":
            err("invalid_method", no, f"line {no}: method must be 'POST'", "method")
        if obj.get("url") != endpoint:
            err("mismatched_url", no, f"line {no}: url must equal the batch endpoint {endpoint!r}", "url")
        if not isinstance(obj.get("body"), dict):
            err("invalid_request", no, f"line {no}: body must be a JSON object", "body")
        if len(errors) == before and isinstance(cid, str):
            seen.add(cid)
            rows.append((cid, obj["body"]))
    if len(lines) > _MAX_BATCH_ROWS:
        err("too_many_requests", len(lines), f"a batch holds at most {_MAX_BATCH_ROWS} requests")
    return rows, errors


def _create_batch(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    body = ctx.json if isinstance(ctx.json, dict) else {}
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    stored = state.files.get(str(body.get("input_file_id")))
    if stored is None:
        return ctx.error(400, f"input_file_id {body.get('input_file_id')!r} does not name an uploaded file")
    if stored.meta["purpose"] != "batch":
        return ctx.error(400, "the input file must be uploaded with purpose='batch'")
    if endpoint not in _BATCH_ENDPOINTS:
        return ctx.error(400, f"endpoint must be one of {', '.join(_BATCH_ENDPOINTS)}; got {endpoint!r}")
    if endpoint != "/v1/chat/completions":
        return ctx.error(400, "FakeProviderServer batches support only endpoint='/v1/chat/completions'")
    if window != "24h":
        return ctx.error(400, f"completion_window must be '24h', got {window!r}")
    metadata = body.get("metadata")
    rows, errors = _parse_rows(stored.content, endpoint)
    batch = OpenAIBatch(
        id=new_id("batch_"),
        provider=ctx.provider,
        endpoint=endpoint,
        input_file_id=stored.meta["id"],
        completion_window=window,
        metadata=metadata if isinstance(metadata, dict) else None,
        created_at=int(state.now()),
        rows=rows,
        errors=errors,
    )
    state.batches[ctx.provider][batch.id] = batch
    state.batches_created[ctx.provider] += 1
    return json_response(batch.wire())


def _finish(state: State, batch: OpenAIBatch) -> None:
    """Produce the output and error files: every row runs through the same reply function as a live call."""
    ok: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    tokens_in = tokens_out = 0
    for cid, body in batch.rows:
        line: dict[str, Any] = {"id": new_id("batch_req_"), "custom_id": cid, "error": None}
        rid = new_id("req_")
        failure = _row_failure(state, batch.provider, cid, body)
        if failure is not None:
            status, message = failure
            err = {"message": message, "type": error_type(status), "param": None, "code": None}
            line["response"] = {"status_code": status, "request_id": rid, "body": {"error": err}}
            bad.append(line)
            continue
        completion = chat_completion(state, batch.provider, body, _OPENAI_CHAT, batch=True)
        tokens_in += completion["usage"]["prompt_tokens"]
        tokens_out += completion["usage"]["completion_tokens"]
        line["response"] = {"status_code": 200, "request_id": rid, "body": completion}
        ok.append(line)
    _write_results(state, batch, ok, bad)
    batch.usage = {
        "input_tokens": tokens_in,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": tokens_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens_in + tokens_out,
    }


def _row_failure(state: State, provider: str, cid: str, body: dict[str, Any]) -> tuple[int, str] | None:
    problem = validate_chat(body, strict=_OPENAI_CHAT.strict)
    if problem is not None:
        return 400, problem
    rule = state.row_failure(provider, cid, body)
    return None if rule is None else (rule.status, rule.message)


def _write_results(
    state: State, batch: OpenAIBatch, ok: list[dict[str, Any]], bad: list[dict[str, Any]]
) -> None:
    if ok:
        batch.output_file_id = _store_file(state, f"{batch.id}_output.jsonl", jsonl(ok), "batch_output").meta[
            "id"
        ]
    if bad:
        batch.error_file_id = _store_file(state, f"{batch.id}_error.jsonl", jsonl(bad), "batch_output").meta[
            "id"
        ]
    batch.completed, batch.failed = len(ok), len(bad)


def _cancelled(state: State, batch: OpenAIBatch) -> None:
    err = {
        "code": "batch_cancelled",
        "message": "This request was not executed because the batch was cancelled.",
    }
    lines = [
        {"id": new_id("batch_req_"), "custom_id": cid, "response": None, "error": err}
        for cid, _ in batch.rows
    ]
    _write_results(state, batch, [], lines)


def advance(state: State, batch: OpenAIBatch) -> None:
    """One poll: after ``polls_per_state`` polls in a state, move to the next one."""
    batch.polls += 1
    if batch.status in _TERMINAL:
        return
    batch.polls_in_state += 1
    if batch.polls_in_state < state.polls_per_state:
        return
    batch.polls_in_state = 0
    now = int(state.now())
    if batch.status == "validating" and batch.errors:
        batch.status = "failed"
    elif batch.status == "cancelling":
        _cancelled(state, batch)
        batch.status = "cancelled"
    else:
        if batch.status == "finalizing":
            _finish(state, batch)
        batch.status = _NEXT[batch.status]
    batch.stamps[batch.status] = now


def _batch(state: State, ctx: Ctx, m: re.Match[str]) -> HttpResponse:
    batch = state.batches[ctx.provider].get(m["id"])
    if batch is None:
        return ctx.error(404, f"No batch found with id '{m['id']}'")
    if m["cancel"]:
        if batch.status in _TERMINAL:
            return ctx.error(409, f"Cannot cancel a batch with status '{batch.status}'", retry=False)
        if batch.status != "cancelling":
            batch.status, batch.polls_in_state = "cancelling", 0
            batch.stamps["cancelling"] = int(state.now())
    else:
        advance(state, batch)
    return json_response(batch.wire())


def _list_batches(state: State, ctx: Ctx, _: re.Match[str]) -> HttpResponse:
    ordered = list(reversed(state.batches[ctx.provider].values()))
    after = ctx.query.get("after")
    if after:
        ids = [b.id for b in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    try:
        limit = int(ctx.query.get("limit", "20"))
    except ValueError:
        return ctx.error(400, "limit must be an integer between 1 and 100")
    if not 1 <= limit <= 100:
        return ctx.error(400, "limit must be an integer between 1 and 100")
    page = [b.wire() for b in ordered[:limit]]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    body = {
        "object": "list",
        "data": page,
        "has_more": len(ordered) > limit,
        "first_id": first,
        "last_id": last,
    }
    return json_response(body)


ROUTES: tuple[Route, ...] = (
    Route("POST", re.compile(r"/v1/chat/completions"), _openai_chat, generation=True),
    Route("POST", re.compile(r"/v1/files"), _upload),
    Route("GET", re.compile(r"/v1/files"), _list_files),
    Route("GET", re.compile(r"/v1/files/(?P<id>[^/]+)(?P<content>/content)?"), _file),
    Route("DELETE", re.compile(r"/v1/files/(?P<id>[^/]+)(?P<content>)"), _file),
    Route("POST", re.compile(r"/v1/batches"), _create_batch),
    Route("GET", re.compile(r"/v1/batches"), _list_batches),
    Route("GET", re.compile(r"/v1/batches/(?P<id>[^/]+)(?P<cancel>)"), _batch),
    Route("POST", re.compile(r"/v1/batches/(?P<id>[^/]+)(?P<cancel>/cancel)"), _batch),
)

OPENAI = FakeWire(
    name="openai",
    key_variable="OPENAI_API_KEY",
    url_variable="OPENAI_BASE_URL",
    base_path="/v1",
    routes=ROUTES,
    error_body=_error_body,
    fallback=True,  # any path no other wire claims: OpenAI-compatible clients share its paths
)
"""OpenAI: chat completions, files and batches under ``/v1``."""

OPENROUTER = FakeWire(
    name="openrouter",
    key_variable="OPENROUTER_API_KEY",
    url_variable="OPENROUTER_BASE_URL",
    base_path="/api/v1",
    routes=(Route("POST", re.compile(r"/api/v1/chat/completions"), _openrouter_chat, generation=True),),
    error_body=_openrouter_error_body,
    path_prefixes=("/api/v1/",),
)
"""OpenRouter: chat completions under ``/api/v1``, its error envelope (the status as ``code``)."""
