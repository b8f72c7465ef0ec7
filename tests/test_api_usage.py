"""Usage accounting and prompt caching: every API turn records what the provider reported, the report totals
it per provider, model and mode, and a cost estimate comes only from the prices passed.

The fake provider meters the usage it reports (``reported_usage``, live answers and batch rows alike), so the
totals are compared with what the provider side said, not with what interlens computed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from interlens import Conversation
from interlens._api_participant import APIParticipant
from interlens._exceptions import ConfigurationError
from interlens._usage import summarize
from interlens.scheduler.gateway import BatchPolicy, RetryPolicy
from interlens.testing._fake_provider import FakeProviderServer

FAST = RetryPolicy(initial_s=0.01, max_s=0.05)
QUICK = BatchPolicy(idle_s=0.3, poll_initial_s=0.01, poll_max_s=0.05)

pytestmark = pytest.mark.usefixtures("hermetic_api_env")


def api(name: str, provider: str, model: str, **settings: Any) -> APIParticipant:
    return APIParticipant(name=name, provider=provider, model_id=model, retry=FAST, **settings)


def mixed(turns: int = 5) -> Conversation:
    return Conversation(
        [
            api("pro", "openai", "gpt-test", system_prompt="Argue YES."),
            api("con", "anthropic", "claude-test", system_prompt="Argue NO."),
            api("judge", "openrouter", "vendor/model"),
            api("clerk", "openai", "gpt-batch", batch=True, batch_policy=QUICK),
            api("scribe", "anthropic", "claude-batch", batch=True, batch_policy=QUICK),
        ],
        shared_context="Is a hot dog a sandwich?",
    ).turns(turns)


def reported_totals(server: FakeProviderServer) -> dict[tuple[str, str, str], dict[str, int]]:
    """The fake's own usage reports, normalized the documented way: Anthropic's input_tokens leaves out
    cache reads and writes, OpenAI's prompt_tokens includes its cached_tokens."""
    out: dict[tuple[str, str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for entry in server.reported_usage:
        usage = entry["usage"]
        row = out[(entry["provider"], entry["model"], "batch" if entry["batch"] else "live")]
        row["requests"] += 1
        if entry["provider"] == "anthropic":
            read, write = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
            row["input_tokens"] += usage["input_tokens"] + read + write
            row["output_tokens"] += usage["output_tokens"]
        else:
            read, write = usage["prompt_tokens_details"]["cached_tokens"], 0
            row["input_tokens"] += usage["prompt_tokens"]
            row["output_tokens"] += usage["completion_tokens"]
        row["cache_read_tokens"] += read
        row["cache_write_tokens"] += write
    return {key: dict(value) for key, value in out.items()}


def report_totals(usage: Any) -> dict[tuple[str, str, str], dict[str, int]]:
    fields = ("requests", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")
    return {(u.provider, u.model, u.mode): {f: getattr(u, f) for f in fields} for u in usage.api}


@pytest.mark.parametrize("in_ledger", [True, False])
def test_usage_per_model_equals_what_the_provider_reported(
    server: FakeProviderServer, tmp_path: Path, in_ledger: bool
) -> None:
    report = mixed().rollout(n=3, out_dir=tmp_path if in_ledger else None)
    assert report.failed == []
    usage = report.usage()
    expected = reported_totals(server)
    assert set(expected) == {
        ("openai", "gpt-test", "live"),
        ("anthropic", "claude-test", "live"),
        ("openrouter", "vendor/model", "live"),
        ("openai", "gpt-batch", "batch"),
        ("anthropic", "claude-batch", "batch"),
    }
    assert report_totals(usage) == expected
    assert usage.usd is None and usage.local == []
    assert usage.totals()["requests"] == 3 * 5 == len(server.reported_usage)
    turn = report.results["rollout_0000"].transcript[2]  # con's first turn
    assert turn.metadata["usage"]["mode"] == "live" and turn.metadata["usage"]["provider"] == "anthropic"


def test_a_cost_estimate_only_from_the_prices_passed_with_the_documented_batch_discount(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    report = mixed(turns=5).rollout(n=2, out_dir=tmp_path)
    prices = {"gpt-test": (2.0, 8.0), "gpt-batch": (2.0, 8.0), "claude-batch": (3.0, 15.0, 0.3, 3.75)}
    usage = report.usage(prices=prices)
    rows = {u.model: u for u in usage.api}
    live, batch = rows["gpt-test"], rows["gpt-batch"]
    assert live.usd == pytest.approx((live.input_tokens * 2.0 + live.output_tokens * 8.0) / 1e6)
    assert batch.usd == pytest.approx((batch.input_tokens * 2.0 + batch.output_tokens * 8.0) / 1e6 / 2)
    claude = rows["claude-batch"]
    fresh = claude.input_tokens - claude.cache_read_tokens - claude.cache_write_tokens
    claude_usd = (fresh * 3.0 + claude.cache_read_tokens * 0.3 + claude.cache_write_tokens * 3.75) / 1e6
    assert claude.usd == pytest.approx((claude_usd + claude.output_tokens * 15.0 / 1e6) / 2)
    assert rows["claude-test"].usd is None and rows["vendor/model"].usd is None
    assert usage.unpriced == ["claude-test", "vendor/model"]
    assert usage.usd == pytest.approx(live.usd + batch.usd + claude.usd)
    assert "estimated cost" in str(usage)
    with pytest.raises(ConfigurationError, match=r"prices\['gpt-test'\] must be"):
        report.usage(prices={"gpt-test": (1.0,)})


def test_local_turns_are_counted_per_model() -> None:
    metadata = [
        {"n_tokens": 5, "prompt_tokens": 20, "model": "tiny-qwen", "batched": True},
        {"n_tokens": 7, "prompt_tokens": 30, "model": "tiny-qwen"},
        {"n_tokens": 2, "model": "tiny-llama"},
        {"n_tokens": 3, "finish_reason": "stop"},  # a scripted turn: no model
    ]
    usage = summarize(metadata)
    assert [(u.model, u.turns, u.output_tokens, u.prompt_tokens) for u in usage.local] == [
        ("tiny-llama", 1, 2, 0),
        ("tiny-qwen", 2, 12, 50),
    ]
    assert usage.api == []


def test_interlens_status_shows_the_api_usage(server: FakeProviderServer, tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    mixed().rollout(n=2, out_dir=tmp_path)
    command = [sys.executable, "-m", "interlens", "status", str(tmp_path)]
    env = {**os.environ, "COLUMNS": "200"}
    run = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True, env=env)
    fields = ("requests", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")
    rows = {
        (u["provider"], u["model"], u["mode"]): {f: u[f] for f in fields}
        for u in json.loads(run.stdout)["api_usage"]
    }
    assert rows == reported_totals(server)
    text = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    assert "API usage" in text and "claude-batch" in text
