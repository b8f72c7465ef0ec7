"""A real OpenAI-compatible server as a participant: ``transformers serve`` with the real model, on loopback.

The server is transformers' own (FastAPI + uvicorn, continuous batching), serving SmolLM2-135M-Instruct from
its converted directory on a free loopback port; an ``APIParticipant(provider="openai", base_url=...)``
speaks to it through the official OpenAI SDK with no key, as users point interlens at vLLM or a llama.cpp
server. Started once for the module and stopped after it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from interlens import APIParticipant, Conversation
from interlens.scheduler.gateway import RetryPolicy
from interlens.store import LedgerReader
from interlens.testing import REAL_MODEL_INSTALL, real_model, transformers_serve

PATH = real_model()
pytestmark = [
    pytest.mark.skipif(PATH is None, reason=f"the real model is not installed: {REAL_MODEL_INSTALL}"),
    pytest.mark.usefixtures("hermetic_api_env"),
]
FAST = RetryPolicy(initial_s=0.05, max_s=0.2, max_attempts=2)


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    """``transformers serve`` on a free loopback port; its URL once uvicorn says it is up."""
    pytest.importorskip("fastapi", reason="transformers serve needs transformers[serving] (the test extra)")
    assert PATH is not None
    with transformers_serve(PATH) as url:
        yield url


def _speaker(name: str, url: str, model_id: str | None = None, **settings: object) -> APIParticipant:
    assert PATH is not None
    return APIParticipant(
        name=name,
        provider="openai",
        model_id=model_id or PATH,
        base_url=url,
        retry=FAST,
        temperature=0.0,
        max_tokens=12,
        **settings,
    )


def test_a_debate_against_transformers_serve_runs_records_usage_and_resumes(
    serve_url: str, tmp_path: Path
) -> None:
    conv = Conversation(
        [
            _speaker("pro", serve_url, system_prompt="You argue for tabs. One sentence."),
            _speaker("con", serve_url, system_prompt="You argue for spaces. One sentence."),
        ],
        shared_context="Debate: tabs or spaces?",
    ).turns(2)
    report = conv.rollout(n=1, out_dir=tmp_path / "run", progress=False)
    assert report.failed == [] and len(report.results) == 1
    turns = [m for r in report.results.values() for m in r.transcript[1:]]
    assert len(turns) == 2 and all(m.content.strip() for m in turns)
    assert all(m.metadata["model"] == PATH for m in turns)
    totals = report.usage().totals()  # the server's own token counts, recorded per turn
    assert (
        totals["requests"] == 2 and totals["input_tokens"] > 2 * 20 and 2 <= totals["output_tokens"] <= 2 * 12
    )
    with LedgerReader(tmp_path / "run") as reader:
        assert reader.counts()["done"] == 1
    again = conv.rollout(n=1, out_dir=tmp_path / "run", progress=False)
    assert again.counts.get("skipped") == 1 and again.failed == []


def test_a_model_the_server_does_not_have_fails_the_job_with_its_reason(serve_url: str) -> None:
    conv = Conversation(
        [_speaker("a", serve_url, model_id="no-such-org/no-such-model")], shared_context="hi"
    ).turns(1)
    report = conv.rollout(n=1, progress=False)
    assert len(report.failed) == 1
    error = report.results[report.failed[0]].error
    assert error is not None and error.type == "GenerationError", error
    # the server's own reason, which the SDK's message leaves out ("Error code: 400")
    assert "HTTP 400" in error.message and "requested 'no-such-org/no-such-model'" in error.message, error


def test_record_tokens_against_a_server_that_ignores_logprobs_keeps_the_turns_and_says_so(
    serve_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``transformers serve`` accepts ``logprobs: true`` and answers without them. Each turn keeps its text
    (the work is not lost), its metadata says why it has no token record, and the participant warns once."""
    conv = Conversation(
        [_speaker("rec", serve_url, record_tokens=True, system_prompt="One sentence.")],
        shared_context="Tabs or spaces?",
    ).turns(2)
    with caplog.at_level(logging.WARNING, logger="interlens"):
        conv.run()
    turns = conv.transcript[1:]
    assert len(turns) == 2 and all(m.content.strip() for m in turns)
    for message in turns:
        assert message.tokens is None
        assert message.metadata["tokens_missing"].startswith(
            "asked for log-probabilities (record_tokens=True)"
        )
        assert serve_url in message.metadata["tokens_missing"]
    warned = [r.getMessage() for r in caplog.records if "keep no token record" in r.getMessage()]
    assert len(warned) == 1 and "record_tokens=False" in warned[0]
