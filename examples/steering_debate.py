"""Find a direction, steer one debater with it across a rollout, read a probe on the other every turn.

    python examples/steering_debate.py [MODEL_ID_OR_PATH] [--out runs/steering_debate] [-n 8] [--coef 4]

1. Direction: capture the residual stream of the model answering two small sets of prompts (agreeable vs
   hostile) and take the difference of their means at one layer.
2. Steer: debater "a" carries ``SteeringSpec(direction, layers=[L], coef=...)`` on every turn of a
   deterministic rollout (``batched=False``, the interp path); an unsteered lineup runs beside it.
3. Probe: an analyzer re-reads debater "b"'s turns (``conv.turn_activations``) inside the worker that holds
   the model and returns one probe scalar per turn; only those floats travel through the ledger.

The effect printed at the end is the probe on "b" (who is NOT steered) when "a" is steered vs not: how much
of "a"'s steered stance leaks into "b"'s replies. Without a model argument it builds a tiny random-weight
Qwen2 model locally, so the numbers are noise, but every moving part is real. Rerun it: finished jobs resume.
"""

from __future__ import annotations

import argparse
import statistics

from interlens import AutoModelParticipant, Conversation, ModelParticipant, Probe, SteeringSpec

AGREEABLE = ["I agree with you completely.", "What a kind and thoughtful idea.", "Thank you, that helps."]
HOSTILE = ["That is a stupid idea.", "I completely disagree with you.", "You are wrong, again."]


def find_direction(model_path: str, layer: int) -> tuple[SteeringSpec, Probe]:
    """Difference of means of the answers' residual stream at ``layer``, between the two prompt sets."""
    speaker = AutoModelParticipant.from_pretrained(model_path, name="m", max_new_tokens=12, seed=0)
    conv = Conversation([speaker], shared_context="Reply to the user in one sentence.")
    conv.step()
    with conv.capture(layers=[layer]) as agreeable:
        for prompt in AGREEABLE:
            conv.sample("m", prompt)
    with conv.capture(layers=[layer]) as hostile:
        for prompt in HOSTILE:
            conv.sample("m", prompt)
    steering = SteeringSpec.difference_of_means(list(agreeable), list(hostile), layers=[layer], coef=1.0)
    probe = Probe.difference_of_means(list(agreeable), list(hostile), layer=layer)
    return steering, probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("--out", default="runs/steering_debate", help="out_dir for the ledger (resumable)")
    parser.add_argument("-n", type=int, default=8, help="rollouts per lineup")
    parser.add_argument("--layer", type=int, default=None, help="decoder layer (default: the middle one)")
    parser.add_argument("--coef", type=float, default=4.0, help="steering strength")
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")
    if args.layer is None:
        from transformers import AutoConfig

        args.layer = AutoConfig.from_pretrained(args.model).num_hidden_layers // 2

    direction, probe = find_direction(args.model, args.layer)
    steering = SteeringSpec(direction.direction, layers=[args.layer], coef=args.coef)
    print("direction:", steering)

    def read_probe(conv: Conversation) -> dict[str, float]:
        cache = conv.turn_activations("b", layers=[probe.layer])
        return {str(idx): value for idx, value in probe.per_turn(cache).items()}

    def debate(a: ModelParticipant, name: str) -> Conversation:
        b = AutoModelParticipant.from_pretrained(args.model, name="b", max_new_tokens=24)
        return (
            Conversation([a, b], shared_context="Debate: should cities ban cars from their centres?")
            .turns(6)
            .analyzer(read_probe)
            .name(name)
        )

    a = AutoModelParticipant.from_pretrained(args.model, name="a", max_new_tokens=24)
    for lineup, speaker in (("plain", a), ("steered", a.set(steering=steering))):
        report = debate(speaker, lineup).rollout(
            n=args.n, out_dir=f"{args.out}/{lineup}", batched=False, seed=0, progress=False
        )
        scores = [value for result in report.results.values() for value in (result.analysis or {}).values()]
        spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
        print(
            f"{lineup:>8}: probe on b = {statistics.fmean(scores):+.3f} ± {spread:.3f} over "
            f"{len(scores)} turns (failed {len(report.failed)}, resumed {len(report.skipped)})"
        )


if __name__ == "__main__":
    main()
