"""The fake provider refuses, with the provider's 400, the request bodies the real APIs refuse.

interlens posts bodies it builds itself (no SDK type checks them), so the fake is what catches a body the
provider would refuse. Driven through the official SDKs over loopback, exactly as the product sends them;
the Anthropic API version is pinned per test (each SDK major sends its own: 1.x ``2023-06-01``, 2.x
``2026-10-21``, which has no sampling parameters).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from interlens.testing._fake_provider import FakeProviderServer

SECRET = "sk-test-SECRET-0123456789"


pytestmark = pytest.mark.usefixtures("hermetic_api_env")  # conftest: no real key or endpoint leaks in


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer() as srv:
        yield srv
    assert srv.handler_errors == []


@pytest.fixture
async def oa(server: FakeProviderServer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=server.openai_base_url, api_key=SECRET, http_client=httpx2.AsyncClient(trust_env=False)
    )
    yield client
    await client.close()


def anthropic_client(server: FakeProviderServer, version: str = "2026-10-21") -> anthropic.AsyncAnthropic:
    """``version`` pinned, as each SDK major pins its own (1.x: 2023-06-01, 2.x: 2026-10-21)."""
    return anthropic.AsyncAnthropic(
        base_url=server.anthropic_base_url,
        api_key=SECRET,
        http_client=httpx2.AsyncClient(trust_env=False),
        max_retries=0,
        default_headers={"anthropic-version": version},
    )


async def post(client: Any, path: str, body: dict[str, Any]) -> Any:
    """What the product does: the SDK's generic post with a body built by hand."""
    response = await client.post(path, cast_to=httpx2.Response, body=body)
    return response.json()


CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
MSG = {"model": "claude-test", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"max_new_tokens": 5}, "Unrecognized request argument supplied: max_new_tokens"),
        ({"temperature": 2.5}, "Invalid 'temperature': decimal above maximum value"),
        ({"temperature": "hot"}, "Invalid type for 'temperature'"),
        ({"top_p": -0.1}, "Invalid 'top_p': decimal below minimum value"),
        ({"max_completion_tokens": 0}, "Invalid 'max_completion_tokens': integer below minimum value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "Invalid 'stop': array too long"),
        ({"messages": []}, "Invalid 'messages': empty array"),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"Invalid value: 'bot'.*messages\[0\]\.role"),
        ({"messages": [{"role": "user"}]}, r"Missing required parameter: 'messages\[0\]\.content'"),
        ({"logprobs": "yes"}, "Invalid type for 'logprobs'"),
        ({"logprobs": True, "top_logprobs": 21}, "Invalid 'top_logprobs'"),
        ({"top_logprobs": 0}, "'logprobs' must be set to true"),
    ],
)
async def test_openai_refuses_what_the_real_api_refuses(
    oa: openai.AsyncOpenAI, extra: dict[str, Any], problem: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=problem) as info:
        await post(oa, "/chat/completions", CHAT | extra)
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"


async def test_openai_accepts_what_the_product_sends(oa: openai.AsyncOpenAI) -> None:
    body = CHAT | {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 8,
        "temperature": 0.0,
        "top_p": 1,
        "stop": ["\n\n"],
        "logprobs": True,  # record_tokens
        "top_logprobs": 0,
    }
    completion = await post(oa, "/chat/completions", body)
    assert completion["object"] == "chat.completion"
    tokens = completion["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == completion["choices"][0]["message"]["content"]
    assert all(t["top_logprobs"] == [] and bytes(t["bytes"]).decode() == t["token"] for t in tokens)


async def test_openrouter_takes_its_own_extras_but_checks_the_shared_parameters(
    server: FakeProviderServer,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=server.openrouter_base_url, api_key=SECRET, http_client=httpx2.AsyncClient(trust_env=False)
    )
    try:
        ok = await post(client, "/chat/completions", CHAT | {"max_tokens": 8, "provider": {"sort": "price"}})
        assert ok["choices"][0]["message"]["content"]
        with pytest.raises(openai.BadRequestError, match="Invalid 'max_tokens'"):
            await post(client, "/chat/completions", CHAT | {"max_tokens": -1})
    finally:
        await client.close()


@pytest.mark.parametrize("name", ["temperature", "top_p", "top_k"])
async def test_anthropic_2026_10_21_refuses_sampling_parameters(
    server: FakeProviderServer, name: str
) -> None:
    client = anthropic_client(server)
    try:
        with pytest.raises(anthropic.BadRequestError, match=f"{name}: Extra inputs are not permitted"):
            await post(client, "/v1/messages", MSG | {name: 1})  # even the default value
        assert server.requests[-1].headers["anthropic-version"] == "2026-10-21"  # what the server saw
    finally:
        await client.close()


async def test_anthropic_2023_06_01_takes_sampling_parameters_in_range(server: FakeProviderServer) -> None:
    client = anthropic_client(server, version="2023-06-01")
    try:
        message = await post(client, "/v1/messages", MSG | {"temperature": 0.7, "top_p": 0.9, "top_k": 5})
        assert message["type"] == "message"
        with pytest.raises(anthropic.BadRequestError, match=r"temperature: range: 0\.\.1"):
            await post(client, "/v1/messages", MSG | {"temperature": 1.5})
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"max_tokens_to_sample": 5}, "max_tokens_to_sample: Extra inputs are not permitted"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: Input should be 'user'"),
        (
            {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]},
            "messages.0: all messages must have non-empty content",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "messages.0.content.0.text: text content blocks must be non-empty",
        ),
        ({"system": 7}, "system: Input should be a valid string"),
        ({"stop_sequences": ["  "]}, "stop_sequences: each stop sequence must contain non-whitespace"),
        ({"max_tokens": "many"}, "max_tokens: Field required"),
    ],
)
async def test_anthropic_refuses_malformed_messages(
    server: FakeProviderServer, change: dict[str, Any], problem: str
) -> None:
    client = anthropic_client(server)
    try:
        with pytest.raises(anthropic.BadRequestError, match=problem) as info:
            await post(client, "/v1/messages", MSG | change)
        assert info.value.type == "invalid_request_error"
    finally:
        await client.close()


async def test_anthropic_accepts_a_prefill_and_what_the_product_sends(server: FakeProviderServer) -> None:
    client = anthropic_client(server)
    try:
        body = MSG | {
            "system": "Be brief.",
            "stop_sequences": ["\n\nHuman:"],
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
        }
        assert (await post(client, "/v1/messages", body))["type"] == "message"
    finally:
        await client.close()


async def test_batch_rows_follow_the_same_rules() -> None:
    with FakeProviderServer(polls_per_state=1) as srv:
        client = anthropic_client(srv)
        try:
            rows: Any = [
                {"custom_id": "good", "params": MSG},
                {"custom_id": "hot", "params": MSG | {"temperature": 0.5}},
            ]
            batch = await client.messages.batches.create(requests=rows)
            status = await client.messages.batches.retrieve(batch.id)  # one poll per state: ended now
            assert status.processing_status == "ended"
            results = {r.custom_id: r.result async for r in await client.messages.batches.results(batch.id)}
        finally:
            await client.close()
    assert results["good"].type == "succeeded"
    hot: Any = results["hot"]
    assert hot.type == "errored" and "temperature: Extra inputs are not permitted" in hot.error.error.message
