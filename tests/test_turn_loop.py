"""One turn loop (``Conversation.advance``) for live runs and rollout jobs, and the one-way imports around it.

A rollout job is a thin adapter over the live loop: these tests pin what the adapter adds (the job's stream,
its seeds, each turn reported as it ends, committed turns replayed) and that the modules keep their layering.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import interlens
from interlens import Conversation, Message, ScriptedParticipant, StopStrings
from interlens._core._view import GenerationOptions, View

PACKAGE = Path(interlens.__file__).parent


class Witness(interlens.Participant):
    """A user-defined participant that notes the options each of its turns was generated with."""

    kind = "witness"

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.seen: list[GenerationOptions] = []

    async def agenerate(self, view: View, options: GenerationOptions | None = None) -> Message:
        assert options is not None
        self.seen.append(options)
        return Message(self.name, f"{self.name} turn {view.own_turns}", {"n_tokens": 3})

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name}


def pair(**kwargs: Any) -> Conversation:
    a = ScriptedParticipant("a", ["a one", "a two DONE", "a three"])
    b = ScriptedParticipant("b", lambda view: f"b saw {len(view.messages)}")
    return Conversation([a, b], shared_context="Topic.", **kwargs)


def test_advance_reports_each_turn_with_its_index_once_it_is_in_the_transcript() -> None:
    conv = pair(turns=3)
    reported: list[tuple[int, str, int]] = []

    async def on_turn(index: int, message: Message) -> None:
        reported.append((index, message.content, len(conv.transcript)))

    transcript = asyncio.run(conv.advance(on_turn=on_turn))
    assert transcript is conv.transcript
    assert reported == [(0, "a one", 2), (1, "b saw 2", 3), (2, "a two DONE", 4)]


def test_advance_stops_where_the_given_conditions_say_not_the_recipe() -> None:
    conv = pair(turns=10)
    asyncio.run(conv.advance([StopStrings("DONE")]))
    assert [m.content for m in conv.transcript] == ["Topic.", "a one", "b saw 2", "a two DONE"]


def test_a_rollout_job_runs_the_live_loop_on_its_own_stream_with_job_seeds() -> None:
    live_witness, job_witness = Witness("w"), Witness("w")
    live = Conversation([live_witness, ScriptedParticipant("s", ["ok"])], turns=4)
    live.run()
    recipe = Conversation([job_witness, ScriptedParticipant("s", ["ok"])], turns=4)
    report = recipe.rollout(2, seed=7)

    for job_id in ("rollout_0000", "rollout_0001"):
        conv = report.results[job_id].conversation
        assert conv is not None
        assert conv.transcript.to_json() == live.transcript.to_json()  # the same loop, the same turns
    # outside a job: no seed for a participant without one; in a job: every turn seeded, on the job's stream
    assert [o.seed for o in live_witness.seen] == [None, None]
    assert sorted({o.stream_id for o in job_witness.seen}) == ["rollout_0000", "rollout_0001"]
    seeds = [o.seed for o in job_witness.seen]
    assert len(seeds) == 4 and None not in seeds and len(set(seeds)) == 4


def test_replay_continues_after_committed_turns_and_leaves_the_recipe_untouched() -> None:
    full = pair(turns=4)
    full.run()
    recipe = pair(turns=4)
    committed = [m.to_json() for m in full.transcript[1:3]]  # what an earlier attempt committed

    resumed = recipe.replay(committed, stream_id="job-7")
    assert len(recipe.transcript) == 1  # the shared context only
    assert resumed.generated_turns == 2 and resumed.next_speaker().name == "a"
    asyncio.run(resumed.advance())
    assert resumed.transcript.to_json() == full.transcript.to_json()


def test_for_row_then_with_state_rebuilds_a_finished_job() -> None:
    solver = ScriptedParticipant("s", ["4"], system_prompt=("Topic: ", interlens.dataset_field("topic")))
    recipe = Conversation([solver], shared_context=interlens.dataset_field("q"), turns=1)
    done = recipe.for_row({"q": "2+2?", "topic": "math"}, index=0, seed=3)
    done.run()

    again = recipe.for_row(done.row, index=0, seed=3).with_state(done.to_json())
    assert again.transcript.to_json() == done.transcript.to_json()
    assert again.view("s").system == "Topic: math" and again.seed == 3


def test_the_per_job_context_is_a_leaf() -> None:
    assert _runtime_imports("_core/_context") == set()


def test_imports_run_one_way_rollout_report_conversation() -> None:
    # Conversation.rollout imports rollouts._rollout lazily, so neither that module nor what it imports may
    # import interlens.conversation at run time: that would be a cycle.
    assert not _touches(_runtime_imports("rollouts/_rollout"), "interlens.conversation")
    assert not _touches(_runtime_imports("report/_report"), "interlens.conversation")
    assert not _touches(_runtime_imports("report/_report"), "interlens.rollouts")
    ups = {
        m
        for m in _runtime_imports("conversation/_conversation")
        if m.startswith(("interlens.rollouts", "interlens.report"))
    }
    assert ups == {"interlens.rollouts._rollout"}


def _touches(modules: set[str], package: str) -> bool:
    return any(m == package or m.startswith(package + ".") for m in modules)


def _runtime_imports(module: str) -> set[str]:
    """The ``interlens`` modules ``module`` (a path below ``interlens/``, without ``.py``) imports at run
    time, as absolute names (lazy ones included, TYPE_CHECKING not)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    package = ["interlens", *module.split("/")[:-1]]
    skipped = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            out.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("interlens"):
            out.add(node.module or "")
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("interlens")}
    return out
