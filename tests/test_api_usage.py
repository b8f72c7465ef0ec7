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
from interlens._core._exceptions import ConfigurationError
from interlens.participants._api_participant import APIParticipant
from interlens.report._usage import summarize
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


# -- prompt caching


def cached_debate(provider: str, model: str, turns: int = 8, **settings: Any) -> Conversation:
    return Conversation(
        [
            api("pro", provider, model, system_prompt="Argue YES, citing history at length.", **settings),
            api("con", provider, model, system_prompt="Argue NO, with examples.", **settings),
        ],
        shared_context="Is a hot dog a sandwich? Consider every definition of sandwich you know of.",
    ).turns(turns)


def test_anthropic_breakpoints_are_sent_and_later_turns_read_the_cache(server: FakeProviderServer) -> None:
    conv = cached_debate("anthropic", "claude-test")
    conv.run()
    bodies = [r.json for r in server.requests if r.path == "/v1/messages"]
    marker = {"type": "ephemeral"}
    for body in bodies:
        assert body["system"][0]["cache_control"] == marker  # the system block
        last = body["messages"][-1]["content"]
        assert isinstance(last, list) and last[-1]["cache_control"] == marker  # the last message
        earlier = [m for m in body["messages"][:-1] if not isinstance(m["content"], str)]
        assert earlier == []  # two breakpoints only
    turns = list(conv.transcript)[1:]
    usages = [m.metadata["usage"] for m in turns]
    for k, usage in enumerate(usages):
        reported = server.reported_usage[k]["usage"]
        assert usage["cache_read_tokens"] == reported["cache_read_input_tokens"]
        assert usage["cache_write_tokens"] == reported["cache_creation_input_tokens"]
        if k < 2:  # each speaker's first turn writes its prefix, reads nothing
            assert usage["cache_read_tokens"] == 0 and usage["cache_write_tokens"] == usage["input_tokens"]
        else:  # from its second turn on, its whole previous prompt is read from the cache, the rest written
            assert usage["cache_read_tokens"] == usages[k - 2]["input_tokens"] > 0
            assert usage["cache_write_tokens"] == usage["input_tokens"] - usage["cache_read_tokens"]
    assert all(u["cache_read_tokens"] > u["input_tokens"] / 2 for u in usages[4:])  # most, as history grows


def test_prompt_cache_false_sends_no_breakpoint_and_reads_nothing(server: FakeProviderServer) -> None:
    conv = cached_debate("anthropic", "claude-test", turns=4, prompt_cache=False)
    conv.run()
    bodies = [r.json for r in server.requests if r.path == "/v1/messages"]
    assert all(isinstance(b["system"], str) for b in bodies)
    assert all(isinstance(m["content"], str) for b in bodies for m in b["messages"])
    assert all(m.metadata["usage"]["cache_read_tokens"] == 0 for m in list(conv.transcript)[1:])


def test_openai_records_cached_tokens_of_its_automatic_cache(server: FakeProviderServer) -> None:
    conv = cached_debate("openai", "gpt-test", turns=6)
    conv.run()
    usages = [m.metadata["usage"] for m in list(conv.transcript)[1:]]
    reported = [e["usage"]["prompt_tokens_details"]["cached_tokens"] for e in server.reported_usage]
    assert [u["cache_read_tokens"] for u in usages] == reported
    assert reported[:2] == [0, 0] and all(r > 0 for r in reported[2:])
    assert all(u["cache_write_tokens"] == 0 for u in usages)
    bodies = [r.json["messages"] for r in server.requests if r.path == "/v1/chat/completions"]
    for earlier, later in zip(bodies, bodies[2:], strict=False):  # a speaker's prompts are prefix-stable
        assert later[: len(earlier)] == earlier


def test_the_fake_refuses_cache_markers_anthropic_refuses() -> None:
    from interlens.testing._fake_provider_requests import validate_message

    def body(*markers: Any) -> dict[str, Any]:
        blocks = [{"type": "text", "text": f"part {i}", "cache_control": m} for i, m in enumerate(markers)]
        return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": blocks}]}

    ok = {"type": "ephemeral"}
    assert validate_message(body(ok, {"type": "ephemeral", "ttl": "1h"})) is None
    assert validate_message(body(*[ok] * 4)) is None
    assert "A maximum of 4 blocks" in str(validate_message(body(*[ok] * 5)))
    assert "Input should be 'ephemeral'" in str(validate_message(body({"type": "persistent"})))
    assert "ttl" in str(validate_message(body({"type": "ephemeral", "ttl": "2d"})))
