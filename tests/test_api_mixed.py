"""A debate between a local tiny HF model and a hosted model: local turns stay batched across conversations.

The local model is a real tiny Qwen2 loaded through ``from_pretrained``; the hosted one talks to the loopback
fake provider through the official SDK, either as concurrent single requests or as one provider batch per
round.
"""

from __future__ import annotations

import pytest

from interlens import AutoModelParticipant, Conversation
from interlens._core._message import Transcript
from interlens._core._view import GenerationOptions
from interlens.participants._api_participant import APIParticipant
from interlens.providers._registry import request_body
from interlens.scheduler.gateway import BatchPolicy
from interlens.testing._fake_provider import FakeProviderServer, default_reply

KEY = "sk-mixed-test-0123456789"


pytestmark = pytest.mark.usefixtures("hermetic_api_env")


@pytest.fixture
def api_key() -> str:
    return KEY


@pytest.mark.parametrize("batch", [False, True], ids=["single-requests", "provider-batches"])
def test_mixed_local_and_api_debate_keeps_local_turns_batched(
    server: FakeProviderServer, qwen2_path: str, batch: bool
) -> None:
    local = AutoModelParticipant.from_pretrained(qwen2_path, name="local", temperature=0.9, max_new_tokens=6)
    hosted = APIParticipant(
        name="hosted",
        provider="openai",
        model_id="gpt-test",
        system_prompt="Disagree.",
        batch=batch,
        batch_policy=BatchPolicy(idle_s=0.2, poll_initial_s=0.01, poll_max_s=0.05),
    )
    conv = Conversation([local, hosted], shared_context="Debate: tabs vs spaces.").turns(4)
    # Until the gateway reports its waiting jobs to the device batcher (the wiring), a round of local turns
    # gathers by max_batch_wait while the API replies trickle in; generous, since quiescence ends it early.
    report = conv.rollout(n=8, devices=["cpu"], max_batch_wait=2.0)
    assert report.failed == [] and len(report.results) == 8
    hosted_bodies = [r.json for r in server.requests if r.path == "/v1/chat/completions"]
    hosted_rows = sum(len(b.custom_ids) for b in server.batches.values())
    assert (len(hosted_bodies), hosted_rows) == ((0, 16) if batch else (16, 0))
    for res in report.results.values():
        transcript = res.transcript
        assert transcript is not None and [m.author for m in transcript[1:]] == ["local", "hosted"] * 2
        for message in transcript[1:]:
            if message.author == "local":
                assert message.metadata["batched"] and message.metadata["batch_size"] == 8
                assert "provider" not in message.metadata
            else:
                assert message.metadata["provider"] == "openai"
                assert ("batch_id" in message.metadata) == batch
                assert message.content.startswith("reply to local: ") or message.content.startswith(
                    "reply to "
                )
        assert res.tokens_generated == sum(m.n_tokens for m in transcript[1:]) > 0
        for i in (2, 4):  # each hosted turn answers its own conversation's history
            live = conv.set()
            live.transcript = Transcript(list(transcript)[:i])
            body = request_body(hosted.request(live.view(hosted), GenerationOptions()))
            assert transcript[i].content == default_reply(body)
    if not batch:
        replies = sorted(
            m.content for r in report.results.values() for m in r.transcript[1:] if m.author == "hosted"
        )
        assert replies == sorted(default_reply(body) for body in hosted_bodies)
    else:
        assert server.batch_count("openai") == 2  # one per hosted round
