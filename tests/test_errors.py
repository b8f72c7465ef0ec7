"""Errors that help (issue #9): bad input is refused early, by an InterlensError naming argument and fix.

Every refusal here is checked three ways: the class (an ``InterlensError``, and the builtin a Python user
would catch), the message (it names the call or the argument and says what to write instead), and that
nothing was left half-done (no job ran, no ledger or directory was created, a file was left untouched).
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import sqlite3
from pathlib import Path

import pytest

import interlens
import interlens.rollouts._analyzers
from interlens import (
    AnalyzerError,
    APIParticipant,
    AutoModelParticipant,
    ConfigurationError,
    ConfigurationTypeError,
    Conversation,
    ExecutionMode,
    InterlensError,
    LedgerCorruptError,
    LedgerSchemaError,
    Message,
    ModelLoadError,
    ScriptedParticipant,
    register_worker_init,
)
from interlens.store import LedgerReader

ALL_OPTIONS = (
    "devices",
    "out_dir",
    "seed",
    "batched",
    "mode",
    "resume",
    "max_batch_size",
    "max_concurrency",
    "max_attempts",
    "progress",
    "max_batch_wait",
    "worker_start_timeout",
)


class Recorder:
    """A scripted speaker that counts its turns: a refused call must not have generated any."""

    def __init__(self) -> None:
        self.turns = 0

    def __call__(self, view: interlens.View) -> str:
        self.turns += 1
        return f"turn {view.own_turns}"


def scripted(n_speakers: int = 2) -> tuple[Conversation, Recorder]:
    speak = Recorder()
    people = [ScriptedParticipant(name, speak) for name in "ab"[:n_speakers]]
    return Conversation(people, shared_context="Tabs or spaces?").turns(2), speak


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------- run options


def _call(entry: str, conv: Conversation, **options):
    if entry == "rollout":
        return conv.rollout(**options)
    if entry == "run":
        return interlens.run([conv], **options)
    raise AssertionError(entry)


async def _acall(entry: str, conv: Conversation, **options):
    if entry == "arollout":
        return await conv.arollout(**options)
    return await interlens.arun([conv], **options)


@pytest.mark.parametrize("entry", ["rollout", "run"])
def test_an_unknown_option_names_the_call_and_lists_the_valid_options(entry, tmp_path):
    conv, speak = scripted()
    with pytest.raises(ConfigurationTypeError) as info:
        _call(entry, conv, outdir=tmp_path / "run", n=2) if entry == "rollout" else _call(
            entry, conv, outdir=tmp_path / "run"
        )
    assert isinstance(info.value, TypeError) and isinstance(info.value, InterlensError)
    message = str(info.value)
    assert message.startswith(f"{entry}() has no option 'outdir'; did you mean out_dir=...? Its options are")
    assert "run_jobs" not in message
    for option in ALL_OPTIONS:
        assert option in message
    assert ("n, devices" in message) == (entry == "rollout")  # n is rollout's, not run's
    assert speak.turns == 0 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry", ["arollout", "arun"])
async def test_the_async_twins_refuse_unknown_options_with_their_own_name(entry):
    conv, speak = scripted()
    with pytest.raises(ConfigurationTypeError, match=rf"^{entry}\(\) has no option 'max_batch'"):
        await _acall(entry, conv, max_batch=4)
    assert speak.turns == 0


def test_fresh_is_not_an_option_and_the_error_says_resume_false(tmp_path):
    conv, _ = scripted()
    with pytest.raises(ConfigurationTypeError) as info:
        conv.rollout(out_dir=tmp_path, fresh=True)
    message = str(info.value)
    assert "has no option 'fresh'" in message and "resume=False" in message
    assert "fresh=True" not in message


def _outputs(report: interlens.RunReport) -> list[list[str]]:
    return [[m.content for m in report.results[j].transcript] for j in sorted(report.results)]


@pytest.mark.parametrize("mode", [ExecutionMode.DETERMINISTIC, "deterministic"], ids=["enum", "str"])
def test_mode_deterministic_is_the_deterministic_path(qwen2_path, mode, co_step_dtype):
    settings = {"max_new_tokens": 4, "kv_reuse": False, "dtype": co_step_dtype}
    a = AutoModelParticipant.from_pretrained(qwen2_path, name="a", **settings)
    b = AutoModelParticipant.from_pretrained(qwen2_path, name="b", **settings)
    conv = Conversation([a, b], shared_context="Debate: tabs vs spaces.").turns(2)
    report = conv.rollout(n=3, devices=["cpu"], seed=3, mode=mode)
    assert report.failed == [] and len(report.results) == 3
    for result in report.results.values():
        # the self-test's verdict is recorded by deterministic turns only (a fresh worker per run)
        assert all(m.metadata["batch_invariant"] is True for m in result.transcript[1:])
    # the same mode as batched=False: token-identical conversations
    assert _outputs(report) == _outputs(conv.rollout(n=3, devices=["cpu"], seed=3, batched=False))


@pytest.mark.parametrize(
    ("options", "contradiction"),
    [
        (
            {"mode": ExecutionMode.DETERMINISTIC, "batched": True},
            "batched=True contradicts mode=ExecutionMode.DETERMINISTIC",
        ),
        ({"mode": "batched", "batched": False}, "batched=False contradicts mode=ExecutionMode.BATCHED"),
    ],
)
def test_batched_contradicting_mode_is_refused(options, contradiction, tmp_path):
    conv, speak = scripted()
    with pytest.raises(ConfigurationError) as info:
        conv.rollout(out_dir=tmp_path / "run", **options)
    assert contradiction in str(info.value) and "Pass one of the two" in str(info.value)
    assert speak.turns == 0 and not (tmp_path / "run").exists()


BAD_OPTIONS = [
    # (options, error class, what the message must say: the argument and the rule/fix)
    ({"seed": "a"}, ConfigurationTypeError, ["seed must be an int >= 0", "'a' (str)", "seed=0"]),
    ({"seed": None}, ConfigurationTypeError, ["seed must be an int >= 0", "None (NoneType)"]),
    ({"seed": 1.5}, ConfigurationTypeError, ["seed must be an int >= 0", "1.5 (float)"]),
    ({"seed": True}, ConfigurationTypeError, ["seed must be an int >= 0", "True (bool)"]),
    ({"seed": -1}, ConfigurationError, ["seed must be an int >= 0", "got -1"]),
    (
        {"resume": "no"},
        ConfigurationTypeError,
        ["resume must be True or False", "'no' (str)", "resume=False"],
    ),
    ({"progress": "yes"}, ConfigurationTypeError, ["progress must be True, False or None", "'yes' (str)"]),
    ({"batched": "yes"}, ConfigurationTypeError, ["batched must be True, False or None", "batched=False"]),
    (
        {"mode": "fast"},
        ConfigurationError,
        ["mode must be ExecutionMode.BATCHED or ExecutionMode.DETERMINISTIC"],
    ),
    ({"mode": 1}, ConfigurationTypeError, ["mode must be ExecutionMode.BATCHED", "1 (int)"]),
    ({"max_batch_size": 0}, ConfigurationError, ["max_batch_size must be an int >= 1", "got 0"]),
    ({"max_attempts": True}, ConfigurationTypeError, ["max_attempts must be an int >= 1", "True (bool)"]),
    ({"max_batch_wait": "1s"}, ConfigurationTypeError, ["max_batch_wait (seconds) must be a number >= 0"]),
    (
        {"devices": "cpu"},
        ConfigurationTypeError,
        ["devices must be a list of device strings", "devices=['cpu']"],
    ),
    ({"devices": 0}, ConfigurationTypeError, ["devices must be None", "['cuda:0', 'cuda:1']"]),
    ({"devices": ["cuda:99"]}, ConfigurationError, ["'cuda:99' does not exist", "available_devices()"]),
]


@pytest.mark.parametrize(("options", "error", "says"), BAD_OPTIONS, ids=lambda v: repr(v)[:40])
@pytest.mark.parametrize("entry", ["rollout", "run"])
def test_bad_option_values_are_refused_before_anything_runs(entry, options, error, says, tmp_path):
    conv, speak = scripted()
    out = tmp_path / "run"
    with pytest.raises(error) as info:
        _call(entry, conv, out_dir=out, **options)
    message = str(info.value)
    if "devices" not in options or options["devices"] != ["cuda:99"]:  # the device's own error names it
        assert message.startswith(f"{entry}(): ")
    for text in says:
        assert text in message
    assert speak.turns == 0 and not out.exists()  # no job ran, no ledger, not even the directory


@pytest.mark.parametrize(
    ("n", "error"), [(True, ConfigurationTypeError), ("3", ConfigurationTypeError), (-1, ConfigurationError)]
)
def test_n_must_be_a_count(n, error, tmp_path):
    conv, speak = scripted()
    with pytest.raises(error) as info:
        conv.rollout(n, out_dir=tmp_path / "run")
    assert str(info.value).startswith("rollout(): n must be an int >= 0") and "e.g. n=64" in str(info.value)
    assert speak.turns == 0 and not (tmp_path / "run").exists()


def test_run_needs_a_list_of_conversations():
    with pytest.raises(
        ConfigurationTypeError, match=r"run\(\) takes a list of Conversation objects.*NoneType"
    ):
        interlens.run(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- out_dir


def test_an_empty_out_dir_is_refused_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conv, speak = scripted()
    with pytest.raises(ConfigurationError) as info:
        conv.rollout(out_dir="")
    assert "out_dir must name a directory, got ''" in str(info.value) and "out_dir=None" in str(info.value)
    assert speak.turns == 0 and list(tmp_path.iterdir()) == []  # no ledger in the working directory


@pytest.mark.parametrize("where", ["under_a_file", "a_file", "proc", "proc_existing"])
def test_an_out_dir_that_cannot_be_written_is_refused_before_anything_runs(where, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a directory")
    out_dir = {
        "under_a_file": blocker / "run",
        "a_file": blocker,
        "proc": Path("/proc/interlens-test/run"),
        "proc_existing": Path("/proc/self"),
    }[where]
    conv, speak = scripted()
    with pytest.raises(ConfigurationError) as info:
        conv.rollout(out_dir=out_dir, n=2)
    message = str(info.value)
    assert message.startswith(f"rollout(): out_dir={str(out_dir)!r}")
    assert "choose a directory you can write to, or out_dir=None" in message
    assert speak.turns == 0
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
        and blocker.read_text() == "not a directory"
    )
    assert not Path("/proc/interlens-test").exists()


def test_a_missing_out_dir_is_created(tmp_path):
    conv, _ = scripted()
    report = conv.rollout(out_dir=tmp_path / "a" / "b", n=2)
    assert report.failed == [] and (tmp_path / "a" / "b" / "ledger.sqlite").exists()
    assert [p.name for p in (tmp_path / "a" / "b").glob(".interlens-write-check-*")] == []


# ---------------------------------------------------------------------- constructors


@pytest.mark.parametrize(
    ("participants", "error", "says"),
    [
        (None, ConfigurationTypeError, "needs a list of Participant objects"),
        ("ab", ConfigurationTypeError, "needs a list of Participant objects"),
        ([None], ConfigurationTypeError, "takes Participant objects (ScriptedParticipant"),
        ([], ConfigurationError, "at least one participant"),
    ],
)
def test_conversation_participants_are_checked_at_construction(participants, error, says):
    with pytest.raises(error) as info:
        Conversation(participants)
    assert "Conversation(participants=...)" in str(info.value) or says == "at least one participant"
    assert says in str(info.value)
    conv, _ = scripted()
    with pytest.raises(error, match=r"participant"):
        conv.set(participants=participants)


def test_conversation_stop_must_be_stop_conditions():
    with pytest.raises(ConfigurationTypeError, match=r"stop=\.\.\.\) needs a list of StopCondition"):
        Conversation([ScriptedParticipant("a", ["x"])], stop=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("a", 5), "content must be a str, got 5 (int); convert it first, e.g. Message('a', str(value))"),
        ((5, "hi"), "author must be the speaker's name (a non-empty str), got 5 (int)"),
        (("", "hi"), "author must be the speaker's name (a non-empty str), got ''"),
        (("a", "hi", ["n_tokens"]), "metadata must be a dict, got list"),
    ],
)
def test_message_fields_are_checked(args, says):
    with pytest.raises(ConfigurationTypeError) as info:
        Message(*args)
    assert isinstance(info.value, TypeError) and says in str(info.value)


@pytest.mark.parametrize(
    ("settings", "error", "says"),
    [
        (
            {"temperature": "hot"},
            ConfigurationTypeError,
            "temperature must be a number >= 0, got 'hot' (str)",
        ),
        ({"temperature": -0.5}, ConfigurationError, "temperature must be a number >= 0, got -0.5"),
        ({"temperature": math.nan}, ConfigurationError, "temperature must be a number >= 0, got nan"),
        ({"top_p": None}, ConfigurationTypeError, "top_p must be a number in (0, 1], got None (NoneType)"),
        ({"top_p": 0}, ConfigurationError, "top_p must be a number in (0, 1], got 0"),
        ({"max_new_tokens": True}, ConfigurationTypeError, "max_new_tokens must be an int >= 1, got True"),
        ({"stop": [""]}, ConfigurationTypeError, "stop must be a str or a list of non-empty str"),
        ({"seed": "7"}, ConfigurationTypeError, "seed must be an int >= 0, got '7' (str)"),
        ({"kv_reuse": 1}, ConfigurationError, "kv_reuse must be True or False, got 1"),
        (
            {"temprature": 0.5},
            ConfigurationTypeError,
            "has no setting 'temprature' (did you mean temperature=?)",
        ),
    ],
)
def test_model_participant_settings_name_the_participant(qwen2_path, settings, error, says):
    with pytest.raises(error) as info:
        AutoModelParticipant.from_pretrained(qwen2_path, name="judge", **settings)
    assert "'judge'" in str(info.value) and says in str(info.value)


@pytest.mark.parametrize(
    ("settings", "error"),
    [({"temperature": "hot"}, ConfigurationTypeError), ({"top_p": 1.5}, ConfigurationError)],
)
def test_api_participant_settings_name_the_participant(settings, error):
    with pytest.raises(error) as info:
        APIParticipant(name="pro", provider="openai", model_id="gpt-x", **settings)
    field = next(iter(settings))
    assert f"APIParticipant('pro'): {field} must be None or a number" in str(info.value)


def test_a_model_directory_whose_config_is_not_json_names_the_file(qwen2_path, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(qwen2_path, model)
    config = model / "config.json"
    config.write_text('{"model_type": "qwen2",')  # cut off mid-write
    with pytest.raises(ModelLoadError) as info:
        AutoModelParticipant.from_pretrained(model, name="m")
    assert f"{config} is not valid JSON" in str(info.value) and "save_pretrained" in str(info.value)
    config.write_text("[1, 2]")
    with pytest.raises(
        ModelLoadError, match=r"config\.json holds a JSON list, not the object of a model config"
    ):
        AutoModelParticipant.from_pretrained(model, name="m")


# ---------------------------------------------------------------------- Conversation.load


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"schema": 1, "recipe": {"partici', "it is not valid JSON"),
        (b"\xff\xfe not text", "it is not valid JSON"),
        (b'{"model_type": "qwen2", "hidden_size": 8}', "it has no interlens 'schema' version"),
        (b"[1, 2, 3]", "it has no interlens 'schema' version (found list)"),
        (b'{"schema": 1, "recipe": {"turns": 2}}', "does not have the shape Conversation.save() writes"),
        (
            b'{"schema": 1, "recipe": {"participants": [{"kind": "alien"}]}}',
            "unknown participant kind 'alien'",
        ),
    ],
    ids=["truncated", "binary", "foreign", "list", "no-participants", "unknown-kind"],
)
def test_loading_a_corrupt_or_foreign_file_names_it_and_leaves_it_untouched(tmp_path, content, says):
    target = tmp_path / "conversation.json"
    target.write_bytes(content)
    with pytest.raises(ConfigurationError) as info:
        Conversation.load(tmp_path)
    assert str(target) in str(info.value) and says in str(info.value)
    assert target.read_bytes() == content and [p.name for p in tmp_path.iterdir()] == ["conversation.json"]


# ---------------------------------------------------------------------- analyzers


def nan_analyzer(conv: Conversation) -> dict[str, float]:
    return {"score": math.nan}


def infinite_analyzer(conv: Conversation) -> list[float]:
    return [1.0, -math.inf]


@pytest.mark.parametrize("analyzer", [nan_analyzer, infinite_analyzer])
@pytest.mark.parametrize("ledger", [False, True], ids=["memory", "out_dir"])
def test_an_analyzer_returning_nan_or_infinity_fails_its_job(analyzer, ledger, tmp_path):
    conv, _ = scripted()
    out = tmp_path / "run" if ledger else None
    report = conv.analyzer(analyzer).rollout(n=2, out_dir=out)
    assert report.failed == ["rollout_0000", "rollout_0001"]
    for result in report.results.values():
        assert result.error is not None and result.error.type == "AnalyzerError"
        assert "not JSON: it contains NaN or Infinity" in result.error.message
        assert "Return None" in result.error.message
        assert result.analysis is None and len(result.transcript) == 3  # the conversation is kept
    if ledger:
        with sqlite3.connect(f"file:{tmp_path / 'run' / 'ledger.sqlite'}?mode=ro", uri=True) as conn:
            stored = conn.execute("SELECT analysis_json FROM results").fetchall()
        conn.close()
        assert stored == [(None,), (None,)]  # the conversations are kept, no NaN made it to disk
        with LedgerReader(tmp_path / "run") as reader:
            assert reader.job("rollout_0000").state == "failed"  # type: ignore[union-attr]


async def test_an_analyzer_error_is_an_interlens_error():
    conv, _ = scripted()
    report = await conv.analyzer(nan_analyzer).arollout(n=1)
    assert report.results["rollout_0000"].error.type == AnalyzerError.__name__  # type: ignore[union-attr]
    assert issubclass(AnalyzerError, InterlensError)


def test_the_ledger_refuses_nan_whoever_stores_it():
    from interlens.store._json import SecretGuard, dumps

    with pytest.raises(ValueError, match=r"the analysis of job x is not JSON: it contains NaN or Infinity"):
        dumps({"score": math.nan}, what="the analysis of job x", guard=SecretGuard({}))


# ---------------------------------------------------------------------- ledger hints


def _corrupt(out: Path) -> bytes:
    out.mkdir()
    content = b"this is a CSV file, not a database\n" * 20
    (out / "ledger.sqlite").write_bytes(content)
    return content


def _newer(out: Path) -> bytes:
    conv, _ = scripted()
    conv.rollout(n=1, out_dir=out)
    with sqlite3.connect(out / "ledger.sqlite") as conn:
        conn.execute("PRAGMA user_version = 99")
    conn.close()
    return (out / "ledger.sqlite").read_bytes()


@pytest.mark.parametrize(("make", "error"), [(_corrupt, LedgerCorruptError), (_newer, LedgerSchemaError)])
def test_ledger_refusals_suggest_an_option_rollout_has_and_it_works(tmp_path, make, error):
    out = tmp_path / "run"
    before = make(out)
    conv, speak = scripted()
    with pytest.raises(error) as info:
        conv.rollout(n=2, out_dir=out)
    message = str(info.value)
    assert "left untouched" in message and "resume=False" in message
    assert "fresh=" not in message.replace(
        "Ledger.open(..., fresh=True)", ""
    )  # only Ledger.open's own option
    assert speak.turns == 0 and (out / "ledger.sqlite").read_bytes() == before
    report = conv.rollout(n=2, out_dir=out, resume=False)  # the suggested fix
    assert report.failed == [] and len(report.results) == 2
    [moved] = out.glob("ledger.*.sqlite")
    assert moved.read_bytes() == before  # moved aside, not deleted


# ---------------------------------------------------------------------- worker start


def failing_init() -> None:
    raise ImportError("No module named 'probe_lib'")


def test_worker_start_error_is_exported_and_raised_as_an_interlens_error(monkeypatch, tmp_path):
    from interlens.scheduler import WorkerStartError as SchedulerWorkerStartError

    assert "WorkerStartError" in interlens.__all__
    assert issubclass(interlens.WorkerStartError, InterlensError)
    assert issubclass(interlens.WorkerStartError, SchedulerWorkerStartError)
    monkeypatch.setattr(interlens.rollouts._analyzers, "_WORKER_INIT", [])  # the registry is process-wide
    register_worker_init(failing_init)
    conv, speak = scripted()
    with pytest.raises(interlens.WorkerStartError) as info:
        conv.rollout(n=2, devices=["cpu"], out_dir=tmp_path / "run")
    assert "failing_init" in str(info.value) and "probe_lib" in str(info.value)
    assert isinstance(info.value, SchedulerWorkerStartError)  # `except` of either class works
    assert speak.turns == 0


# ---------------------------------------------------------------------- the end-of-run warning


def sometimes_fails(view: interlens.View) -> str:
    if "Spaces" in view.messages[0].content:
        raise RuntimeError("the judge crashed on spaces")
    return "fine"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "interlens" and r.levelno == logging.WARNING]


def _all_fail() -> Conversation:
    return Conversation([ScriptedParticipant("a", lambda view: str(1 // 0))]).turns(1)


def test_a_rollout_where_every_job_failed_says_so(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="interlens"):
        report = _all_fail().rollout(n=3, out_dir=tmp_path / "run")
    assert len(report.failed) == 3
    [warning] = _warnings(caplog)
    assert warning.startswith("rollout() finished but all 3 jobs failed")
    assert "rollout_0000" in warning and "ZeroDivisionError: integer division or modulo by zero" in warning
    assert "report.failed" in warning and str(tmp_path / "run") in warning


async def test_an_async_rollout_says_so_too(caplog):
    with caplog.at_level(logging.WARNING, logger="interlens"):
        report = await _all_fail().arollout(n=1)
    assert report.failed == ["rollout_0000"]
    [warning] = _warnings(caplog)
    assert (
        warning.startswith("arollout() finished but its only job failed") and "ZeroDivisionError" in warning
    )


def test_run_counts_the_failed_jobs_among_all(caplog):
    rows = [{"topic": "Tabs"}, {"topic": "Spaces"}, {"topic": "Both"}]
    judged = (
        Conversation(
            [ScriptedParticipant("judge", sometimes_fails)], shared_context=interlens.dataset_field("topic")
        )
        .turns(1)
        .data(rows)
        .name("judged")
    )
    fine, _ = scripted()
    with caplog.at_level(logging.WARNING, logger="interlens"):
        report = interlens.run([judged, fine.name("fine")])
    assert report.failed == ["judged/row_00001"]
    [warning] = _warnings(caplog)
    assert warning.startswith("run() finished but 1 of 4 jobs failed. The first, judged/row_00001, failed")
    assert (
        "RuntimeError: the judge crashed on spaces" in warning and "report.results[job_id].error" in warning
    )


def test_a_run_without_failures_warns_nothing(caplog):
    conv, _ = scripted()
    with caplog.at_level(logging.WARNING, logger="interlens"):
        assert conv.rollout(n=2).failed == []
    assert _warnings(caplog) == []


def test_foreign_errors_leave_the_package_boundary_as_interlens_errors():
    """``as_interlens_errors``: a store or scheduler error becomes its interlens twin (both ``except``s
    catch it, same message), chained to what the foreign error was chained to; anything else passes."""
    import interlens.scheduler as scheduler
    import interlens.store as store
    from interlens._core import as_interlens_errors

    cause = OSError("disk")
    with pytest.raises(interlens.LedgerLockedError) as locked:
        with as_interlens_errors():
            raise store.LedgerLockedError("runs/x is written by pid 7") from cause
    assert isinstance(locked.value, store.LedgerLockedError)
    assert str(locked.value) == "runs/x is written by pid 7"
    assert locked.value.__cause__ is cause
    with pytest.raises(interlens.ConfigurationError, match="max_batch_size"):
        with as_interlens_errors():
            raise scheduler.SchedulerConfigError("max_batch_size must be an int >= 1")
    plain = KeyError("row")
    with pytest.raises(KeyError) as passed:
        with as_interlens_errors():
            raise plain
    assert passed.value is plain


def exiting_analyzer(conv):
    if len(conv.transcript) > 0 and conv.seed % 2:
        raise SystemExit(2)  # what an argparse call in an analyzer does on bad arguments
    return {"ok": True}


async def exiting_async_analyzer(conv):
    return exiting_analyzer(conv)


@pytest.mark.parametrize("analyzer", [exiting_analyzer, exiting_async_analyzer], ids=["sync", "async"])
def test_an_analyzer_raising_system_exit_fails_its_job_not_the_rollout(analyzer, tmp_path):
    conv, _ = scripted()
    report = conv.analyzer(analyzer).rollout(n=4, seed=0, out_dir=tmp_path / "run")
    assert report.failed == ["rollout_0001", "rollout_0003"]  # odd seeds exit; the others are analysed
    error = report.results["rollout_0001"].error
    assert error is not None and error.type == "AnalyzerError" and "SystemExit(2)" in error.message
    assert report.results["rollout_0000"].analysis == {"ok": True}
    assert len(report.results["rollout_0001"].transcript) == 3  # the conversation is kept
