"""Rollouts end to end with scripted participants: ids, seeds, data, analyzers, resume, isolation."""

from __future__ import annotations

import asyncio

import pytest

import interlens
from interlens import (
    AnalyzerError,
    ConfigurationError,
    Conversation,
    FingerprintMismatchError,
    MissingColumnError,
    ScriptedParticipant,
    TokenBudget,
    UnknownAnalyzerError,
    dataset_field,
    register_analyzer,
)
from interlens.store import LedgerReader


def echo(name: str) -> ScriptedParticipant:
    return ScriptedParticipant(name, lambda view: f"{name} turn {view.own_turns} after {len(view.messages)}")


def debate() -> Conversation:
    return Conversation(participants=[echo("a"), echo("b")], shared_context="Tabs or spaces?").turns(4)


def test_rollout_ids_seeds_and_original_untouched():
    conv = debate()
    report = conv.rollout(n=3, seed=10)
    assert list(report.results) == ["rollout_0000", "rollout_0001", "rollout_0002"]
    assert report.failed == [] and report.skipped == []
    seeds = [r.seed for r in report.results.values()]
    assert seeds == [10, 11, 12]
    res = report.results["rollout_0001"]
    assert res.error is None
    assert [m.author for m in res.transcript] == ["moderator", "a", "b", "a", "b"]
    assert res.conversation.seed == 11 and res.tokens_generated == res.transcript.tokens_generated > 0
    # the original stays the unrun recipe
    assert len(conv.transcript) == 1 and conv.generated_turns == 0
    with pytest.raises(interlens.UnrunConversationError):
        conv.sample("a")
    # the finished copy is live
    assert res.conversation.sample("b", "Final word?").content == "b turn 2 after 6"


def gsm_rows(n: int):
    return [{"question": f"{i} + {i}?", "answer": str(2 * i)} for i in range(n)]


def grade(conv):
    return {"gold": conv.row["gold"], "context": conv.transcript[0].content}


def _data_conv():
    solver = ScriptedParticipant("solver", lambda view: "Final answer: 4")
    return (
        Conversation(
            participants=[solver], shared_context=("Solve this problem.\n\n", dataset_field("question"))
        )
        .turns(1)
        .analyzer(grade)
    )


@pytest.mark.floors
def test_data_rollout_over_dataset_iterable_dataset_and_generator():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(gsm_rows(5)).map(lambda r: {"gold": int(r["answer"])})
    streaming = (
        datasets.Dataset.from_list(gsm_rows(5))
        .to_iterable_dataset()
        .map(lambda r: {"gold": int(r["answer"])})
    )

    def generator():
        for row in gsm_rows(5):
            yield {**row, "gold": int(row["answer"])}

    for data, n in ((ds, None), (streaming, None), (generator(), 3)):
        report = _data_conv().data(data).rollout(n=n)
        expected = 5 if n is None else n
        assert list(report.results) == [f"row_{i:05d}" for i in range(expected)]
        analyses = report.analyses()
        assert [analyses[f"row_{i:05d}"]["gold"] for i in range(expected)] == [2 * i for i in range(expected)]
        assert analyses["row_00002"]["context"] == "Solve this problem.\n\n2 + 2?"
        # the solver's view is exactly the templated question and its own turn: the gold column is not in it
        conv = report.results["row_00001"].conversation
        view = conv.view("solver")
        assert view.system is None
        assert [m.content for m in view.messages] == ["Solve this problem.\n\n1 + 1?", "Final answer: 4"]
        assert conv.row["gold"] == 2


def test_gold_column_never_reaches_any_participants_view():
    """A column no template names (the gold answer) reaches the analyzer, never a participant: each turn
    echoes the whole view its speaker got (system block included), so a leak into any view, at any turn,
    of any participant, shows up in the transcript."""
    rows = [{"question": f"{i} + {i}?", "gold": f"GOLD-{2 * i}-ANSWER"} for i in range(4)]

    def seer(name, **kwargs):
        return ScriptedParticipant(
            name,
            lambda view: " | ".join([f"SAW {view.system}", *(m.content for m in view.messages)]),
            **kwargs,
        )

    conv = (
        Conversation(
            participants=[
                seer("solver"),
                seer("checker", system_prompt=("Check: ", dataset_field("question"))),
            ],
            shared_context=("Solve this problem.\n\n", dataset_field("question")),
        )
        .turns(4)
        .data(rows)
        .analyzer(lambda conv: {"gold": conv.row["gold"]})
    )
    report = conv.rollout()
    assert report.failed == [] and len(report.results) == len(rows)
    analyses = report.analyses()
    for i, row in enumerate(rows):
        result = report.results[f"row_{i:05d}"]
        assert analyses[f"row_{i:05d}"] == {"gold": row["gold"]}  # the analyzer does get the gold
        seen = [m.content for m in result.transcript[1:]]
        assert len(seen) == 4 and all(text.startswith("SAW ") for text in seen)
        assert (
            row["question"] in seen[0] and f"Check: {row['question']}" in seen[1]
        )  # templates do reach them
        final = result.conversation
        for speaker in ("solver", "checker"):
            view = final.view(speaker)
            seen.append(f"{view.system} {[m.content for m in view.messages]}")
        for text in seen:
            assert not any(r["gold"] in text for r in rows), text
            assert "GOLD" not in text and "ANSWER" not in text, text


def test_missing_column_in_dataset_fails_before_running():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(gsm_rows(2))
    conv = _data_conv().set(shared_context=dataset_field("qestion")).data(ds)
    with pytest.raises(MissingColumnError, match="available columns"):
        conv.rollout()


def test_bad_row_fails_alone():
    rows = [{"question": "ok 1"}, {"oops": "no question"}, {"question": "ok 3"}]
    solver = ScriptedParticipant("solver", ["done"])
    report = (
        Conversation(participants=[solver], shared_context=dataset_field("question"))
        .turns(1)
        .data(iter(rows))
        .rollout()
    )
    assert report.failed == ["row_00001"]
    err = report.results["row_00001"].error
    assert err.type == "MissingColumnError" and "'question'" in err.message
    assert report.results["row_00002"].transcript[-1].content == "done"


def test_run_mixed_lineups_namespaced_ids():
    pair = debate().name("pair")
    solo = Conversation(participants=[echo("s")], shared_context="Alone.").turns(2).name("solo")
    data = _data_conv().data(gsm_rows(2)).name("gsm")
    unnamed = Conversation(participants=[echo("u")]).turns(1)
    report = interlens.run([pair, solo, data, unnamed])
    assert sorted(report.results) == ["conv3", "gsm/row_00000", "gsm/row_00001", "pair", "solo"]
    assert report.results["pair"].transcript[-1].author == "b"
    assert report.results["gsm/row_00001"].transcript[0].content.endswith("1 + 1?")


def test_run_rejects_duplicate_lineup_names():
    with pytest.raises(ConfigurationError, match="share the name"):
        interlens.run([debate().name("x"), debate().name("x")])


def test_analyzer_that_samples_and_registered_by_name():
    def stance(conv):
        return {"n_turns": len(conv.transcript), "a_stance": conv.sample("a", "One word?").content}

    register_analyzer("test_stance", stance)
    for analyzer in (stance, "test_stance"):
        report = debate().analyzer(analyzer).rollout(n=2)
        assert report.analyses()["rollout_0000"] == {"n_turns": 5, "a_stance": "a turn 2 after 6"}


def test_unknown_analyzer_name_fails_early():
    with pytest.raises(UnknownAnalyzerError, match="register_analyzer"):
        debate().analyzer("nobody_registered_this").rollout(n=2)


def test_analyzer_error_keeps_transcript_and_rerun_reruns_only_analyzer(tmp_path):
    calls = {"n": 0}

    def flaky(conv):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("analyzer broke")
        return {"ok": True}

    generated = {"n": 0}

    def counting(view):
        generated["n"] += 1
        return "x"

    conv = Conversation(participants=[ScriptedParticipant("p", counting)]).turns(2).analyzer(flaky)
    report = conv.rollout(n=1, out_dir=tmp_path)
    res = report.results["rollout_0000"]
    assert res.error.type == "RuntimeError" and "analyzer broke" in res.error.message
    assert len(res.transcript) == 2  # kept
    assert generated["n"] == 2
    report = conv.rollout(n=1, out_dir=tmp_path)
    assert report.results["rollout_0000"].analysis == {"ok": True}
    assert generated["n"] == 2  # no turn regenerated: only the analyzer ran again


def test_non_json_analysis_is_a_clear_error():
    report = debate().analyzer(lambda conv: {"obj": object()}).rollout(n=1)
    err = report.results["rollout_0000"].error
    assert err.type == AnalyzerError.__name__ and "JSON-serializable" in err.message


def test_token_budget_matched_compute():
    talk = lambda name: ScriptedParticipant(name, ["one two three four five six seven"])  # noqa: E731
    pair = Conversation(participants=[talk("a"), talk("b")], shared_context="Go.").turns(6)
    pair_report = pair.rollout(n=2)
    pair_spend = pair_report.results["rollout_0000"].tokens_generated
    assert pair_spend == 42
    solo = (
        pair.set(participants=[talk("solver")])
        .turns(None)
        .run_until(TokenBudget(per_conversation=pair_spend, per_turn=5))
    )
    solo_report = solo.rollout(n=3)
    for res in solo_report.results.values():
        assert res.tokens_generated == pair_spend
        assert all(m.n_tokens <= 5 for m in res.transcript)
    with TokenBudget(per_conversation=10):
        ambient = pair.rollout(n=4)
    assert {r.tokens_generated for r in ambient.results.values()} == {10}


def test_resume_skips_done_jobs_and_refuses_changed_recipe(tmp_path):
    conv = debate()
    first = conv.rollout(n=3, out_dir=tmp_path)
    assert first.skipped == []
    second = conv.rollout(n=5, out_dir=tmp_path)
    assert second.skipped == ["rollout_0000", "rollout_0001", "rollout_0002"]
    assert len(second.results) == 5
    assert second.results["rollout_0000"].transcript == first.results["rollout_0000"].transcript
    with pytest.raises(FingerprintMismatchError, match="resume=False"):
        conv.turns(6).rollout(n=3, out_dir=tmp_path)
    fresh = conv.turns(6).rollout(n=2, out_dir=tmp_path, resume=False)
    assert fresh.skipped == [] and len(fresh.results["rollout_0000"].transcript) == 7
    with LedgerReader(tmp_path) as reader:
        assert reader.counts().get("done") == 2


def test_out_dir_none_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    debate().rollout(n=2)
    assert list(tmp_path.iterdir()) == []


async def test_arollout_under_running_loop():
    report = await debate().arollout(n=2)
    assert len(report.results) == 2
    # and the sync twin inside a running loop (Jupyter): a helper thread runs its own loop
    report = debate().rollout(n=2)
    assert not report.failed
    assert asyncio.get_running_loop().is_running()
