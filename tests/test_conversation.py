"""The Conversation API with scripted participants: views, modifiers, live use, budgets, save/load."""

from __future__ import annotations

import json

import pytest

from interlens import (
    ConfigurationError,
    Conversation,
    MaxTurns,
    Message,
    MissingColumnError,
    SchemaVersionError,
    ScriptedParticipant,
    StopStrings,
    TemplateError,
    TokenBudget,
    Transcript,
    UnknownParticipantError,
    UnrunConversationError,
    dataset_field,
)


def debate(**kwargs):
    a = ScriptedParticipant("a", ["a one", "a two", "a three"], system_prompt="You are A.")
    b = ScriptedParticipant("b", lambda view: f"b saw {len(view.messages)}")
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.", **kwargs)


def test_shared_context_seeds_transcript_as_moderator():
    conv = debate()
    assert len(conv.transcript) == 1
    assert conv.transcript[0].author == "moderator"
    assert conv.transcript[0].content == "Debate: tabs vs spaces."
    assert conv.generated_turns == 0


def test_round_robin_and_views():
    conv = debate(shared_system_prompt="Be brief.")
    conv.run(turns=4)
    assert [m.author for m in conv.transcript] == ["moderator", "a", "b", "a", "b"]
    assert conv.transcript[2].content == "b saw 2"  # context + a's first turn
    view_a = conv.view("a")
    assert view_a.system == "Be brief.\n\nYou are A."
    assert [m.role for m in view_a.messages] == ["user", "assistant", "user", "assistant", "user"]
    view_b = conv.view("b")
    assert view_b.system == "Be brief."
    assert [m.role for m in view_b.messages] == ["user", "user", "assistant", "user", "assistant"]
    # two voices: no name labels
    assert view_b.messages[1].content == "a one"


def test_more_than_two_voices_are_labelled():
    parts = [ScriptedParticipant(n, [f"{n} speaks"]) for n in ("x", "y", "z")]
    conv = Conversation(participants=parts, shared_context="Topic.")
    conv.run(turns=3)
    view = conv.view("z")
    assert view.messages[0].content == "moderator: Topic."
    assert view.messages[1].content == "x: x speaks"
    assert view.messages[3].role == "assistant" and view.messages[3].content == "z speaks"


def test_step_with_explicit_speaker_and_next_speaker():
    conv = debate()
    conv.step("b")
    assert conv.transcript[-1].author == "b"
    assert conv.next_speaker().name == "a"
    with pytest.raises(UnknownParticipantError, match="no participant named 'c'"):
        conv.step("c")


def test_copy_on_write_modifiers_leave_original_untouched():
    conv = debate()
    before = (
        conv.turns(),
        conv.name(),
        conv.data_source,
        conv.analyzer_fn,
        conv.stop_conditions,
        conv.participants,
        len(conv.transcript),
    )
    variants = [
        conv.turns(6),
        conv.name("x"),
        conv.data([{"q": 1}]),
        conv.analyzer(len),
        conv.run_until(TokenBudget(per_conversation=10)),
        conv.set(shared_context="Other."),
        conv.set(participants=[ScriptedParticipant("solo", ["hi"])]),
    ]
    assert (
        conv.turns(),
        conv.name(),
        conv.data_source,
        conv.analyzer_fn,
        conv.stop_conditions,
        conv.participants,
        len(conv.transcript),
    ) == before
    assert variants[0].turns() == 6 and variants[1].name() == "x"
    assert variants[5].transcript[0].content == "Other."
    assert conv.transcript[0].content == "Debate: tabs vs spaces."
    # running a copy does not touch the original's transcript
    variants[0].run()
    assert len(variants[0].transcript) == 7 and len(conv.transcript) == 1
    # copies share participants (and so loaded weights) by reference
    assert variants[0].participants[0] is conv.participants[0]


def test_set_rejects_unknown_field():
    with pytest.raises(ConfigurationError, match="no field"):
        debate().set(colour="red")


def test_sample_on_unrun_recipe_raises_and_samples_do_not_commit():
    conv = debate()
    with pytest.raises(UnrunConversationError, match=r"report\.results\[job_id\]\.conversation"):
        conv.sample("a")
    conv.run(turns=2)
    n = len(conv.transcript)
    reply = conv.sample("b", "One word?")
    assert isinstance(reply, Message) and reply.content == "b saw 4"  # 3 messages + the prompt
    assert len(conv.transcript) == n


def test_never_stopping_conversation_is_refused():
    with pytest.raises(ConfigurationError, match="never stop"):
        debate().run()


def test_token_budget_caps_turns_and_stops():
    long = ScriptedParticipant("long", ["one two three four five six seven eight nine ten"])
    conv = (
        Conversation(participants=[long]).turns(None).run_until(TokenBudget(per_conversation=25, per_turn=8))
    )
    conv.run()
    counts = [m.n_tokens for m in conv.transcript]
    assert counts == [8, 8, 8, 1]  # per_turn caps at 8; the last turn is capped to what is left
    assert conv.tokens_generated == 25
    assert conv.transcript[-1].metadata["finish_reason"] == "length"


def test_ambient_token_budget_is_per_conversation():
    word = ScriptedParticipant("w", ["alpha beta gamma"])
    conv = Conversation(participants=[word]).turns(100)
    with TokenBudget(per_conversation=7):
        first = conv.turns(100)
        first.run()
        second = conv.turns(100)
        second.run()
    assert first.tokens_generated == 7 and second.tokens_generated == 7
    outside = conv.turns(2)
    outside.run()
    assert outside.tokens_generated == 6


def test_stop_strings_and_turn_cap():
    p = ScriptedParticipant("p", ["thinking", "still thinking", "Final answer: 4", "never"])
    conv = Conversation(participants=[p]).turns(10).run_until(StopStrings("Final answer:"))
    conv.run()
    assert conv.last_generated.content == "Final answer: 4"
    conv2 = Conversation(participants=[p]).run_until(MaxTurns(2))
    conv2.run()
    assert conv2.generated_turns == 2


def test_templating_str_field_callable_tuple():
    row = {"question": "2+2?", "topic": "math"}
    solver = ScriptedParticipant("s", ["4"], system_prompt=("Expert in ", dataset_field("topic"), "."))
    conv = Conversation(
        participants=[solver],
        shared_context=("Solve:\n", dataset_field("question")),
        shared_system_prompt=lambda r: f"Row about {r['topic']}",
    )
    job = conv.for_row(row, index=0, seed=5)
    assert job.transcript[0].content == "Solve:\n2+2?"
    assert job.view("s").system == "Row about math\n\nExpert in math."
    assert job.row == row and job.seed == 5


def test_missing_column_names_column_and_available_columns():
    conv = Conversation(
        participants=[ScriptedParticipant("s", ["x"])], shared_context=dataset_field("qestion")
    )
    with pytest.raises(MissingColumnError) as info:
        conv.for_row({"question": "q", "answer": "a"}, index=3, seed=0)
    assert "'qestion'" in str(info.value) and "['answer', 'question']" in str(info.value)


def test_templated_conversation_run_live_without_row_explains():
    conv = Conversation(participants=[ScriptedParticipant("s", ["x"])], shared_context=dataset_field("q"))
    with pytest.raises(TemplateError, match=r"\.data\(rows\)"):
        conv.run(turns=1)


def test_bad_template_value_rejected_at_construction():
    with pytest.raises(ConfigurationError, match="shared_context must be"):
        Conversation(participants=[ScriptedParticipant("s", ["x"])], shared_context=42)


def test_a_template_callable_with_the_wrong_signature_or_none_in_a_tuple_is_refused_at_construction():
    speaker = [ScriptedParticipant("s", ["x"])]
    with pytest.raises(
        ConfigurationError, match=r"shared_context: the template callable .*lambda.*\(\) cannot"
    ):
        Conversation(participants=speaker, shared_context=lambda: "no row taken")
    with pytest.raises(
        ConfigurationError, match=r"shared_system_prompt: the template callable .*\(row, style\)"
    ):
        Conversation(participants=speaker, shared_system_prompt=lambda row, style: "two taken")
    with pytest.raises(ConfigurationError, match=r"s\.system_prompt: a template tuple holds None"):
        ScriptedParticipant("s", ["x"], system_prompt=("Be ", None, "brief"))
    Conversation(participants=speaker, shared_context=lambda row, style="x": "a default is fine")


def test_a_template_callable_raising_on_one_row_fails_only_that_rows_job(tmp_path):
    """The user's callable on a bad row: that job fails naming the field and the error, the others run, and a
    rerun runs only the failed one again."""

    def context(row):
        return "Topic: " + row["topic"]

    rows = [{"topic": "tabs"}, {"other": 1}, {"topic": "spaces"}]
    conv = Conversation(participants=[ScriptedParticipant("s", ["ok"])], shared_context=context).turns(1)
    report = conv.data(rows).rollout(out_dir=tmp_path, progress=False)
    assert report.failed == ["row_00001"] and report.counts["done"] == 2
    error = report.results["row_00001"].error
    assert error is not None and error.type == "TemplateError"
    assert "shared_context: the template callable" in error.message and "KeyError: 'topic'" in error.message
    assert report.results["row_00000"].transcript[0].content == "Topic: tabs"
    again = conv.data(rows).rollout(out_dir=tmp_path, progress=False)
    assert again.counts["skipped"] == 2 and again.failed == ["row_00001"]


class FakeTString:
    """The shape of a PEP 750 Template (strings + interpolations), as on Python 3.14."""

    class Interp:
        def __init__(self, value, conversion=None, format_spec=""):
            self.value, self.conversion, self.format_spec = value, conversion, format_spec

    def __init__(self, strings, interpolations):
        self.strings, self.interpolations = strings, interpolations


def test_tstring_templates_duck_typed():
    from interlens._core._templating import resolve

    t = FakeTString(("Q: ", " (", ")"), (FakeTString.Interp(dataset_field("q")), FakeTString.Interp(3, "r")))
    assert resolve(t, {"q": "why?"}) == "Q: why? (3)"


def test_save_load_round_trip(tmp_path):
    from interlens._core._view import count_tokens

    a = ScriptedParticipant("a", ["hello there", "again"], system_prompt="Sys A")
    b = ScriptedParticipant("b", ["hi"])
    conv = Conversation(participants=[a, b], shared_context="Ctx", shared_system_prompt="Shared").turns(3)
    conv = conv.run_until(TokenBudget(per_conversation=100)).name("demo")
    conv.run()
    conv.save(tmp_path / "c")
    loaded = Conversation.load(tmp_path / "c")
    assert loaded.transcript == conv.transcript
    assert loaded.turns() == 3 and loaded.name() == "demo"
    assert [p.name for p in loaded.participants] == ["a", "b"]
    assert loaded.view("a") == conv.view("a")
    assert loaded.transcript[1].n_tokens == count_tokens("hello there")
    # it is live again
    loaded.run(turns=1)
    assert loaded.transcript[-1].content == "hi"
    data = json.loads((tmp_path / "c" / "conversation.json").read_text())
    assert data["schema"] == 1


def test_load_newer_schema_raises(tmp_path):
    conv = debate()
    path = conv.save(tmp_path)
    data = json.loads(path.read_text())
    data["schema"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaVersionError, match="upgrade interlens"):
        Conversation.load(tmp_path)


def test_transcript_is_list_like_and_prints():
    t = Transcript([Message("a", "hi"), Message("b", "yo", {"n_tokens": 2})])
    assert len(t) == 2 and t[1].author == "b" and t[-1].n_tokens == 2
    assert isinstance(t[:1], Transcript) and len(t[:1]) == 1
    assert "[a]\nhi" in str(t) and t.tokens_generated == 2


def test_fingerprint_changes_with_recipe_not_with_copy():
    conv = debate().turns(4)
    assert conv.fingerprint() == conv.turns(4).fingerprint()
    assert conv.fingerprint() != conv.turns(5).fingerprint()
    assert conv.fingerprint() != conv.set(shared_context="x").fingerprint()


async def test_async_twins_under_running_loop():
    conv = debate()
    await conv.arun(turns=2)
    msg = await conv.astep()
    assert msg.author == "a" and conv.generated_turns == 3
    sample = await conv.asample("b")
    assert sample.content.startswith("b saw")


async def test_sync_run_works_inside_running_loop():
    conv = debate()
    conv.run(turns=2)  # a helper thread runs its own loop: no nest_asyncio
    assert conv.generated_turns == 2


def test_participant_sync_generate_on_a_view():
    conv = debate()
    conv.run(turns=1)
    msg = conv.participant("b").generate(conv.view("b"))
    assert msg.author == "b" and msg.content == "b saw 2"


def test_n_larger_than_the_data_warns_and_runs_one_job_per_row():
    import warnings

    rows = [{"q": "a"}, {"q": "b"}, {"q": "c"}]
    conv = Conversation(participants=[ScriptedParticipant("s", ["ok"])], shared_context=dataset_field("q"))
    conv = conv.turns(1).data(rows)
    with pytest.warns(UserWarning, match=r"n=10 but the data has 3 row\(s\), so 3 job\(s\) run"):
        report = conv.rollout(n=10, progress=False)
    assert len(report.results) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every row, or fewer: no warning
        assert len(conv.rollout(progress=False).results) == 3
        assert len(conv.rollout(n=2, progress=False).results) == 2
