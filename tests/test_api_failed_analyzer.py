"""An analyzer's API samples stay counted when its job fails and a rerun replaces the result.

The analyzer (an LLM judge on the loopback fake provider) samples, then raises while ``JUDGE_FAILS`` is set:
the job fails with its conversation (and the samples' usage) kept, and a rerun into the same ``out_dir``
redoes only the analysis, whose result replaces the kept one. The requests of every attempt were paid for,
so ``RunReport.usage()``, ``interlens status`` and the spend guard of later runs count them all (the ledger
keeps replaced results' states: ``superseded_results``). Real ledger in ``tmp_path``, no mocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from interlens import APIBudget, Conversation, ScriptedParticipant, dataset_field
from interlens._api_participant import APIParticipant
from interlens._cli_runs import run_status
from interlens.scheduler.gateway import RetryPolicy
from interlens.store import LedgerReader
from interlens.testing._fake_provider import FakeProviderServer

FAST = RetryPolicy(initial_s=0.01, max_s=0.05)

pytestmark = pytest.mark.usefixtures("hermetic_api_env")


class JudgeBroke(RuntimeError):
    pass


def flaky_judge(conv: Conversation) -> dict[str, str]:
    """An LLM judge that fails after its (paid) sample while ``JUDGE_FAILS`` is set."""
    verdict = conv.sample("judge", "Was that a good answer? One word.").content
    if os.environ.get("JUDGE_FAILS"):
        raise JudgeBroke("the judge's answer could not be parsed")
    return {"verdict": verdict}


def judge_requests(server: FakeProviderServer) -> int:
    return sum(
        1 for r in server.requests if r.path == "/v1/chat/completions" and r.json["model"] == "gpt-judge"
    )


def spent(server: FakeProviderServer) -> tuple[int, int]:
    """(input, output) tokens of every answer the server gave, as it reported them."""
    usage = [e["usage"] for e in server.reported_usage]
    return sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage)


def test_a_failed_analyzers_samples_stay_counted_after_a_rerun_replaces_its_result(
    server: FakeProviderServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    judge = APIParticipant(name="judge", provider="openai", model_id="gpt-judge", retry=FAST)
    host = ScriptedParticipant("host", ["An answer."])
    conv = (
        Conversation([host, judge], shared_context=dataset_field("q"))
        .turns(1)  # only the host speaks: every API request is the analyzer's
        .data([{"q": f"question number {i:02d}"} for i in range(6)])
        .analyzer(flaky_judge)
    )
    monkeypatch.setenv("JUDGE_FAILS", "1")
    for attempt in (1, 2):  # the analyzer fails on every job, twice; each time after its sample
        failed = conv.rollout(n=3, out_dir=tmp_path)
        assert failed.counts["failed"] == 3 and judge_requests(server) == 3 * attempt
        assert all("JudgeBroke" in (r.error.type if r.error else "") for r in failed.results.values())
    monkeypatch.delenv("JUDGE_FAILS")
    fixed = conv.rollout(n=3, out_dir=tmp_path)  # only the analysis is redone: one more sample per job
    assert fixed.failed == [] and judge_requests(server) == 9
    assert all(r.analysis and r.analysis["verdict"] for r in fixed.results.values())
    tokens_in, tokens_out = spent(server)
    assert (
        len({u["usage"]["prompt_tokens"] for u in server.reported_usage}) == 1
    )  # every sample costs the same
    cost = (tokens_in + tokens_out) // 9

    [row] = fixed.usage().api  # every attempt's samples, not only the results' that replaced them
    assert (row.model, row.requests, row.input_tokens, row.output_tokens) == (
        "gpt-judge",
        9,
        tokens_in,
        tokens_out,
    )
    with LedgerReader(tmp_path) as reader:  # a fresh read of the out_dir: `interlens status`
        [shown] = run_status(reader)["api_usage"]
        assert (shown["requests"], shown["input_tokens"], shown["output_tokens"]) == (
            9,
            tokens_in,
            tokens_out,
        )
        assert reader.summary()["superseded_results"] == 6  # two replaced results per job
        for job_id, result in fixed.results.items():  # readers of the result see the current one
            stored = reader.result(job_id)
            assert stored is not None and stored["analysis"] == result.analysis
            assert len(stored["conversation"]["sample_metadata"]) == 1

    # Three more rows under a budget the three attempts together spent, though no one attempt did.
    again = conv.rollout(n=6, out_dir=tmp_path, api_budget=APIBudget(tokens=7 * cost))
    assert judge_requests(server) == 9 and again.stopped is not None
    assert again.counts["pending"] == 3 and len(again.results) == 3
    done = conv.rollout(n=6, out_dir=tmp_path, api_budget=APIBudget(tokens=12 * cost + 1))
    assert done.stopped is None and judge_requests(server) == 12
    assert done.failed == [] and len(done.results) == 6
