"""FakeProviderServer driven by the official async SDKs (strict validation) over real loopback HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import anyio
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletion

from interlens.testing._fake_provider import FakeProviderServer, count_tokens, default_reply

SECRET = "sk-test-SECRET-0123456789"


pytestmark = pytest.mark.usefixtures("hermetic_api_env")  # conftest: no real key or endpoint leaks in


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer() as srv:
        yield srv
    assert srv.handler_errors == []


def oai(server: FakeProviderServer, *, base_url: str | None = None, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=base_url or server.openai_base_url,
        api_key=SECRET,
        http_client=httpx2.AsyncClient(trust_env=False),
        _strict_response_validation=True,
        **kw,
    )


def ant(server: FakeProviderServer, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.anthropic_base_url,
        api_key=SECRET,
        http_client=httpx2.AsyncClient(trust_env=False),
        _strict_response_validation=True,
        **kw,
    )


@pytest.fixture
async def oa(server: FakeProviderServer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = oai(server)
    yield client
    await client.close()


@pytest.fixture
async def an(server: FakeProviderServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = ant(server)
    yield client
    await client.close()


def chat_body(text: str, model: str = "gpt-test") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
    }


def msg_body(text: str, max_tokens: int = 64) -> dict[str, Any]:
    return {"model": "claude-test", "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}


# -- single calls


async def test_openai_chat_round_trip_with_usage(server: FakeProviderServer, oa: openai.AsyncOpenAI) -> None:
    body = chat_body("Is a hot dog a sandwich?")
    out = await oa.chat.completions.create(**body)
    reply = default_reply(body)
    assert out.choices[0].message.content == reply
    assert reply.startswith("reply to Is a hot dog a sandwich? [")
    assert out.choices[0].finish_reason == "stop"
    assert out.model == "gpt-test"
    assert out.usage is not None
    assert out.usage.prompt_tokens == count_tokens("Be brief. Is a hot dog a sandwich?") == 8
    assert out.usage.completion_tokens == count_tokens(reply)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out._request_id is not None and out._request_id.startswith("req_")
    [rec] = server.requests
    assert (rec.provider, rec.method, rec.path, rec.status) == ("openai", "POST", "/v1/chat/completions", 200)
    assert rec.json == body and rec.authenticated
    assert rec.headers["authorization"] == "Bearer ***"
    assert SECRET not in repr(server.requests)


async def test_default_reply_differs_per_history_and_max_tokens_truncates(oa: openai.AsyncOpenAI) -> None:
    first = await oa.chat.completions.create(**chat_body("same question"))
    other = await oa.chat.completions.create(
        **{
            **chat_body("same question"),
            "messages": [
                {"role": "system", "content": "Different system."},
                {"role": "user", "content": "same question"},
            ],
        }
    )
    assert first.choices[0].message.content != other.choices[0].message.content
    short = await oa.chat.completions.create(**chat_body("same question"), max_completion_tokens=2)
    assert short.choices[0].message.content == "reply to"
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 2


async def test_anthropic_messages_round_trip(
    server: FakeProviderServer, an: anthropic.AsyncAnthropic
) -> None:
    body = {**msg_body("Argue NO, please."), "system": "You are terse."}
    out = await an.messages.create(**body)
    assert out.content[0].type == "text"
    assert out.content[0].text == default_reply(body)
    assert out.stop_reason == "end_turn"
    assert out.usage.input_tokens == count_tokens("You are terse. Argue NO, please.") == 6
    assert out.usage.output_tokens == count_tokens(default_reply(body))
    assert out._request_id is not None and out._request_id.startswith("req_")
    capped = await an.messages.create(**msg_body("Argue NO, please.", max_tokens=3))
    assert capped.stop_reason == "max_tokens" and capped.usage.output_tokens == 3
    assert [r.provider for r in server.requests] == ["anthropic", "anthropic"]
    sent = server.requests[0].headers  # the 2.x SDKs send the key as a Bearer token, 1.x as x-api-key
    bearer = int(anthropic.__version__.split(".")[0]) >= 2
    header, shown = ("authorization", "Bearer ***") if bearer else ("x-api-key", "***")
    assert sent[header] == shown


async def test_openrouter_path_and_extra_fields(server: FakeProviderServer) -> None:
    client = oai(server, base_url=server.openrouter_base_url, default_headers={"X-Title": "interlens"})
    out = await client.chat.completions.create(
        **chat_body("route me", model="vendor/model"), extra_body={"provider": {"order": ["x"]}}
    )
    await client.close()
    assert out.choices[0].message.content == default_reply(chat_body("route me"))
    assert out.model_extra is not None and out.model_extra["provider"] == "FakeProvider"
    [rec] = server.requests
    assert (rec.provider, rec.path, rec.headers["x-title"]) == (
        "openrouter",
        "/api/v1/chat/completions",
        "interlens",
    )
    assert rec.json["provider"] == {"order": ["x"]}


async def test_reply_override_and_env() -> None:
    with FakeProviderServer(reply=lambda body: f"custom {body['model']} words") as server:
        env = server.env(api_key=SECRET)
        assert env["OPENAI_BASE_URL"] == server.openai_base_url == f"http://127.0.0.1:{server.port}/v1"
        assert env["ANTHROPIC_BASE_URL"] == server.base_url
        assert env["OPENROUTER_BASE_URL"].endswith("/api/v1") and env["OPENROUTER_API_KEY"] == SECRET
        client = openai.AsyncOpenAI(
            base_url=env["OPENAI_BASE_URL"],
            api_key=env["OPENAI_API_KEY"],
            http_client=httpx2.AsyncClient(trust_env=False),
            _strict_response_validation=True,
        )
        out = await client.chat.completions.create(**chat_body("x", model="m1"))
        await client.close()
    assert out.choices[0].message.content == "custom m1 words"
    assert out.usage is not None and out.usage.completion_tokens == 3


# -- credentials


@pytest.mark.parametrize(
    ("path", "provider", "field", "expected"),
    [
        ("/v1/chat/completions", "openai", ("error", "code"), "invalid_api_key"),
        ("/v1/messages", "anthropic", ("error", "type"), "authentication_error"),
        ("/api/v1/chat/completions", "openrouter", ("error", "code"), 401),
    ],
)
async def test_missing_credentials_get_401_in_provider_envelope(
    server: FakeProviderServer, path: str, provider: str, field: tuple[str, str], expected: object
) -> None:
    async with httpx2.AsyncClient(trust_env=False) as http:
        resp = await http.post(server.base_url + path, json=msg_body("hi"))
    assert resp.status_code == 401
    assert resp.json()[field[0]][field[1]] == expected
    assert resp.headers["content-length"] == str(len(resp.content))
    [rec] = server.requests
    assert (rec.provider, rec.status, rec.authenticated) == (provider, 401, False)


async def test_anthropic_x_api_key_accepted_and_redacted(server: FakeProviderServer) -> None:
    async with httpx2.AsyncClient(trust_env=False) as http:
        resp = await http.post(
            server.base_url + "/v1/messages",
            json=msg_body("hello there"),
            headers={"x-api-key": SECRET, "anthropic-version": "2023-06-01"},
        )
    assert resp.status_code == 200 and resp.json()["content"][0]["text"] == default_reply(
        msg_body("hello there")
    )
    assert resp.headers["request-id"].startswith("req_")
    assert server.requests[0].headers["x-api-key"] == "***"
    assert SECRET not in repr(server.requests)


# -- faults


async def test_429_with_retry_after_is_retried(server: FakeProviderServer, oa: openai.AsyncOpenAI) -> None:
    server.fail_next(1, status=429, retry_after=0.05)
    out = await oa.chat.completions.create(**chat_body("rate limited"))
    assert out.choices[0].message.content == default_reply(chat_body("rate limited"))
    assert [r.status for r in server.requests] == [429, 200]
    assert [r.headers["x-stainless-retry-count"] for r in server.requests] == ["0", "1"]


async def test_anthropic_429_and_529_retried(
    server: FakeProviderServer, an: anthropic.AsyncAnthropic
) -> None:
    server.fail_next(1, status=429, retry_after=0.01, provider="anthropic")
    server.fail_next(1, status=529, retry_after_ms=10, path="/v1/messages")
    out = await an.messages.create(**msg_body("busy?"))
    assert out.content[0].type == "text" and out.content[0].text == default_reply(msg_body("busy?"))
    assert [r.status for r in server.requests] == [429, 529, 200]


async def test_500_twice_then_success(server: FakeProviderServer, oa: openai.AsyncOpenAI) -> None:
    server.fail_next(2, status=500, retry_after=0.01)
    out = await oa.chat.completions.create(**chat_body("flaky"))
    assert out.choices[0].message.content == default_reply(chat_body("flaky"))
    assert [r.status for r in server.requests] == [500, 500, 200]


async def test_errors_carry_provider_envelopes(
    server: FakeProviderServer, oa: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic
) -> None:
    server.fail_next(1, status=500, should_retry=False, message="boom", provider="openai")
    with pytest.raises(openai.InternalServerError) as oe:
        await oa.chat.completions.create(**chat_body("x"))
    assert oe.value.status_code == 500 and oe.value.request_id is not None
    assert isinstance(oe.value.body, dict) and oe.value.body["message"] == "boom"
    server.fail_next(1, status=429, should_retry=False, provider="anthropic")
    with pytest.raises(anthropic.RateLimitError) as ae:
        await an.messages.create(**msg_body("x"))
    assert isinstance(ae.value.body, dict) and ae.value.body["error"]["type"] == "rate_limit_error"
    assert ae.value.request_id == ae.value.body["request_id"]
    with pytest.raises(openai.BadRequestError, match="model"):
        await oa.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}])
    assert len(server.requests) == 3


async def test_malformed_body_raises_sdk_error(
    server: FakeProviderServer, oa: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic
) -> None:
    # With a JSON Content-Type the SDKs surface the decoder's own error; with another type, strict
    # validation raises APIResponseValidationError.
    server.malformed_next(1, provider="openai")
    with pytest.raises(json.JSONDecodeError):
        await oa.chat.completions.create(**chat_body("x"))
    server.malformed_next(1, content_type="text/html", provider="anthropic")
    with pytest.raises(anthropic.APIResponseValidationError):
        await an.messages.create(**msg_body("x"))
    ok = await oa.chat.completions.create(**chat_body("x"))  # faults consume themselves
    assert ok.choices[0].message.content == default_reply(chat_body("x"))


async def test_timeout_raises_and_frees_the_server(
    server: FakeProviderServer, oa: openai.AsyncOpenAI
) -> None:
    server.timeout_next(1, seconds=60)
    with pytest.raises(openai.APITimeoutError):
        await oa.with_options(timeout=0.3, max_retries=0).chat.completions.create(**chat_body("slow"))
    # The held request ends as soon as the client hangs up, long before its 60 s.
    await server.await_until(lambda s: s.in_flight == 0, timeout=5)
    assert [r.status for r in server.requests] == [None]
    server.timeout_next(1, seconds=60)  # the SDK's retry after a timeout reaches a healthy server
    out = await oa.with_options(timeout=0.3, max_retries=1).chat.completions.create(**chat_body("fast"))
    assert out.choices[0].message.content == default_reply(chat_body("fast"))
    assert [r.status for r in server.requests] == [None, None, 200]


# -- concurrency


@pytest.mark.parametrize("n", [1, 64])
async def test_max_concurrency_is_measured(n: int) -> None:
    with FakeProviderServer(latency=0.2) as server:
        client = oai(server)
        results: dict[int, str | None] = {}

        async def one(i: int) -> None:
            out = await client.chat.completions.create(**chat_body(f"conversation {i}"))
            results[i] = out.choices[0].message.content

        server.hold()
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            await server.await_until(lambda s: s.in_flight == n, timeout=20)
            server.release()
        await client.close()
        assert server.max_concurrency == server.max_concurrency_for("openai") == n
        assert server.max_concurrency_for("anthropic") == 0 and server.in_flight == 0
        assert results == {i: default_reply(chat_body(f"conversation {i}")) for i in range(n)}
        server.reset_meters()
        assert (server.max_concurrency, server.requests) == (0, [])


async def test_sequential_requests_peak_at_one_on_a_kept_alive_connection(
    server: FakeProviderServer, oa: openai.AsyncOpenAI
) -> None:
    server.set_latency(0.01)
    for i in range(3):
        raw = await oa.chat.completions.with_raw_response.create(**chat_body(str(i)))
        assert raw.headers["connection"] == "keep-alive"
        assert int(raw.headers["content-length"]) == len(raw.content)
    assert server.max_concurrency == 1 and len(server.requests) == 3
    assert len({r.connection for r in server.requests}) == 1


# -- OpenAI batches


def batch_jsonl(rows: dict[str, dict[str, Any]], url: str = "/v1/chat/completions") -> bytes:
    lines = [json.dumps({"custom_id": c, "method": "POST", "url": url, "body": b}) for c, b in rows.items()]
    return ("\n".join(lines) + "\n").encode()


async def test_openai_batch_end_to_end(server: FakeProviderServer, oa: openai.AsyncOpenAI) -> None:
    rows = {f"r{i}": chat_body(f"row {i}") for i in range(3)}
    server.fail_batch_rows(lambda cid, body: cid == "r1", status=400, message="bad row")
    f = await oa.files.create(
        file=("requests.jsonl", batch_jsonl(rows), "application/jsonl"), purpose="batch"
    )
    assert (f.filename, f.purpose, f.bytes) == ("requests.jsonl", "batch", len(batch_jsonl(rows)))
    batch = await oa.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating" and server.batch_count("openai") == 1
    seen: list[str] = [batch.status]
    while batch.status not in ("completed", "failed"):
        batch = await oa.batches.retrieve(batch.id)
        seen.append(batch.status)
    assert seen == ["validating", "in_progress", "finalizing", "completed"]
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        3,
        2,
        1,
    )
    assert batch.output_file_id and batch.error_file_id and batch.completed_at
    out = await oa.files.content(batch.output_file_id)
    ok = {line["custom_id"]: line for line in map(json.loads, out.text.splitlines())}
    assert set(ok) == {"r0", "r2"} and "\n\n" not in out.text
    for cid, line in ok.items():
        completion = ChatCompletion.model_validate(line["response"]["body"], strict=False)
        assert completion.choices[0].message.content == default_reply(rows[cid])
    err = [json.loads(x) for x in (await oa.files.content(batch.error_file_id)).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in err] == [("r1", 400)]
    assert err[0]["response"]["body"]["error"]["message"] == "bad row"
    assert server.batches[batch.id].status == "completed" and server.batches[batch.id].polls == 3


async def test_openai_batch_invalid_input_fails_with_errors(
    server: FakeProviderServer, oa: openai.AsyncOpenAI
) -> None:
    good = json.loads(batch_jsonl({"a": chat_body("x")}))
    lines = [
        good,
        good,
        {**good, "custom_id": "b", "url": "/v1/embeddings"},
        {**good, "custom_id": "c", "method": "GET"},
    ]
    content = ("\n".join(json.dumps(x) for x in lines) + "\n\n").encode()
    f = await oa.files.create(file=content, purpose="batch")
    assert f.filename == "upload"
    batch = await oa.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await oa.batches.retrieve(batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("duplicate_custom_id", 2),
        ("mismatched_url", 3),
        ("invalid_method", 4),
        ("invalid_json_line", 5),
    ]
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        await oa.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )


async def test_openai_batch_cancel_and_list(oa: openai.AsyncOpenAI) -> None:
    f = await oa.files.create(file=batch_jsonl({"a": chat_body("x"), "b": chat_body("y")}), purpose="batch")
    ids = []
    for _ in range(3):
        b = await oa.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        ids.append(b.id)
    cancelled = await oa.batches.cancel(ids[0])
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    done = await oa.batches.retrieve(ids[0])
    assert done.status == "cancelled" and done.output_file_id is None and done.error_file_id
    lines = [json.loads(x) for x in (await oa.files.content(done.error_file_id)).text.splitlines()]
    assert {(x["custom_id"], x["error"]["code"]) for x in lines} == {
        ("a", "batch_cancelled"),
        ("b", "batch_cancelled"),
    }
    with pytest.raises(openai.ConflictError):
        await oa.batches.cancel(ids[0])
    listed = [b.id async for b in oa.batches.list(limit=2)]
    assert listed == ids[::-1]


async def test_polls_per_state_and_fresh_client_reattaches() -> None:
    with FakeProviderServer(polls_per_state=2) as server:
        first = oai(server)
        f = await first.files.create(file=batch_jsonl({"a": chat_body("x")}), purpose="batch")
        batch = await first.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert (await first.batches.retrieve(batch.id)).status == "validating"
        await first.close()
        second = oai(server)  # a new client, new connections: the state lives in the server
        statuses = [(await second.batches.retrieve(batch.id)).status for _ in range(5)]
        assert statuses == ["in_progress", "in_progress", "finalizing", "finalizing", "completed"]
        done = await second.batches.retrieve(batch.id)
        assert done.output_file_id is not None
        text = (await second.files.content(done.output_file_id)).text
        await second.close()
        assert json.loads(text)["response"]["body"]["choices"][0]["message"]["content"] == default_reply(
            chat_body("x")
        )


_POLLER = textwrap.dedent(
    """
    import asyncio, sys, httpx2, openai
    async def main():
        client = openai.AsyncOpenAI(base_url=sys.argv[1], api_key="sk-child",
                                    http_client=httpx2.AsyncClient(trust_env=False))
        while True:
            await client.batches.retrieve(sys.argv[2])
    asyncio.run(main())
    """
)


async def test_client_killed_mid_poll_then_new_client_finishes(
    server: FakeProviderServer, oa: openai.AsyncOpenAI
) -> None:
    f = await oa.files.create(file=batch_jsonl({"a": chat_body("x")}), purpose="batch")
    batch = await oa.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    server.timeout_next(1, seconds=60, path=f"/v1/batches/{batch.id}")  # the child's first poll hangs
    child = subprocess.Popen([sys.executable, "-c", _POLLER, server.openai_base_url, batch.id])
    try:
        await server.await_until(lambda s: s.in_flight_for("openai") == 1, timeout=30)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL
    await server.await_until(lambda s: s.in_flight == 0, timeout=5)  # the server noticed the dead client
    held = [r for r in server.requests if r.path == f"/v1/batches/{batch.id}"]
    assert len(held) == 1 and held[0].status is None  # only the child's hung poll, never answered
    status = batch.status
    while status != "completed":
        status = (await oa.batches.retrieve(batch.id)).status
    assert server.batch_count("openai") == 1


# -- Anthropic batches


async def test_anthropic_batch_end_to_end() -> None:
    with FakeProviderServer(polls_per_state=2) as server:
        an = ant(server)
        await _anthropic_batch_round_trip(server, an)
        await an.close()


async def _anthropic_batch_round_trip(server: FakeProviderServer, an: anthropic.AsyncAnthropic) -> None:
    server.fail_batch_rows(lambda cid, body: cid == "b", status=500, message="row exploded")
    requests: list[Any] = [
        {"custom_id": "a", "params": msg_body("first")},
        {"custom_id": "b", "params": msg_body("second")},
        {
            "custom_id": "c",
            "params": {"model": "claude-test", "messages": [{"role": "user", "content": "z"}]},
        },
    ]
    batch = await an.messages.batches.create(requests=requests)
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 3 and server.batch_count("anthropic") == 1
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        await an.messages.batches.results(batch.id)  # its batch GET is poll 1 of 2: still in progress
    batch = await an.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended"
    assert [r.path for r in server.requests[-2:]] == [f"/v1/messages/batches/{batch.id}"] * 2
    assert batch.results_url == f"{server.base_url}/v1/messages/batches/{batch.id}/results"
    assert batch.ended_at is not None and batch.ended_at.tzinfo is not None
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored) == (0, 1, 2)
    results: dict[str, Any] = {
        r.custom_id: r.result async for r in await an.messages.batches.results(batch.id)
    }
    assert results["a"].type == "succeeded"
    assert results["a"].message.content[0].text == default_reply(msg_body("first"))
    assert results["a"].message.usage.service_tier == "batch"
    assert results["b"].type == "errored" and results["c"].type == "errored"
    assert results["b"].error.error.type == "api_error"
    assert "max_tokens" in results["c"].error.error.message
    deleted = await an.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and batch.id not in server.batches


async def test_anthropic_batch_cancel_list_and_validation(an: anthropic.AsyncAnthropic) -> None:
    one: Any = msg_body("q")
    made = [
        await an.messages.batches.create(requests=[{"custom_id": f"x{i}", "params": one}]) for i in range(3)
    ]
    canceling = await an.messages.batches.cancel(made[0].id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    with pytest.raises(anthropic.ConflictError):
        await an.messages.batches.delete(made[0].id)
    ended = await an.messages.batches.retrieve(made[0].id)
    assert ended.processing_status == "ended" and ended.request_counts.canceled == 1
    assert [r.result.type async for r in await an.messages.batches.results(made[0].id)] == ["canceled"]
    assert [b.id async for b in an.messages.batches.list(limit=2)] == [b.id for b in made[::-1]]
    dup = [{"custom_id": "same", "params": msg_body("q")}] * 2
    with pytest.raises(anthropic.BadRequestError, match="more than once"):
        await an.messages.batches.create(requests=dup)  # type: ignore[arg-type]


# -- server hygiene


async def test_unknown_route_and_reply_errors_are_clear() -> None:
    def broken(body: dict[str, Any]) -> str:
        raise RuntimeError("reply exploded")

    with FakeProviderServer(reply=broken) as server:
        client = oai(server)
        with pytest.raises(openai.NotFoundError, match="no openai route"):
            await client.embeddings.create(model="e", input="x")
        with pytest.raises(openai.InternalServerError, match="reply exploded"):
            await client.chat.completions.create(**chat_body("x"))
        await client.close()
        assert len(server.handler_errors) == 1 and "RuntimeError: reply exploded" in server.handler_errors[0]


async def test_stop_aborts_in_flight_requests_promptly() -> None:
    server = FakeProviderServer().start()
    server.timeout_next(1, seconds=120)
    client = oai(server, max_retries=0)
    errors: list[BaseException] = []

    async def call() -> None:
        try:
            await client.chat.completions.create(**chat_body("x"))
        except openai.APIConnectionError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await server.await_until(lambda s: s.in_flight == 1)
            await anyio.to_thread.run_sync(server.stop)
    await client.close()
    assert len(errors) == 1 and server.in_flight == 0
    server.stop()  # idempotent
    with pytest.raises(RuntimeError, match="create a new one"):
        server.start()


def test_bad_configuration_is_rejected_early() -> None:
    with pytest.raises(ValueError, match="latency"):
        FakeProviderServer(latency=-1)
    with pytest.raises(ValueError, match="polls_per_state"):
        FakeProviderServer(polls_per_state=0)
    server = FakeProviderServer()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.openai_base_url
    with pytest.raises(ValueError, match="positive int"):
        server.fail_next(0)
    with pytest.raises(ValueError, match="provider must be one of"):
        server.fail_next(1, provider="gemini")
    with pytest.raises(ValueError, match="HTTP error status"):
        server.fail_next(1, status=200)
    with pytest.raises(ValueError, match="request path"):
        server.timeout_next(1, path="v1/chat/completions")
    with pytest.raises(ValueError, match="keep tests bounded"):
        server.timeout_next(1, seconds=10_000)
