"""APIParticipant against the loopback fake provider, through the official SDKs.

Live conversations per provider, what the provider receives (system block, Anthropic alternation, budget
caps), turn metadata, clear errors for bad settings and missing keys, and keys kept out of pickles, saved
recipes, the ledger and log lines.
"""

from __future__ import annotations

import itertools
import json
import logging
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import anyio
import pytest

from interlens import Conversation, GenerationError, ScriptedParticipant, TokenBudget
from interlens._core._exceptions import ConfigurationError
from interlens._core._view import GenerationOptions, View, ViewMessage
from interlens.participants._api_loop import loop_gateway
from interlens.participants._api_participant import APIParticipant
from interlens.providers._base import CONTINUE_TURN, OPENING_TURN
from interlens.providers._registry import fold_view
from interlens.scheduler._errors import SchedulerError
from interlens.scheduler.gateway import RetryPolicy
from interlens.testing._fake_provider import FakeProviderServer, count_tokens, default_reply

KEY = "sk-planted-SECRET-4f1c9a7e2b"
FAST = RetryPolicy(initial_s=0.01, max_s=0.05)


pytestmark = pytest.mark.usefixtures("hermetic_api_env")


@pytest.fixture
def api_key() -> str:
    return KEY


def api(name: str, provider: str, **settings: Any) -> APIParticipant:
    models = {"openai": "gpt-test", "anthropic": "claude-test", "openrouter": "vendor/model"}
    return APIParticipant(name=name, provider=provider, model_id=models[provider], retry=FAST, **settings)


def generations(server: FakeProviderServer) -> list[Any]:
    return [r for r in server.requests if r.path.endswith(("/chat/completions", "/messages"))]


# -- live use


@pytest.mark.floors
def test_live_conversation_with_each_provider(server: FakeProviderServer) -> None:
    conv = Conversation(
        [
            api("pro", "openai", system_prompt="Argue YES."),
            api("con", "anthropic", system_prompt="Argue NO."),
            api("judge", "openrouter", temperature=0.2),
        ],
        shared_context="Is a hot dog a sandwich?",
    ).turns(6)
    conv.run()
    turns = conv.transcript[1:]
    assert [m.author for m in turns] == ["pro", "con", "judge"] * 2
    requests = generations(server)
    assert [r.provider for r in requests] == ["openai", "anthropic", "openrouter"] * 2
    for message, request in zip(turns, requests, strict=True):
        assert request.status == 200 and request.authenticated
        assert message.content == default_reply(request.json)  # the reply to exactly what was sent
        meta = message.metadata
        assert meta["n_tokens"] == count_tokens(message.content) == message.n_tokens
        assert meta["prompt_tokens"] > 0 and meta["finish_reason"] == "stop" and meta["seconds"] > 0
        assert meta["provider"] == request.provider and meta["request_id"].startswith("req_")
        assert "batch_id" not in meta
    pro, con, judge = requests[3].json, requests[4].json, requests[5].json
    assert pro["messages"][0] == {"role": "system", "content": "Argue YES."}
    assert pro["max_completion_tokens"] == 1024 and "temperature" not in pro
    assert pro["max_tokens"] == 1024  # a server on this machine also gets the older name of the cap
    assert con["max_tokens"] == 1024
    assert con["system"] == [{"type": "text", "text": "Argue NO.", "cache_control": {"type": "ephemeral"}}]
    roles = [m["role"] for m in con["messages"]]
    assert roles[0] == "user" and all(a != b for a, b in itertools.pairwise(roles))
    assert (
        judge["max_tokens"] == 1024
        and judge["temperature"] == 0.2
        and requests[5].path == "/api/v1/chat/completions"
    )
    assert conv.tokens_generated == sum(m.n_tokens for m in turns)


@pytest.mark.floors
def test_api_turns_carry_their_turn_seed_where_the_provider_takes_one(
    server: FakeProviderServer, tmp_path: Any
) -> None:
    """OpenAI's (and OpenAI-compatible servers') ``seed``: the turn's own, the same on a rerun, another per
    job and turn (job i of seed=s is job 0 of seed=s+i), recorded with the turn; Anthropic has no such field
    and gets none."""
    conv = Conversation([api("a", "openai"), api("b", "anthropic")], shared_context="Debate.").turns(4)

    seen = 0

    def seeds(report: Any) -> tuple[list[int], list[Any]]:
        nonlocal seen
        bodies = [r.json for r in generations(server)][seen:]  # this run's requests
        seen += len(bodies)
        sent = [b["seed"] for b in bodies if "messages" in b and "max_completion_tokens" in b]
        assert not any("seed" in b for b in bodies if "max_completion_tokens" not in b)  # Anthropic
        recorded = [
            m.metadata.get("seed")
            for r in report.results.values()
            for m in r.transcript[1:]
            if m.author == "a"
        ]
        assert not any(
            "seed" in m.metadata for r in report.results.values() for m in r.transcript if m.author == "b"
        )
        return sent, recorded

    sent, recorded = seeds(conv.rollout(n=3, out_dir=tmp_path / "first", seed=5))
    assert len(sent) == 6 and len(set(sent)) == 6 and all(0 <= x < 2**31 for x in sent)
    assert sorted(recorded) == sorted(sent)
    again, _ = seeds(conv.rollout(n=3, out_dir=tmp_path / "again", seed=5))
    assert sorted(again) == sorted(sent)  # a rerun sends the same seeds
    other, _ = seeds(conv.rollout(n=3, out_dir=tmp_path / "other", seed=6))
    # per-rollout seeds are seed, seed+1, ...: jobs 0-1 of seed=6 are jobs 1-2 of seed=5, job 2 is new
    assert len(set(other) & set(sent)) == 4 and len(set(other)) == 6


def test_sample_does_not_commit_and_budget_caps_max_tokens(server: FakeProviderServer) -> None:
    conv = Conversation([api("solo", "anthropic")], shared_context="Name three colours.").turns(1)
    conv.run()
    before = list(conv.transcript)
    reply = conv.sample("solo", "One word only?")
    assert list(conv.transcript) == before
    assert reply.content == default_reply(generations(server)[-1].json)
    capped = conv.run_until(TokenBudget(per_turn=3))
    message = capped.step()
    body = generations(server)[-1].json
    assert body["max_tokens"] == 3
    assert message.n_tokens == 3 and message.metadata["finish_reason"] == "length"
    assert message.content == " ".join(default_reply(body).split()[:3])
    spent = Conversation([api("solo", "openai")], shared_context="x").run_until(
        TokenBudget(per_conversation=1)
    )
    spent.transcript.append(type(message)("solo", "one", {"n_tokens": 1}))
    empty = spent.step()
    assert (empty.content, empty.n_tokens, empty.metadata["finish_reason"]) == ("", 0, "length")
    assert len(generations(server)) == 3  # a spent budget sends nothing


def _stance(conv: Conversation) -> dict[str, Any]:
    reply = conv.sample("pro", "One word: your stance?")
    return {"stance": reply.content, "tokens": reply.n_tokens}


def test_analyzer_samples_the_api_participant_inside_a_rollout(server: FakeProviderServer) -> None:
    conv = Conversation([api("pro", "openai"), api("con", "anthropic")], shared_context="Tabs or spaces?")
    report = conv.turns(2).analyzer(_stance).rollout(n=3)
    assert report.failed == []
    samples = [r.json for r in generations(server) if "One word: your stance?" in str(r.json["messages"])]
    assert len(samples) == 3
    for res in report.results.values():
        assert res.transcript is not None and len(res.transcript) == 3  # the sample was not committed
        assert res.analysis["stance"] in {default_reply(body) for body in samples}
        assert res.analysis["tokens"] == count_tokens(res.analysis["stance"])


def test_anthropic_view_folding() -> None:
    def view(*messages: tuple[str, str]) -> View:
        return View("me", "sys", tuple(ViewMessage(role, text, "x") for role, text in messages))

    assert fold_view(view(), "anthropic") == (("user", OPENING_TURN),)
    assert fold_view(view(), "openai") == (("user", OPENING_TURN),)
    folded = fold_view(view(("assistant", "mine"), ("user", "a"), ("user", ""), ("user", "b")), "anthropic")
    assert folded == (("user", OPENING_TURN), ("assistant", "mine"), ("user", "a\n\nb"))
    assert fold_view(view(("user", "q"), ("assistant", "mine")), "anthropic") == (
        ("user", "q"),
        ("assistant", "mine"),
        ("user", CONTINUE_TURN),
    )
    untouched = (("assistant", "mine"), ("user", "a"), ("user", "b"))
    assert fold_view(view(*untouched), "openai") == untouched


def test_explicit_base_url_wins_over_the_environment(
    server: FakeProviderServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # nothing listens on the discard port
    conv = Conversation([api("a", "openai", base_url=server.openai_base_url)], shared_context="hi").turns(1)
    conv.run()
    assert conv.transcript[-1].content == default_reply(generations(server)[0].json)


async def test_loop_gateway_is_per_loop_and_closed_with_its_loop(server: FakeProviderServer) -> None:
    async def live_turn() -> Any:
        conv = Conversation([api("a", "openai")], shared_context="hello").turns(1)
        await conv.arun()
        return await loop_gateway()

    first = await anyio.to_thread.run_sync(anyio.run, live_turn)  # a loop that ends, like conv.run()'s
    mine = await loop_gateway()
    assert first is not mine
    with pytest.raises(SchedulerError, match="closed"):
        await first.call(api("a", "openai"), None)
    assert len(generations(server)) == 1


# -- bad input, missing keys, secrets


def test_bad_settings_are_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="OpenRouter has no batch API"):
        api("r", "openrouter", batch=True)
    with pytest.raises(ConfigurationError, match="provider must be one of openai, anthropic, openrouter"):
        APIParticipant(name="x", provider="gemini", model_id="m")
    for setting in ("capture", "steering", "logprobs"):
        with pytest.raises(ConfigurationError, match=f"cannot do interp \\({setting}=\\).*ModelParticipant"):
            api("x", "openai", **{setting: True})
    with pytest.raises(ConfigurationError, match=r"no setting\(s\) \['max_new_tokens'\]"):
        api("x", "openai", max_new_tokens=5)
    with pytest.raises(ConfigurationError, match="max_tokens must be a positive int"):
        api("x", "openai", max_tokens=0)
    with pytest.raises(ConfigurationError, match="base_url must be an http"):
        api("x", "openai", base_url="api.openai.com")
    with pytest.raises(ConfigurationError, match="temperature must be None or a number"):
        api("x", "openai", temperature=3)
    with pytest.raises(ConfigurationError, match="retry must be a RetryPolicy"):
        APIParticipant(name="x", provider="openai", model_id="m", retry={"max_attempts": 2})


def test_interp_request_at_generation_raises_not_ignored(server: FakeProviderServer) -> None:
    from interlens import SteeringSpec
    from interlens.interp._capture import ActivationCache, CaptureSpec, CaptureTarget

    steer = GenerationOptions(steering=(SteeringSpec([1.0, 0.0], layers=0),))
    capture = GenerationOptions(capture=CaptureTarget(ActivationCache(CaptureSpec()), 1))
    for options in (steer, capture):
        with pytest.raises(ConfigurationError, match="cannot do interp"):
            api("a", "openai").generate(View("a", None, ()), options)
    assert generations(server) == []


@pytest.mark.parametrize(
    ("provider", "variable"),
    [("openai", "OPENAI_API_KEY"), ("anthropic", "ANTHROPIC_API_KEY"), ("openrouter", "OPENROUTER_API_KEY")],
)
def test_missing_key_names_the_variable(provider: str, variable: str) -> None:
    conv = Conversation([api("a", provider)], shared_context="hi").turns(2)  # builds offline, no key
    with pytest.raises(ConfigurationError, match=f"set the environment variable {variable}"):
        conv.run()
    report = conv.rollout(n=2)
    assert sorted(report.failed) == ["rollout_0000", "rollout_0001"]
    error = report.results["rollout_0000"].error
    assert error is not None and variable in error.message


def test_key_never_reaches_a_pickle_or_a_saved_recipe(server: FakeProviderServer, tmp_path: Any) -> None:
    participant = api("a", "openai", system_prompt="Be brief.")
    conv = Conversation([participant, api("b", "anthropic")], shared_context="hi").turns(2)
    conv.run()
    assert KEY not in repr(pickle.dumps(participant)) and KEY not in repr(pickle.dumps(conv.transcript))
    saved = conv.save(tmp_path)
    assert KEY not in saved.read_text() and KEY not in repr(conv.to_json()) and KEY not in repr(participant)
    loaded = Conversation.load(tmp_path)
    clone = loaded.participants[0]
    assert isinstance(clone, APIParticipant) and clone.to_json() == participant.to_json()
    assert [m.content for m in loaded.transcript] == [m.content for m in conv.transcript]


def test_fingerprint_ignores_how_requests_are_sent() -> None:
    base = Conversation(
        [APIParticipant(name="a", provider="openai", model_id="m")], shared_context="x"
    ).turns(2)
    moved = base.set(
        participants=[
            APIParticipant(
                name="a", provider="openai", model_id="m", base_url="http://proxy:8080/v1", max_in_flight=8
            )
        ]
    )
    hotter = base.set(
        participants=[APIParticipant(name="a", provider="openai", model_id="m", temperature=0.9)]
    )
    assert base.fingerprint() == moved.fingerprint() != hotter.fingerprint()


def test_planted_key_absent_from_ledger_and_logs(
    server: FakeProviderServer, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the SDKs' and httpx2's included
    server.fail_next(1, status=429, retry_after=0.01)
    conv = Conversation(
        [api("a", "openai", system_prompt="Argue."), api("b", "anthropic"), ScriptedParticipant("c", ["ok"])],
        shared_context="Is a hot dog a sandwich?",
    ).turns(3)
    report = conv.rollout(n=4, out_dir=tmp_path)
    assert report.failed == [] and len(report.results) == 4
    assert any("429" in r.getMessage() and "retrying" in r.getMessage() for r in caplog.records)
    assert KEY not in caplog.text
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert b"Is a hot dog a sandwich?" in stored  # the ledger holds the run...
    assert KEY.encode() not in stored  # ...but never the key


# -- OpenRouter's errors inside a 200


class _ErrorThen200(BaseHTTPRequestHandler):
    """OpenRouter reports errors that happen mid-generation with HTTP 200: a body with "error" (no choices),
    or a choice with finish_reason "error". The SDK does not raise for either; we must."""

    protocol_version = "HTTP/1.1"
    script: ClassVar[list[dict[str, Any]]] = []
    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
        payload = self.script.pop(0)
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _completion(text: str, finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "gen-1",
        "object": "chat.completion",
        "created": 1,
        "model": "vendor/model",
        "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def test_openrouter_errors_inside_a_200_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY)
    _ErrorThen200.script = [
        {"error": {"code": 502, "message": "upstream provider dropped the stream"}},
        _completion("partial", finish="error"),
        _completion("all good"),
        {"error": {"code": 400, "message": "context too long"}},
    ]
    _ErrorThen200.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ErrorThen200)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/api/v1"
        conv = Conversation([api("r", "openrouter", base_url=url)], shared_context="hi").turns(1)
        conv.run()  # 502-in-200 and finish_reason error are retried, then the good answer lands
        assert conv.transcript[-1].content == "all good" and len(_ErrorThen200.bodies) == 3
        with pytest.raises(GenerationError, match=r"not retryable.*context too long"):
            conv.run(turns=1)
        assert len(_ErrorThen200.bodies) == 4
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_anthropic_sampling_settings_the_installed_sdk_cannot_send_are_refused_at_construction() -> None:
    """The 2.x SDKs talk API version 2026-10-21, which has no temperature/top_p: every turn would be a 400."""
    from importlib.metadata import version

    assert int(version("anthropic").split(".")[0]) >= 2  # what CI installs (see .ci/constraints.txt)
    for settings in ({"temperature": 0.7}, {"top_p": 0.9}, {"temperature": 0.0, "top_p": 0.5}):
        with pytest.raises(ConfigurationError, match=r"API version \(2026-10-21\) has no temperature/top_p"):
            APIParticipant(name="c", provider="anthropic", model_id="claude-x", **settings)
    APIParticipant(name="c", provider="anthropic", model_id="claude-x")  # no sampling setting: fine
    APIParticipant(name="g", provider="openai", model_id="gpt-x", temperature=0.7, top_p=0.9)


def test_a_public_endpoint_gets_one_name_for_the_cap_a_self_hosted_one_both() -> None:
    """OpenAI's reasoning models refuse ``max_tokens``; llama.cpp's Python server ignores
    ``max_completion_tokens`` (a 24-token cap ran to 231 tokens against it). So the older name rides along
    only to a local or private host, where self-hosted servers run."""
    from interlens.providers._openai import live_body

    request = api("x", "openai", max_tokens=24).request(
        View(speaker="x", system=None, messages=()), GenerationOptions()
    )
    assert live_body(request, local=False)["max_completion_tokens"] == 24
    assert "max_tokens" not in live_body(request, local=False)
    assert (
        live_body(request, local=True)["max_tokens"]
        == 24
        == live_body(request, local=True)["max_completion_tokens"]
    )
    router = api("r", "openrouter", max_tokens=24).request(
        View(speaker="x", system=None, messages=()), GenerationOptions()
    )
    assert live_body(router, local=True) == live_body(router, local=False)  # OpenRouter: max_tokens only
