"""The API gateway's concurrency: the in-flight bound, retries with backoff, the adaptive limiter.

Unit tests drive the generic pieces (``AdaptiveLimiter``, ``RetryPolicy``, ``retry_after_seconds``) directly;
the rest runs real rollouts of APIParticipants against the loopback fake provider through the official SDKs.
"""

from __future__ import annotations

import email.utils
from collections import Counter
from typing import Any

import anyio
import pytest

from interlens import Conversation, GenerationError, dataset_field
from interlens.participants._api_loop import loop_gateway
from interlens.participants._api_participant import APIParticipant
from interlens.scheduler.gateway import AdaptiveLimiter, Failure, RetryPolicy, retry_after_seconds
from interlens.testing._fake_provider import FakeProviderServer, default_reply

KEY = "sk-gateway-test-0123456789"
FAST = RetryPolicy(initial_s=0.01, max_s=0.05)


pytestmark = pytest.mark.usefixtures("hermetic_api_env")


@pytest.fixture
def api_key() -> str:
    return KEY


def generations(server: FakeProviderServer) -> list[Any]:
    return [r for r in server.requests if r.path.endswith(("/chat/completions", "/messages"))]


# -- the generic pieces


async def test_limiter_bounds_in_flight_fifo_and_survives_cancellation() -> None:
    limiter = AdaptiveLimiter(2)
    order: list[int] = []
    release = anyio.Event()

    async def worker(i: int) -> None:
        token = await limiter.acquire()
        order.append(i)
        assert limiter.in_flight <= 2
        await release.wait()
        limiter.release(token, "ok")

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(worker, i)
            await anyio.wait_all_tasks_blocked()
        assert (order, limiter.in_flight, limiter.waiting) == ([0, 1], 2, 3)
        with anyio.CancelScope() as scope:  # a cancelled waiter leaves the queue without taking a slot
            scope.cancel()
            await limiter.acquire()
        assert limiter.waiting == 3
        release.set()
    assert order == [0, 1, 2, 3, 4] and limiter.in_flight == 0 and limiter.peak == 2


async def test_limiter_halves_once_per_epoch_and_climbs_back() -> None:
    limiter = AdaptiveLimiter(16)
    tokens = [await limiter.acquire() for _ in range(16)]  # sixteen calls sent together...
    for token in tokens:  # ...all answered 429: ONE signal, not sixteen
        limiter.release(token, "rate_limited")
    assert (limiter.limit, limiter.lowest, limiter.rate_limited) == (8, 8, 16)
    limiter.release(await limiter.acquire(), "rate_limited")  # a call sent after the drop: a new signal
    assert (limiter.limit, limiter.lowest) == (4, 4)
    tokens = [await limiter.acquire() for _ in range(4)]
    with anyio.move_on_after(0.05) as waited:  # the fifth must wait: the limit is now 4
        await limiter.acquire()
    assert waited.cancelled_caught and limiter.in_flight == 4
    for token in tokens:
        limiter.release(token, "error")  # a non-rate-limit failure neither shrinks nor grows it
    assert limiter.limit == 4
    successes = 0
    while limiter.limit < 16:
        limiter.release(await limiter.acquire(), "ok")
        successes += 1
    assert 100 <= successes <= 130  # about one slot per window of successes: sum(4..15) = 114
    limiter.release(await limiter.acquire(), "ok")
    assert limiter.limit == 16 == limiter.max_in_flight  # never above the configured maximum
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1"):
        AdaptiveLimiter(0)


def test_retry_policy_and_retry_after() -> None:
    policy = RetryPolicy(max_attempts=3, initial_s=0.5, max_s=1.5, jitter=0.25, max_retry_after_s=10)
    assert [policy.delay(n, rand=lambda: 0.0) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, 1.5]
    assert policy.delay(1, rand=lambda: 1.0) == 0.375  # jitter shortens by up to a quarter
    assert policy.delay(2, retry_after=4.0) == 4.0  # the provider's word wins
    assert policy.should_retry(1, Failure(True)) and policy.should_retry(2, Failure(True, True, 9.0))
    assert not policy.should_retry(3, Failure(True))  # out of attempts
    assert not policy.should_retry(1, Failure(False))  # a 400 is not worth repeating
    assert not policy.should_retry(1, Failure(True, True, 60.0))  # "come back in a minute": fail instead
    assert retry_after_seconds({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert retry_after_seconds({"retry-after": "1.5"}) == 1.5
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert retry_after_seconds({"retry-after": date}, now=1_000_000) == pytest.approx(30)
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({"retry-after": "-1"}) is None and retry_after_seconds({}) is None
    with pytest.raises(ValueError, match="max_attempts must be an int >= 1"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="jitter must be a fraction"):
        RetryPolicy(jitter=2)


# -- concurrency against the fake provider


async def test_200_conversations_by_4_turns_never_exceed_the_limit_and_reach_it(
    server: FakeProviderServer,
) -> None:
    server.set_latency(0.02)
    a = APIParticipant(
        name="a", provider="openai", model_id="gpt-test", max_in_flight=16, system_prompt="Yes."
    )
    b = APIParticipant(
        name="b", provider="openai", model_id="gpt-test", max_in_flight=16, system_prompt="No."
    )
    conv = Conversation([a, b], shared_context="Is a hot dog a sandwich?").turns(4)
    report = await conv.arollout(n=200)
    assert report.failed == [] and len(report.results) == 200
    requests = generations(server)
    assert len(requests) == 800 and all(r.status == 200 for r in requests)
    assert server.max_concurrency_for("openai") == 16  # a and b share one client and one limit
    replies = Counter(m.content for res in report.results.values() for m in res.transcript[1:])
    assert replies == Counter(default_reply(r.json) for r in requests)  # every reply to its own request
    [stats] = report.api_stats["clients"]  # the run's gateway served every turn, in the parent
    assert (stats["peak_in_flight"], stats["limit"], stats["retries"]) == (16, 16, 0)
    assert stats["requests"] == 800 and (await loop_gateway()).stats()["clients"] == []


async def test_adaptive_limit_backs_off_under_429s_and_climbs_back(server: FakeProviderServer) -> None:
    speaker = APIParticipant(name="a", provider="openai", model_id="gpt-test", max_in_flight=16, retry=FAST)
    conv = Conversation([speaker], shared_context="Count to three.").turns(4)
    server.set_latency(0.005)
    server.fail_next(40, status=429, retry_after=0.005)
    report = await conv.arollout(n=64)
    assert report.failed == []
    [limiter] = report.api_stats["clients"]
    assert limiter["rate_limited"] == 40
    assert limiter["lowest_limit"] <= 4  # sustained 429s: halved at least twice (once per wave, not per 429)
    assert limiter["limit"] == 16  # the rest of the 256 successes climbed back to the maximum
    assert server.max_concurrency_for("openai") <= 16
    assert [r.status for r in generations(server)].count(200) == 256


def test_429_500_timeout_and_garbled_body_are_retried_then_succeed(server: FakeProviderServer) -> None:
    speaker = APIParticipant(name="a", provider="anthropic", model_id="claude-test", timeout=0.5, retry=FAST)
    server.fail_next(2, status=429, retry_after=0.02)
    server.fail_next(1, status=500)
    server.timeout_next(1, seconds=30)
    server.malformed_next(1)
    conv = Conversation([speaker], shared_context="Hello?").turns(1)
    conv.run()
    requests = generations(server)
    # None: the client gave up waiting; the first 200 carried a truncated body
    assert [r.status for r in requests] == [429, 429, 500, None, 200, 200]
    assert conv.transcript[-1].content == default_reply(requests[-1].json)
    assert all(r.json == requests[0].json for r in requests)  # the same request each time
    assert [r.headers["x-stainless-retry-count"] for r in requests] == ["0"] * 6  # our retries, not the SDK's


def test_exhausted_retries_fail_the_conversation_with_a_clear_error(server: FakeProviderServer) -> None:
    policy = RetryPolicy(max_attempts=3, initial_s=0.01)
    speaker = APIParticipant(name="a", provider="openai", model_id="gpt-test", retry=policy)
    server.fail_next(3, status=503)
    conv = Conversation([speaker], shared_context="Hello?").turns(1)
    with pytest.raises(
        GenerationError, match=r"a \(openai model 'gpt-test'\).*gave up after 3 attempts.*503"
    ):
        conv.run()
    assert len(generations(server)) == 3
    dead = APIParticipant(
        name="d", provider="openai", model_id="m", base_url="http://127.0.0.1:9/v1", retry=policy
    )
    with pytest.raises(GenerationError, match=r"after 3 attempts.*APIConnectionError"):
        Conversation([dead], shared_context="x").turns(1).run()


def test_a_failing_request_fails_its_conversation_not_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def reply(body: dict[str, Any]) -> str:
        if "POISON" in str(body["messages"]):
            raise RuntimeError("the model choked")  # the fake answers 500 with x-should-retry: false
        return default_reply(body)

    with FakeProviderServer(reply=reply) as server:
        for name, value in server.env(api_key=KEY).items():
            monkeypatch.setenv(name, value)
        speaker = APIParticipant(name="a", provider="openai", model_id="gpt-test", retry=FAST)
        rows = [{"q": "What is 1+1?"}, {"q": "POISON"}, {"q": "What is 2+2?"}]
        conv = Conversation([speaker], shared_context=dataset_field("q")).turns(2).data(rows)
        report = conv.rollout()
        assert report.failed == ["row_00001"]
        error = report.results["row_00001"].error
        assert error is not None and error.type == "GenerationError"
        assert "not retryable" in error.message and "the model choked" in error.message
        for job in ("row_00000", "row_00002"):
            assert report.results[job].error is None and len(report.results[job].transcript) == 3
        assert len(server.handler_errors) == 1
