"""Branching a conversation at a turn (issue 39): ``conv.recipe()``, ``conv.upto(k)``, and a preview that
is never rolled out by mistake. The ledger side (``report.branch``) is in ``test_branch_report.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from interlens import BranchError, ConfigurationError, Conversation, ScriptedParticipant, View, dataset_field


def _counter(name: str) -> ScriptedParticipant:
    """Says how many messages it saw: a continuation's text shows where it started."""

    def reply(view: View) -> str:
        return f"{name}{len(view.messages)}"

    return ScriptedParticipant(name, reply)


def _debate(turns: int = 4) -> Conversation:
    return Conversation(participants=[_counter("a"), _counter("b")], shared_context="Q").turns(turns)


def _contents(conv: Conversation) -> list[str]:
    return [m.content for m in conv.transcript]


def test_recipe_is_the_unrun_recipe_whatever_the_conversation_ran() -> None:
    conv = _debate()
    conv.run()
    assert _contents(conv) == ["Q", "a1", "b2", "a3", "b4"]
    recipe = conv.recipe()
    assert _contents(recipe) == ["Q"] and recipe.generated_turns == 0
    assert recipe.turns() == 4 and [p.name for p in recipe.participants] == ["a", "b"]
    assert _contents(conv) == ["Q", "a1", "b2", "a3", "b4"]  # a copy: the run conversation is untouched
    transcript = recipe.rollout(n=2, progress=False).results["rollout_0001"].transcript
    assert transcript is not None and [m.content for m in transcript] == ["Q", "a1", "b2", "a3", "b4"]


def test_a_preview_is_never_rolled_out_by_mistake() -> None:
    """``conv.run()`` then ``conv.rollout(n=...)``: refused, naming both things the user may have meant."""
    conv = _debate()
    conv.run(turns=2)
    with pytest.raises(ConfigurationError) as excinfo:
        conv.rollout(n=3, progress=False)
    message = str(excinfo.value)
    assert "already run (2 generated turn(s)" in message
    assert "conv.recipe()" in message and "conv.upto(2)" in message
    after_more = conv.upto(2)
    after_more.run(turns=1)  # a branch point that ran on is a preview again
    with pytest.raises(ConfigurationError, match=r"conv\.upto\(3\)"):
        after_more.rollout(n=1, progress=False)


def test_upto_k_continues_every_copy_from_the_first_k_turns() -> None:
    conv = _debate()
    conv.run()
    start = conv.upto(2)
    assert _contents(start) == ["Q", "a1", "b2"] and start.upto_turn == 2
    assert _contents(conv.upto(0)) == ["Q"]
    report = start.turns(5).rollout(n=2, progress=False)
    assert report.failed == []
    for result in report.results.values():
        assert result.transcript is not None
        assert [m.content for m in result.transcript] == ["Q", "a1", "b2", "a3", "b4", "a5"]
        assert result.conversation is not None and result.conversation.generated_turns == 5


def test_upto_past_the_end_names_the_length() -> None:
    conv = _debate()
    conv.run(turns=3)
    with pytest.raises(BranchError, match=r"has 3 generated turn\(s\), so k can be 0 to 3"):
        conv.upto(4)
    with pytest.raises(BranchError, match="non-negative int"):
        conv.upto(-1)
    with pytest.raises(BranchError, match="non-negative int"):
        conv.upto(True)


def test_the_recipe_of_a_rows_result_resolves_the_same_prompts(tmp_path: Path) -> None:
    conv = Conversation(
        participants=[_counter("a"), _counter("b")], shared_context=("Q: ", dataset_field("q"))
    ).turns(2)
    report = conv.data([{"q": "one"}, {"q": "two"}]).rollout(out_dir=tmp_path, progress=False)
    result = report.results["row_00001"].conversation
    assert result is not None and _contents(result) == ["Q: two", "a1", "b2"]
    again = result.recipe().rollout(progress=False)
    assert [m.content for m in again.results["row_00000"].transcript] == ["Q: two", "a1", "b2"]
    start = result.upto(1)
    assert _contents(start) == ["Q: two", "a1"]
    continued = start.turns(3).rollout(progress=False).results["row_00000"]
    assert continued.transcript is not None
    assert [m.content for m in continued.transcript] == ["Q: two", "a1", "b2", "a3"]
    assert continued.conversation is not None and continued.conversation.row == {"q": "two"}
