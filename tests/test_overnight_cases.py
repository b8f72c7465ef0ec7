"""The overnight cases a tester found (issue 38): each a run left alone that must finish or stop, say what is
wrong, and store only what was generated."""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from crash_testkit import exited, lines

from interlens import (
    ConfigurationError,
    Conversation,
    DataSourceError,
    GenerationError,
    LedgerError,
    Message,
    ScriptedParticipant,
    TokenBudget,
    dataset_field,
)
from interlens.store import LedgerReader


def test_out_dir_with_a_tilde_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    conv = Conversation(participants=[ScriptedParticipant("a", ["hi"])]).turns(1)
    report = conv.rollout(n=2, out_dir="~/runs/x", progress=False)
    assert report.counts["done"] == 2
    assert (home / "runs" / "x" / "ledger.sqlite").is_file()
    assert not (cwd / "~").exists()
    with LedgerReader("~/runs/x") as reader:
        assert len(reader.job_ids()) == 2


# ------------------------------------------------------------------------------------------ data rows


def echo_prompt() -> Conversation:
    """One turn that repeats its shared context, so a test reads what the prompt became."""
    return Conversation(
        participants=[ScriptedParticipant("a", lambda view: f"got: {view.messages[0].content}")],
        shared_context=("Q: ", dataset_field("q")),
    ).turns(1)


def test_a_dataframe_is_read_as_its_records(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"q": ["one", "two", "three"], "label": [1.0, float("nan"), 3.0]})
    report = echo_prompt().data(frame).rollout(out_dir=tmp_path, progress=False)
    assert report.failed == [] and report.counts["done"] == 3
    said = {job: r.transcript[-1].content for job, r in report.results.items()}
    assert said == {"row_00000": "got: Q: one", "row_00001": "got: Q: two", "row_00002": "got: Q: three"}
    # the unused column's missing label is stored faithfully, as JSON's null
    assert report.results["row_00001"].conversation.row == {"q": "two", "label": None}


@pytest.mark.parametrize("missing", [None, float("nan")], ids=["None", "NaN"])
def test_a_missing_cell_used_in_a_template_fails_its_row_before_any_turn(
    tmp_path: Path, missing: Any
) -> None:
    rows = [{"q": "one"}, {"q": missing}, {"q": "three"}]
    report = echo_prompt().data(rows).rollout(out_dir=tmp_path, progress=False)
    assert report.failed == ["row_00001"]
    error = report.results["row_00001"].error
    assert error is not None and error.type == "TemplateError"
    assert "'q'" in error.message and "missing value" in error.message and "dropna" in error.message
    with LedgerReader(tmp_path) as reader:
        assert reader.turn_records("row_00001") == []  # no turn was run (nor paid for) on it


def test_an_empty_cell_in_a_template_warns_once(tmp_path: Path) -> None:
    rows = [{"q": ""}, {"q": "two"}, {"q": " "}]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # what a user's script shows: each warning once per place
        report = echo_prompt().data(rows).rollout(out_dir=tmp_path, progress=False)
    assert report.failed == []
    empty = [str(w.message) for w in record if "empty in some rows" in str(w.message)]
    assert len(empty) == 1 and "dataset_field('q')" in empty[0]


@pytest.mark.parametrize("empty", [[], "iterator"], ids=["list", "iterator"])
def test_empty_data_warns_that_no_job_runs(tmp_path: Path, empty: Any) -> None:
    data = iter([]) if empty == "iterator" else empty
    with pytest.warns(UserWarning, match="has no rows, so no job runs"):
        report = echo_prompt().data(data).rollout(out_dir=tmp_path, progress=False)
    assert report.counts["total"] == 0


def test_a_nan_in_an_unused_column_is_stored_as_null_and_the_job_succeeds(tmp_path: Path) -> None:
    rows = [{"q": "one", "label": float("nan"), "score": float("inf")}]
    report = echo_prompt().data(rows).rollout(out_dir=tmp_path, progress=False)
    assert report.failed == []
    assert report.results["row_00000"].conversation.row == {"q": "one", "label": None, "score": "inf"}


def test_a_lone_surrogate_fails_only_its_row_named(tmp_path: Path) -> None:
    rows = [{"q": "one"}, {"q": "bro\udcc3ken", "other": 1}, {"q": "three"}]
    report = echo_prompt().data(rows).rollout(out_dir=tmp_path, progress=False)
    assert report.failed == ["row_00001"] and report.counts["done"] == 2
    error = report.results["row_00001"].error
    assert error is not None and "data row 1, column 'q'" in error.message and "surrogate" in error.message


def test_a_lone_surrogate_in_construction_text_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="shared_context: it holds a lone surrogate"):
        Conversation(participants=[ScriptedParticipant("a", ["hi"])], shared_context="bad \udcc3")
    with pytest.raises(ConfigurationError, match=r"\.name\(\): it holds a lone surrogate"):
        Conversation(participants=[ScriptedParticipant("a", ["hi"])]).name("x\udcc3")


def test_a_data_source_failing_mid_stream_names_the_row_and_keeps_the_jobs_done(tmp_path: Path) -> None:
    def rows(fail_at: int | None) -> Callable[[], Iterator[dict[str, str]]]:
        def read() -> Iterator[dict[str, str]]:
            for i in range(40):
                if i == fail_at:
                    raise ConnectionError("the dataset server went away")
                yield {"q": f"q{i}"}

        return read

    with pytest.raises(DataSourceError, match="failed at row 30") as info:
        echo_prompt().data(rows(30)).rollout(
            out_dir=tmp_path, progress=False, max_concurrency=2, max_batch_size=1
        )
    assert "ConnectionError: the dataset server went away" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionError)
    with LedgerReader(tmp_path) as reader:
        done = reader.counts()["done"]
    assert done >= 20  # the rows pulled long before the failure ran to the end, and are kept
    report = (
        echo_prompt()
        .data(rows(None))
        .rollout(out_dir=tmp_path, progress=False, max_concurrency=2, max_batch_size=1)
    )
    assert len(report.skipped) == done and report.counts["done"] == 40 - done  # the rerun resumes them


def test_a_seed_whose_last_job_passes_64_bits_is_refused_before_the_run(tmp_path: Path) -> None:
    conv = Conversation(participants=[ScriptedParticipant("a", ["hi"])]).turns(1)
    with pytest.raises(ConfigurationError, match=r"job 2 would draw from seed .* Pass a seed of at most"):
        conv.rollout(n=3, out_dir=tmp_path, seed=2**63 - 1 - 1, progress=False)
    assert conv.rollout(n=3, seed=2**63 - 3, progress=False).counts["done"] == 3


# ------------------------------------------------------------------------------------------ analyzers


def tampering(conv: Conversation) -> dict[str, int]:
    conv.transcript[-1].content = "TAMPERED"
    conv.transcript[-1].metadata["n_tokens"] = 999
    conv.transcript[-1].metadata.setdefault("nested", {})["x"] = 1
    conv.transcript.append(Message("moderator", "a note the analyzer adds"))
    return {"seen": len(conv.transcript)}


def test_an_analyzer_cannot_rewrite_what_was_generated(tmp_path: Path) -> None:
    conv = Conversation(participants=[ScriptedParticipant("a", ["first", "second"])]).turns(2)
    report = conv.analyzer(tampering).rollout(n=2, out_dir=tmp_path, progress=False)
    assert report.failed == []
    for result in report.results.values():
        assert result.analysis == {"seen": 3}
        assert result.transcript is not None
        contents = [m.content for m in result.transcript]
        assert contents == ["first", "second", "a note the analyzer adds"]
        assert "nested" not in result.transcript[1].metadata
        assert result.tokens_generated == sum(m.metadata.get("n_tokens", 0) for m in result.transcript[:2])
    show = subprocess.run(
        [sys.executable, "-m", "interlens", "show", str(tmp_path), "rollout_0000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "TAMPERED" not in show.stdout and "second" in show.stdout


# ------------------------------------------------------------------------------------------ no progress


def test_a_conversation_bounded_only_by_tokens_whose_turns_say_nothing_fails_instead_of_looping(
    tmp_path: Path,
) -> None:
    silent = ScriptedParticipant("a", lambda view: "")  # honest: 0 tokens a turn
    conv = Conversation(participants=[silent]).turns(None).run_until(TokenBudget(per_conversation=50))
    report = conv.rollout(n=2, out_dir=tmp_path, progress=False)
    assert sorted(report.failed) == ["rollout_0000", "rollout_0001"]
    error = report.results["rollout_0000"].error
    assert error is not None and error.type == "GenerationError" and "makes no progress" in error.message
    assert ".turns(n)" in error.message
    with LedgerReader(tmp_path) as reader:
        assert len(reader.turn_records("rollout_0000")) == 16
    with pytest.raises(GenerationError, match="its last 16 turns generated no token"):
        conv.run()


def test_empty_turns_under_a_turn_limit_are_just_turns() -> None:
    conv = Conversation(participants=[ScriptedParticipant("a", lambda view: "")]).turns(40)
    assert len(conv.run()) == 40


def exits_on_row_1(view: Any) -> str:
    if "row 1" in view.messages[0].content:
        sys.exit(2)
    return "fine"


def test_a_participant_raising_system_exit_fails_only_its_job(tmp_path: Path) -> None:
    conv = (
        Conversation(
            participants=[ScriptedParticipant("a", exits_on_row_1)],
            shared_context=("row ", dataset_field("i")),
        )
        .turns(1)
        .data([{"i": i} for i in range(3)])
    )
    report = conv.rollout(out_dir=tmp_path, progress=False)
    assert report.failed == ["row_00001"] and report.counts["done"] == 2
    error = report.results["row_00001"].error
    assert error is not None and error.type == "GenerationError" and "SystemExit(2)" in error.message
    with LedgerReader(tmp_path) as reader:
        assert reader.runs()[-1]["status"] == "completed"


# ------------------------------------------------------------------------------------------ a full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only: CI runs as root; elsewhere the test skips)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip()}): the full-disk test needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_said_and_a_rerun_after_freeing_space_resumes(small_disk: Path) -> None:
    conv = Conversation(participants=[ScriptedParticipant("a", lambda view: "word " * 400)]).turns(2)
    out = small_disk / "run"
    with pytest.raises(LedgerError, match="the disk holding the ledger is full") as info:
        conv.rollout(n=400, out_dir=out, progress=False)
    assert "occurs twice" not in str(info.value) and "rerun into the same out_dir" in str(info.value)
    with LedgerReader(out) as reader:
        done = reader.counts()["done"]
    assert 0 < done < 400  # what was committed before the disk filled is kept
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space freed
    report = conv.rollout(n=400, out_dir=out, progress=False)
    assert len(report.skipped) == done and report.counts["done"] == 400 - done


# ------------------------------------------------------------------------------------------ hangs

HANG_CHILD = Path(__file__).parent / "scripts" / "hang_child.py"


def hang_child(out: Path, where: str, *limit: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HANG_CHILD), str(out), where, *limit],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("where", ["analyzer", "participant"])
def test_a_time_limit_fails_the_hung_job_and_the_run_finishes(tmp_path: Path, where: str) -> None:
    proc = hang_child(tmp_path, where, "3")
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "FINISHED ['row_00003']" in stdout
    with LedgerReader(tmp_path) as reader:
        job = reader.job("row_00003")
        assert reader.counts()["done"] == 5 and job is not None and job.error_message is not None
    limit = "analyzer_timeout=3.0 s" if where == "analyzer" else "turn_timeout=3.0 s"
    assert limit in job.error_message


@pytest.mark.parametrize("where", ["analyzer", "participant"])
def test_one_ctrl_c_stops_a_run_whose_user_code_hangs(tmp_path: Path, where: str) -> None:
    """No limit set: the blocked call runs in a thread nothing can kill, and the run stops waiting for it at
    the first Ctrl-C, ends its ledger run as interrupted, and the process exits."""
    proc = hang_child(tmp_path, where)
    try:
        output = lines(proc)
        assert output.get(timeout=120) == "HUNG"
        proc.send_signal(signal.SIGINT)
        assert exited(proc.pid, timeout=30), "one Ctrl-C did not stop the run"
        assert proc.wait(timeout=5) != 0
    finally:
        proc.kill()
        proc.wait()
    with LedgerReader(tmp_path) as reader:
        assert reader.runs()[-1]["status"] == "interrupted"
        job = reader.job("row_00003")
        assert job is not None and job.state != "done"


def test_an_endpoint_that_is_down_is_named_in_every_failed_job() -> None:
    import socket

    from interlens import APIParticipant, RetryPolicy

    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    down = APIParticipant(
        name="a",
        provider="openai",
        model_id="gpt-test",
        base_url=url,
        auth=False,
        retry=RetryPolicy(initial_s=0.01, max_s=0.02, max_attempts=2),
    )
    report = Conversation([down], shared_context="hi").turns(1).rollout(n=2, progress=False)
    assert sorted(report.failed) == ["rollout_0000", "rollout_0001"]
    for result in report.results.values():
        assert result.error is not None and f"No answer came from {url}" in result.error.message
        assert "OPENAI_BASE_URL" in result.error.message
