"""The API spend guard: a run stops sending once its budget is reached, leaves the rest pending, and a rerun
with a larger budget finishes it without sending any request twice; batches are admitted whole or not at all.

Against the loopback fake provider (which meters the usage it reports), with a real ledger in ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from interlens import APIBudget, Conversation, ScriptedParticipant, dataset_field
from interlens._core._exceptions import ConfigurationError
from interlens._core._view import GenerationOptions
from interlens.cli._runs import run_status
from interlens.participants._api_participant import APIParticipant
from interlens.rollouts._api_budget import estimate_tokens
from interlens.scheduler.gateway import BatchPolicy, RetryPolicy
from interlens.store import LedgerReader
from interlens.testing._fake_provider import FakeProviderServer

KEY = "sk-planted-BUDGET-1a2b3c4d5e"
FAST = RetryPolicy(initial_s=0.01, max_s=0.05)
QUICK = BatchPolicy(idle_s=0.3, poll_initial_s=0.01, poll_max_s=0.05)

pytestmark = pytest.mark.usefixtures("hermetic_api_env")


@pytest.fixture
def api_key() -> str:
    return KEY


def rows(n: int) -> list[dict[str, str]]:
    return [{"q": f"question number {i:02d}"} for i in range(n)]


def spent_tokens(server: FakeProviderServer) -> list[int]:
    return [e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"] for e in server.reported_usage]


def chat_bodies(server: FakeProviderServer) -> list[str]:
    return [json.dumps(r.json, sort_keys=True) for r in server.requests if r.path == "/v1/chat/completions"]


def pending(out: Path) -> list[str]:
    with LedgerReader(out) as reader:
        return reader.job_ids(state="pending")


def test_a_budget_of_k_requests_stops_after_about_k_and_a_rerun_finishes_without_resending(
    server: FakeProviderServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server.set_latency(0.02)
    flight = 3
    ask = APIParticipant(name="a", provider="openai", model_id="gpt-test", retry=FAST, max_in_flight=flight)
    conv = Conversation([ask], shared_context=dataset_field("q")).turns(1).data(rows(12))
    probe = conv.rollout(n=1)  # one request's worth (every row's prompt and reply have as many tokens)
    cost = spent_tokens(server)[0]
    server.reset_meters()

    k = 5
    report = conv.rollout(out_dir=tmp_path, api_budget=APIBudget(tokens=k * cost))
    sent = len(chat_bodies(server))
    assert k <= sent <= k + flight - 1  # stopped once k were spent; at most the ones in flight went on
    assert set(spent_tokens(server)) == {cost} and probe.failed == []
    assert report.failed == [] and len(report.results) == sent  # done: every request that was sent
    assert report.stopped is not None and f"of {k * cost:,} tokens" in report.stopped
    assert report.counts["pending"] == 12 - sent and len(pending(tmp_path)) == 12 - sent
    assert any(
        "stopped early" in r.getMessage() and "larger api_budget" in r.getMessage() for r in caplog.records
    )
    assert report.usage().totals()["requests"] == sent
    assert f"pending={12 - sent} (stopped early)" in repr(report)
    with LedgerReader(tmp_path) as reader:
        assert reader.runs()[-1]["status"] == "stopped"
    shown = subprocess.run(
        [sys.executable, "-m", "interlens", "status", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=120,
    )
    assert "stopped early" in shown.stdout and "rerun the same call to continue" in shown.stdout

    again = conv.rollout(out_dir=tmp_path, api_budget=APIBudget(tokens=k * cost))  # the ledger's spend counts
    assert len(chat_bodies(server)) == sent and again.stopped is not None

    finished = conv.rollout(out_dir=tmp_path, api_budget=APIBudget(tokens=100 * cost))
    bodies = chat_bodies(server)
    assert finished.stopped is None and finished.failed == [] and pending(tmp_path) == []
    with LedgerReader(tmp_path) as reader:
        assert [run["status"] for run in reader.runs()] == ["stopped", "stopped", "completed"]
    assert len(bodies) == 12 == len(set(bodies))  # every row's request sent once, over the three runs
    assert len(finished.results) == 12

    assert KEY not in caplog.text and KEY not in (report.stopped or "")
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert KEY.encode() not in stored


def test_a_job_stopped_mid_conversation_stays_pending_with_its_turns_and_resumes_there(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    speaker = APIParticipant(name="a", provider="openai", model_id="gpt-test", retry=FAST, max_in_flight=1)
    host = ScriptedParticipant("host", ["Go on."])
    conv = Conversation([speaker, host], shared_context=dataset_field("q")).turns(3).data(rows(3))
    first = conv.rollout(out_dir=tmp_path, api_budget=APIBudget(tokens=1))  # one request, then nothing
    assert len(chat_bodies(server)) == 1 and first.failed == [] and len(first.results) == 0
    assert sorted(pending(tmp_path)) == ["row_00000", "row_00001", "row_00002"]
    with LedgerReader(tmp_path) as reader:
        committed = {job: len(reader.turns(job)) for job in reader.job_ids()}
    assert sorted(committed.values()) == [0, 0, 2]  # the one that was answered kept its turn and the host's

    done = conv.rollout(out_dir=tmp_path, api_budget=APIBudget(tokens=10_000))
    bodies = chat_bodies(server)
    assert done.failed == [] and len(done.results) == 3 and pending(tmp_path) == []
    assert len(bodies) == 3 * 2 == len(set(bodies))  # no request sent twice
    for result in done.results.values():
        assert [m.author for m in result.transcript[1:]] == ["a", "host", "a"]


def test_batch_mode_submits_only_batches_within_the_budget(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    policy = BatchPolicy(max_rows=3, idle_s=0.3, poll_initial_s=0.01, poll_max_s=0.05)
    speaker = APIParticipant(
        name="a", provider="openai", model_id="gpt-test", retry=FAST, batch=True, batch_policy=policy
    )
    conv = Conversation([speaker], shared_context=dataset_field("q")).turns(1).data(rows(6))
    request = speaker.request(
        conv.data(None).for_row(rows(1)[0], index=0, seed=0).view(speaker), GenerationOptions()
    )
    one = sum(estimate_tokens(request))  # the guard's bound for one row (every row has as many bytes)
    budget = APIBudget(tokens=3 * one + one // 2)  # room for one batch of three rows, not for two

    first = conv.rollout(out_dir=tmp_path, api_budget=budget)
    assert server.batch_count("openai") == 1 and first.stopped is not None
    assert len(first.results) == 3 and first.failed == [] and len(pending(tmp_path)) == 3
    assert sum(spent_tokens(server)) <= budget.tokens  # a batch is admitted whole, within the budget

    done = conv.rollout(out_dir=tmp_path, api_budget=APIBudget(tokens=100 * one))
    assert server.batch_count("openai") == 2 and done.stopped is None and pending(tmp_path) == []
    custom = [cid for b in server.batches.values() for cid in b.custom_ids]
    assert len(custom) == 6  # three rows per batch, none sent twice
    assert len(done.results) == 6 and done.failed == []


def test_usd_budgets_need_prices_and_budgets_apply_ambiently(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    ask = APIParticipant(name="a", provider="openai", model_id="gpt-test", retry=FAST, max_in_flight=1)
    conv = Conversation([ask], shared_context=dataset_field("q")).turns(1).data(rows(4))
    with pytest.raises(ConfigurationError, match=r"needs a price for every API model.*'gpt-test'"):
        conv.rollout(out_dir=tmp_path, api_budget=APIBudget(usd=1.0))
    assert chat_bodies(server) == []
    with APIBudget(usd=1e-9, prices={"gpt-test": (1.0, 1.0)}):  # less than one request costs
        report = conv.rollout(out_dir=tmp_path)
    assert len(chat_bodies(server)) == 1 and report.counts["pending"] == 3
    assert report.stopped is not None and "$" in report.stopped
    with pytest.raises(ConfigurationError, match="tokens=, usd= or both"):
        APIBudget()
    with pytest.raises(ConfigurationError, match="must be an APIBudget"):
        conv.rollout(api_budget=5)  # type: ignore[arg-type]


def judge_analyzer(conv: Conversation) -> dict[str, str]:
    """An LLM judge: one hosted sample per finished conversation (no turn records it)."""
    return {"verdict": conv.sample("judge", "Was that a good answer? One word.").content}


def judged(analyzer: Any) -> Conversation:
    """Six data rows, a scripted host that answers, and ``analyzer`` judging with an API participant."""
    judge = APIParticipant(name="judge", provider="openai", model_id="gpt-judge", retry=FAST)
    host = ScriptedParticipant("host", ["An answer."])
    return (
        Conversation([host, judge], shared_context=dataset_field("q"))
        .turns(1)  # only the host speaks: every API request is the analyzer's
        .data(rows(6))
        .analyzer(analyzer)
    )


def test_an_analyzers_api_samples_count_in_usage_and_in_the_budget_of_later_runs(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    conv = judged(judge_analyzer)
    first = conv.rollout(n=3, out_dir=tmp_path)
    assert first.failed == [] and len(chat_bodies(server)) == 3
    cost = spent_tokens(server)[0]
    assert set(spent_tokens(server)) == {cost}
    assert all(r.analysis["verdict"] for r in first.results.values())
    [row] = first.usage().api  # read from the ledger: the samples were stored with the results
    assert (row.model, row.requests) == ("gpt-judge", 3)
    assert row.input_tokens + row.output_tokens == 3 * cost
    live = judged(judge_analyzer).data(rows(2)).rollout()
    assert live.usage().totals()["requests"] == 2  # no out_dir: from the results in memory

    # Three more rows under a budget the first run's judge already spent: nothing more is sent.
    again = conv.rollout(n=6, out_dir=tmp_path, api_budget=APIBudget(tokens=3 * cost))
    assert len(chat_bodies(server)) == 3 + 2 and again.stopped is not None
    assert again.counts["pending"] == 3 and len(again.results) == 3


class JudgeBroke(RuntimeError):
    pass


def flaky_judge(conv: Conversation) -> dict[str, str]:
    """The judge, failing after its (paid) sample while ``JUDGE_FAILS`` is set."""
    verdict = judge_analyzer(conv)
    if os.environ.get("JUDGE_FAILS"):
        raise JudgeBroke("the judge's answer could not be parsed")
    return verdict


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
    """The analyzer fails after its sample (the job fails with its conversation and the samples' usage kept)
    and a rerun into the same out_dir redoes only the analysis, whose result replaces the kept one. Every
    attempt's requests were paid for, so ``usage()``, ``interlens status`` and later runs' spend guard count
    them all (the ledger keeps replaced results' states: ``superseded_results``)."""
    conv = judged(flaky_judge)
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
