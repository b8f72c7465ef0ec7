"""Matched compute with ``TokenBudget``: give a solo model the token budget a pair of models spent.

    python examples/matched_compute.py [--model ID_OR_PATH] [-n 4] [--turns 4] [--out runs/matched]

To compare a solo model against a pair fairly, the solo run gets the pair's spend as its budget.
``TokenBudget`` is a stop condition that stops each conversation once ITS OWN generated tokens reach
``per_conversation``, and caps each turn at ``per_turn`` (and at what is left of the budget):

1. the pair debates for ``--turns`` turns; its mean spend per conversation is measured off the report;
2. the solo recipe is the same conversation with one participant, no turn limit, and that budget;
3. ambient form: ``with TokenBudget(per_conversation=...):`` around any rollout gives EVERY conversation
   in it its own budget (per conversation, not a shared pool).

Counting is free: it sums each turn's recorded ``metadata["n_tokens"]``, never re-tokenizes. The realized
spend is on the report: ``report.results[job_id].tokens_generated``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from interlens import AutoModelParticipant, Conversation, ModelParticipant, TokenBudget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("-n", "--n", type=int, default=4, help="rollouts per recipe")
    parser.add_argument("--turns", type=int, default=4, help="turns of the pair")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="token cap per turn of the pair")
    parser.add_argument("--per-turn", type=int, default=16, help="TokenBudget per_turn of the solo run")
    parser.add_argument("--out", default="runs/matched", help="parent folder of the runs' ledgers")
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")
    out = Path(args.out)

    def speaker(name: str) -> ModelParticipant:
        return AutoModelParticipant.from_pretrained(args.model, name=name, max_new_tokens=args.max_new_tokens)

    conv = Conversation([speaker("a"), speaker("b")], shared_context="Debate: tabs vs spaces.")
    pair = conv.turns(args.turns)  # 2 models
    pair_report = pair.rollout(n=args.n, out_dir=out / "pair", seed=0)
    spends = [res.tokens_generated for res in pair_report.results.values()]
    pair_spend = round(sum(spends) / len(spends))
    print(f"pair: {args.turns} turns, spend per conversation {spends} → budget {pair_spend}")

    solver = speaker("solver")
    solo = (
        conv.set(participants=[solver])
        .turns(None)
        .run_until(TokenBudget(per_conversation=pair_spend, per_turn=args.per_turn))
    )
    solo_report = solo.rollout(n=args.n, out_dir=out / "solo", seed=0)
    for job_id, res in solo_report.results.items():
        assert res.transcript is not None
        turns = [m.n_tokens for m in res.transcript[1:]]
        print(f"solo {job_id}: {res.tokens_generated} tokens (≤ {pair_spend}) in {len(turns)} turns {turns}")

    ambient = args.max_new_tokens  # a small budget: the pair stops early, whatever its turn limit
    with TokenBudget(per_conversation=ambient):
        ambient_report = pair.rollout(n=args.n, out_dir=out / "ambient", seed=0)
    realized = [res.tokens_generated for res in ambient_report.results.values()]
    print(f"ambient TokenBudget(per_conversation={ambient}): each conversation spent {realized}")
    failed = len(pair_report.failed) + len(solo_report.failed) + len(ambient_report.failed)
    print("failed:", failed)


if __name__ == "__main__":
    main()
