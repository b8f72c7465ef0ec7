"""A key that leaks into an error, a log line or a result is redacted or refused, and only its job fails.

The planted key is the value of a credential-looking environment variable. Wherever it shows up in text
interlens keeps (an error message, a traceback, a log line) it becomes ``[redacted:VARNAME]`` and the job
fails like any other: the other jobs finish and the run completes. Values a job hands back for storage (a
conversation, an analysis) that contain it are refused, which fails that job only. A key in the recipe
itself (a prompt) is refused before the run starts. Every file the run leaves behind is searched.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from interlens import Conversation, LedgerError, ScriptedParticipant, dataset_field, register_analyzer
from interlens.participants._api_participant import APIParticipant
from interlens.scheduler import ErrorInfo
from interlens.scheduler.gateway import RetryPolicy
from interlens.store import LedgerReader
from interlens.testing import FakeProviderServer

KEY = "sk-planted-REDACT-ME-7d3e91b04c"
MARK = "[redacted:OPENAI_API_KEY]"
TOPICS = [{"topic": t} for t in ("tabs", "spaces", "boom", "both")]


@pytest.fixture
def api_key() -> str:  # the key the `server` fixture puts in OPENAI_API_KEY & co.
    return KEY


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    return KEY


def assert_nowhere_on_disk(out_dir: Path) -> None:
    files = [p for p in out_dir.rglob("*") if p.is_file()]
    assert any(p.name == "ledger.sqlite" for p in files)
    for path in files:
        assert KEY.encode() not in path.read_bytes(), path


def last_run_status(out_dir: Path) -> str:
    with LedgerReader(out_dir) as reader:
        return str(reader.runs()[-1]["status"])


def reply(view: Any) -> str:
    if "boom" in view.messages[0].content:
        # What a misconfigured client library might say: the key, verbatim, in the exception.
        raise PermissionError(f"authentication failed for api_key={os.environ['OPENAI_API_KEY']!r}")
    return f"{view.speaker} says hi"


def debate() -> Conversation:
    return (
        Conversation(
            participants=[ScriptedParticipant("a", reply), ScriptedParticipant("b", reply)],
            shared_context=dataset_field("topic"),
        )
        .turns(2)
        .data(TOPICS)
    )


@pytest.mark.parametrize("on_disk", [True, False], ids=["out_dir", "in_memory"])
def test_a_key_in_a_job_error_is_redacted_and_the_other_jobs_finish(
    planted: str, tmp_path: Path, on_disk: bool
) -> None:
    out_dir = tmp_path / "run" if on_disk else None
    report = debate().rollout(out_dir=out_dir)
    assert report.failed == ["row_00002"]
    assert sorted(report.results) == ["row_00000", "row_00001", "row_00002", "row_00003"]
    error = report.results["row_00002"].error
    assert error is not None and error.type == "PermissionError"
    assert error.message == f"authentication failed for api_key='{MARK}'"
    assert MARK in error.traceback and "PermissionError" in error.traceback
    assert planted not in error.message and planted not in error.traceback
    for job_id in ("row_00000", "row_00001", "row_00003"):
        assert report.results[job_id].error is None
        assert report.results[job_id].transcript[-1].content == "b says hi"
    if out_dir is not None:
        assert last_run_status(out_dir) == "completed"
        assert_nowhere_on_disk(out_dir)


def analyze_leaky(conv: Conversation) -> dict[str, Any]:
    if conv.row["topic"] == "boom":
        return {"debug": os.environ["OPENAI_API_KEY"]}
    return {"turns": len(conv.transcript)}


register_analyzer("secrets_leaky", analyze_leaky)


@pytest.mark.parametrize("on_disk", [True, False], ids=["out_dir", "in_memory"])
def test_an_analysis_holding_a_key_fails_only_its_job(planted: str, tmp_path: Path, on_disk: bool) -> None:
    conv = (
        Conversation(
            participants=[ScriptedParticipant("a", ["x", "y"])], shared_context=dataset_field("topic")
        )
        .turns(2)
        .data(TOPICS)
        .analyzer("secrets_leaky")
    )
    out_dir = tmp_path / "run" if on_disk else None
    report = conv.rollout(out_dir=out_dir)
    assert report.failed == ["row_00002"]
    assert {jid: r.analysis for jid, r in report.results.items() if r.error is None} == {
        "row_00000": {"turns": 3},
        "row_00001": {"turns": 3},
        "row_00003": {"turns": 3},
    }
    error = report.results["row_00002"].error
    assert error is not None and planted not in error.message + error.traceback
    if out_dir is not None:  # the ledger refuses it, naming the variable, never the value
        assert "OPENAI_API_KEY" in error.message and "analysis" in error.message
        assert last_run_status(out_dir) == "completed"
        assert_nowhere_on_disk(out_dir)


def test_a_key_in_the_prompt_is_refused_before_the_run_starts(planted: str, tmp_path: Path) -> None:
    conv = Conversation(
        participants=[ScriptedParticipant("a", ["x"])], shared_context=f"use the key {planted}"
    ).turns(1)
    with pytest.raises(LedgerError, match="OPENAI_API_KEY") as info:
        conv.rollout(n=2, out_dir=tmp_path)
    assert planted not in str(info.value)
    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == reader.counts()["running"] == 0 and reader.runs() == []
    assert_nowhere_on_disk(tmp_path)


@pytest.mark.parametrize("on_disk", [True, False], ids=["out_dir", "in_memory"])
def test_a_key_in_a_lineup_name_is_refused_without_printing_it(
    planted: str, tmp_path: Path, on_disk: bool
) -> None:
    """The refusal names the record it refused, and that name (a lineup, a job id) holds the key itself."""
    conv = Conversation(participants=[ScriptedParticipant("a", ["x"])]).turns(1).name(planted)
    if on_disk:
        with pytest.raises(LedgerError, match="OPENAI_API_KEY") as info:
            conv.rollout(n=1, out_dir=tmp_path, progress=False)
        assert planted not in str(info.value) and MARK in str(info.value)
        assert_nowhere_on_disk(tmp_path)
    else:
        report = conv.rollout(n=1, progress=False)
        (result,) = report.results.values()
        assert result.error is not None and "OPENAI_API_KEY" in result.error.message
        assert planted not in result.error.message and planted not in result.error.traceback


# -- through the API gateway: the provider's answer echoes the key (a proxy, a debugging endpoint...)

FAST = RetryPolicy(initial_s=0.01, max_s=0.05)


def api_debate() -> Conversation:
    return Conversation(
        [APIParticipant(name="a", provider="openai", model_id="gpt-test", retry=FAST)],
        shared_context="Is a hot dog a sandwich?",
    ).turns(2)


@pytest.mark.parametrize("on_disk", [True, False], ids=["out_dir", "in_memory"])
def test_a_provider_error_echoing_the_key_fails_one_job_redacted(
    server: FakeProviderServer, tmp_path: Path, on_disk: bool
) -> None:
    server.fail_next(1, status=401, message=f"Incorrect API key provided: {KEY}.", provider="openai")
    out_dir = tmp_path / "run" if on_disk else None
    report = api_debate().rollout(n=4, out_dir=out_dir)
    assert len(report.failed) == 1 and len(report.results) == 4
    error = report.results[report.failed[0]].error
    assert error is not None and f"Incorrect API key provided: {MARK}." in error.message
    assert KEY not in error.message + error.traceback and MARK in error.traceback
    done = [r for r in report.results.values() if r.error is None]
    assert len(done) == 3 and all(len(r.transcript) == 3 for r in done)
    if out_dir is not None:
        assert last_run_status(out_dir) == "completed"
        assert_nowhere_on_disk(out_dir)


def test_a_log_line_carrying_the_key_is_redacted(
    server: FakeProviderServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server.fail_next(1, status=429, retry_after=0.01, message=f"slow down, {KEY}", provider="openai")
    report = api_debate().rollout(n=2, out_dir=tmp_path)
    assert report.failed == []
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 1 and f"slow down, {MARK}" in retries[0].getMessage()
    assert KEY not in caplog.text
    assert_nowhere_on_disk(tmp_path)


def test_a_logged_exception_and_its_arguments_are_redacted(
    planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("interlens.gateway")
    caplog.set_level(logging.INFO, logger="interlens.gateway")
    try:
        raise RuntimeError(f"bad key {planted}")
    except RuntimeError:
        log.exception("call failed with %s (%r)", planted, {"key": planted})
    record = caplog.records[-1]
    assert record.getMessage() == f"call failed with {MARK} ({{'key': '{MARK}'}})"
    assert f"RuntimeError: bad key {MARK}" in caplog.text and planted not in caplog.text


# -- the boundary itself: where an exception becomes text (in a worker process as in the parent)


def test_error_info_redacts_message_and_traceback_before_it_travels(planted: str) -> None:
    try:
        try:
            raise KeyError(planted)
        except KeyError as inner:
            raise RuntimeError(f"request to https://api/?key={planted} failed") from inner
    except RuntimeError as exc:
        info = ErrorInfo.from_exception(exc)
    assert info.message == f"request to https://api/?key={MARK} failed"
    assert info.traceback.count(MARK) == 2  # the cause's message too
    assert planted.encode() not in pickle.dumps(info)  # what crosses a worker's pipe


def _worker_environment(conv: Conversation) -> dict[str, Any]:
    """What a worker process's environment holds (names and a comparison, never a credential's value)."""
    return {
        "pid": os.getpid(),
        "keys": sorted(n for n in os.environ if n.endswith("_API_KEY")),
        "hub": os.environ.get("HF_TOKEN") == HUB_TOKEN,
    }


HUB_TOKEN = "hf_planted-HUB-0123456789abcdef"


def test_local_worker_processes_get_no_api_key_but_keep_the_hub_token(
    planted: str, monkeypatch: pytest.MonkeyPatch, qwen2_path: str, tmp_path: Path
) -> None:
    """API calls run in the parent only: a worker process has no use for a key, and a job's code there (an
    analyzer, a worker_init) could leak it. The Hub token stays: workers load gated weights with it."""
    from interlens import AutoModelParticipant

    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-planted-0123456789")
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    speaker = AutoModelParticipant.from_pretrained(qwen2_path, name="a", max_new_tokens=2)
    conv = Conversation([speaker], shared_context="hi").turns(1).analyzer(_worker_environment)
    report = conv.rollout(n=2, devices=["cpu", "cpu"], out_dir=tmp_path, progress=False)
    assert report.failed == []
    seen = [r.analysis for r in report.results.values()]
    assert all(a["pid"] != os.getpid() for a in seen)  # it ran in the worker processes
    assert [a["keys"] for a in seen] == [[], []]
    assert all(a["hub"] for a in seen)
    assert os.environ["OPENAI_API_KEY"] == planted  # the parent keeps its own
