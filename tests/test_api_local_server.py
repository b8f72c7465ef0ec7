"""OpenAI-compatible local servers (vLLM, SGLang, llama.cpp) as participants, with no API key.

The fake provider runs with authentication off (``require_auth=False``), as such a server does by default;
the participant points at it with ``provider="openai"`` and its ``base_url``, no key in the environment.
The missing-key error stays for every endpoint that is not local.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from interlens import Conversation
from interlens._core._exceptions import ConfigurationError
from interlens.participants._api_participant import APIParticipant
from interlens.providers._registry import is_local_endpoint
from interlens.scheduler.gateway import RetryPolicy
from interlens.testing._fake_provider import FakeProviderServer, default_reply

FAST = RetryPolicy(initial_s=0.01, max_s=0.05)
KEY = "sk-planted-LOCAL-9d8c7b6a5f"

pytestmark = pytest.mark.usefixtures("hermetic_api_env")


@pytest.fixture
def open_server() -> Iterator[FakeProviderServer]:
    """A fake with authentication off; no provider variable is set (hermetic_api_env cleared them)."""
    with FakeProviderServer(require_auth=False) as srv:
        yield srv
    assert srv.handler_errors == []


def local(name: str, url: str, **settings: object) -> APIParticipant:
    return APIParticipant(
        name=name, provider="openai", model_id="Qwen/Qwen3-8B", base_url=url, retry=FAST, **settings
    )


def test_a_local_server_without_a_key_serves_a_rollout_with_retries(
    open_server: FakeProviderServer, tmp_path: Path
) -> None:
    open_server.fail_next(2, status=429, retry_after=0.01)
    open_server.set_latency(0.02)
    conv = Conversation(
        [
            local("pro", open_server.openai_base_url, system_prompt="Argue YES.", max_in_flight=3),
            local("con", open_server.openai_base_url, max_in_flight=3),
        ],
        shared_context="Is a hot dog a sandwich?",
    ).turns(2)
    report = conv.rollout(n=8, out_dir=tmp_path)
    assert report.failed == [] and len(report.results) == 8
    requests = [r for r in open_server.requests if r.path == "/v1/chat/completions"]
    assert len(requests) == 8 * 2 + 2  # two 429s retried
    assert [r.status for r in requests].count(429) == 2
    assert all(not r.authenticated and "authorization" not in r.headers for r in requests)
    assert open_server.max_concurrency_for("openai") <= 3  # one client: the endpoint's in-flight limit
    ok = [r for r in requests if r.status == 200]
    texts = {m.content for t in report.transcripts().values() for m in t[1:]}
    assert texts == {default_reply(r.json) for r in ok}


def test_a_set_key_is_sent_to_a_local_server(server: FakeProviderServer) -> None:
    conv = Conversation([local("a", server.openai_base_url)], shared_context="hi").turns(1)
    conv.run()  # the server fixture sets OPENAI_API_KEY and requires it
    assert server.requests[-1].authenticated and server.requests[-1].status == 200


def test_auth_false_sends_no_key_even_when_one_is_set(
    open_server: FakeProviderServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    url = open_server.openai_base_url.replace("127.0.0.1", "localhost")
    conv = Conversation([local("a", url, auth=False)], shared_context="hi").turns(1)
    conv.run()
    assert [r.authenticated for r in open_server.requests] == [False]
    assert KEY not in repr(open_server.requests)


def test_auth_true_or_a_public_endpoint_still_needs_the_key(open_server: FakeProviderServer) -> None:
    conv = Conversation([local("a", open_server.openai_base_url, auth=True)], shared_context="hi").turns(1)
    with pytest.raises(ConfigurationError, match="set the environment variable OPENAI_API_KEY"):
        conv.run()
    public = Conversation([local("a", "https://api.example.com/v1")], shared_context="hi").turns(1)
    with pytest.raises(ConfigurationError, match=r"OPENAI_API_KEY.*auth=False"):
        public.run()
    assert open_server.requests == []


def test_auth_setting_is_checked_and_kept() -> None:
    with pytest.raises(ConfigurationError, match="auth must be None"):
        local("a", "http://localhost:8000/v1", auth="no")
    with pytest.raises(ConfigurationError, match="auth=False is for OpenAI-compatible"):
        APIParticipant(name="a", provider="anthropic", model_id="m", auth=False)
    p = local("a", "http://localhost:8000/v1", auth=False)
    assert APIParticipant.from_json(p.to_json()).auth is False
    assert p.client_key != local("a", "http://localhost:8000/v1").client_key


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://localhost:8000/v1", True),
        ("http://127.0.0.1:30000/v1", True),
        ("http://[::1]:8080/v1", True),
        ("http://10.1.2.3/v1", True),
        ("http://192.168.0.7:8000/v1", True),
        ("http://172.20.0.2:8000/v1", True),
        ("https://api.openai.com/v1", False),
        ("http://8.8.8.8/v1", False),
        ("http://vllm.internal:8000/v1", False),
    ],
)
def test_which_endpoints_count_as_local(url: str, expected: bool) -> None:
    assert is_local_endpoint(url) is expected


def test_batches_to_a_local_server_send_no_key_either(open_server: FakeProviderServer) -> None:
    from interlens.scheduler.gateway import BatchPolicy

    quick = BatchPolicy(idle_s=0.3, poll_initial_s=0.01, poll_max_s=0.05)
    speaker = local("a", open_server.openai_base_url, batch=True, batch_policy=quick)
    report = Conversation([speaker], shared_context="hi").turns(1).rollout(n=3)
    assert report.failed == [] and open_server.batch_count("openai") == 1
    paths = {r.path.split("/")[2] for r in open_server.requests}
    assert paths == {"files", "batches"}  # upload, create, poll, results: every call of the batch API
    assert all(not r.authenticated for r in open_server.requests)


def test_a_local_server_that_wants_a_key_it_was_not_sent_names_the_variable(tmp_path: Path) -> None:
    """The key variable unset, a local endpoint is called keyless; a server started with a key answers 401,
    and the job's error says which variable to set, not only the server's "missing credentials"."""
    with FakeProviderServer() as guarded:  # authentication on
        conv = Conversation([local("a", guarded.openai_base_url)], shared_context="hi").turns(1)
        report = conv.rollout(n=1, out_dir=tmp_path / "unset")
        (job,) = report.failed
        error = report.results[job].error
        assert error is not None and "HTTP 401" in error.message
        assert "No key was sent (OPENAI_API_KEY is not set" in error.message
        assert "set OPENAI_API_KEY to the server's key" in error.message
        keyless = local("a", guarded.openai_base_url, auth=False)
        refused = Conversation([keyless], shared_context="hi").turns(1)
        report = refused.rollout(n=1, out_dir=tmp_path / "auth_false")
        error = report.results[report.failed[0]].error
        assert error is not None and "drop auth=False and set OPENAI_API_KEY" in error.message
        assert all(not r.authenticated for r in guarded.requests)
