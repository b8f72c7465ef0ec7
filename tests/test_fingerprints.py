"""Fingerprints pinned: what a rerun compares must not move when the code around it does.

A ledger written by an earlier release is resumed only if each lineup's recipe fingerprint and each job's
input fingerprint come out the same today. These values were computed before the house was re-planned
(subpackages, keyword-only sampling settings) and must stay: a refactor, a moved module or a new setting
with its default that changes them would refuse every old run (or, worse, let a changed question resume).
A new setting is fingerprinted only when a recipe sets it away from its default.
"""

from __future__ import annotations

import json

from interlens import (
    APIParticipant,
    Conversation,
    ExecutionMode,
    ModelParticipant,
    ScriptedParticipant,
    StopStrings,
    TokenBudget,
    dataset_field,
)
from interlens.rollouts._rollout import lineup_spec

RECIPE_FP = "cc5755ac55416b42"
PROMPTS_FP = ["22ef7cdf85c96cd9", "cfcfac78b02f003c"]
ROWS_FP = ["4a5771f0622c5ea4", "eae7429b2baa7389"]


def _recipe() -> Conversation:
    return (
        Conversation(
            participants=[
                ModelParticipant(
                    "org/model",
                    name="a",
                    temperature=0.7,
                    top_p=0.9,
                    max_new_tokens=32,
                    stop=["###"],
                    dtype="float32",
                ),
                APIParticipant(
                    name="b", provider="openai", model_id="gpt-4o-mini", temperature=0.2, max_tokens=64
                ),
                ScriptedParticipant("c", ["ok", "fine"]),
            ],
            shared_context=("Debate: ", dataset_field("topic"), "."),
            shared_system_prompt="Be brief.",
        )
        .turns(4)
        .run_until(StopStrings("DONE"), TokenBudget(500))
        .data([{"topic": "tabs"}, {"topic": "spaces"}])
        .name("pinned")
    )


def test_the_recipe_fingerprint_is_pinned() -> None:
    assert _recipe().fingerprint() == RECIPE_FP


def test_each_jobs_input_fingerprint_is_pinned() -> None:
    for mode in (ExecutionMode.BATCHED, ExecutionMode.DETERMINISTIC):
        spec = lineup_spec(
            _recipe(), None, seed=7, mode=mode, prefix="pinned/", single_job_id=None, lineup="pinned"
        )
        jobs = list(spec.jobs)
        assert [job.job_id for job in jobs] == ["pinned/row_00000", "pinned/row_00001"]
        assert [json.loads(job.input_fp) for job in jobs] == [
            {
                "mode": mode.value,
                "prompts": PROMPTS_FP[i],
                "row": ROWS_FP[i],
                "seed": 7 + i,
                "settings": RECIPE_FP,
            }
            for i in range(2)
        ]


def test_a_new_sampling_setting_at_its_default_leaves_recipes_as_they_were() -> None:
    """The rule that keeps RECIPE_FP: a field added to SamplingSettings (here in a subclass, as min_p
    would be) is written to recipe JSON only when set away from its default."""
    import dataclasses

    import pytest

    from interlens.engine import SamplingSettings

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithMinP(SamplingSettings):
        min_p: float = 0.0

    base = SamplingSettings(max_new_tokens=32, temperature=0.7, top_p=0.9, stop=("###",))
    assert base.to_json() == {"max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "stop": ["###"]}
    assert WithMinP(**base.settings()).to_json() == base.to_json()
    assert WithMinP(**base.settings(), min_p=0.05).to_json() == base.to_json() | {"min_p": 0.05}
    # the first release's settings are written at their defaults too (old fingerprints hold them)
    assert SamplingSettings(max_new_tokens=8).to_json() == {
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": [],
    }
    with pytest.raises(TypeError):
        SamplingSettings(8, 0.7)  # type: ignore[misc]  # keyword-only: no setting is taken by position
