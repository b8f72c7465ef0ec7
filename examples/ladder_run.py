"""``interlens.run``: a ladder of lineups (model pair, solo, data-driven quiz per model) in ONE pool.

    python examples/ladder_run.py [--models ID_OR_PATH ...] [--out runs/ladder]

Handing every lineup to one ``run`` keeps the devices packed across lineups (no idle tail between
sequential rollouts) under one ``out_dir`` and one resume namespace. Job ids are namespaced by each
conversation's ``.name()``: a lineup without data is ONE job named after it (``pair_qwen2``), a lineup with
data gets one job per row (``quiz_qwen2/row_00000``, ...). Lineups that share a model batch together on
its device; a one-off lineup runs as a singleton.

Without ``--models`` the ladder has two rungs of tiny random-weight models built locally (a qwen2 and a
llama); with ``--models Qwen/Qwen2.5-0.5B-Instruct Qwen/Qwen2.5-1.5B-Instruct`` it climbs real ones. Rerun
the same command: every job is skipped (resumed from the ledger).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

from interlens import AutoModelParticipant, Conversation, ModelParticipant, dataset_field, run

QUIZ = [
    {"q": "What is 6 times 7?"},
    {"q": "Name a prime number above 10."},
    {"q": "Which is heavier, a kilo of iron or a kilo of feathers?"},
]


def label(model: str) -> str:
    """A short lineup tag for a model id or path (lineup names become job-id prefixes)."""
    name = Path(model).name.lower()
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")[:24]


def rung(model: str, tag: str, max_new_tokens: int, turns: int) -> list[Conversation]:
    """The lineups of one rung: a debate pair, a solo speaker, and a data-driven quiz."""

    def speaker(name: str, system_prompt: str | None = None) -> ModelParticipant:
        return AutoModelParticipant.from_pretrained(
            model, name=name, system_prompt=system_prompt, max_new_tokens=max_new_tokens
        )

    topic = "Debate: should code be reviewed before merging?"
    pair = Conversation([speaker("a"), speaker("b")], shared_context=topic).turns(turns)
    solo = Conversation([speaker("solo")], shared_context=topic).turns(max(turns // 2, 1))
    solver = speaker("solver", "Answer in one line.")
    quiz = Conversation([solver], shared_context=dataset_field("q")).turns(1)
    return [pair.name(f"pair_{tag}"), solo.name(f"solo_{tag}"), quiz.data(QUIZ).name(f"quiz_{tag}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", help="hub ids or local paths, one rung each (default: tiny)")
    parser.add_argument("--out", default="runs/ladder", help="out_dir for the ledger (resumable)")
    parser.add_argument("--turns", type=int, default=4, help="turns of the pair lineups")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="token cap per turn")
    args = parser.parse_args()
    if args.models:
        models = {label(m): m for m in args.models}
    else:
        from interlens.testing import tiny_model

        models = {family: tiny_model(family) for family in ("qwen2", "llama")}

    lineups = [
        conv for tag, model in models.items() for conv in rung(model, tag, args.max_new_tokens, args.turns)
    ]
    report = run(lineups, devices=None, out_dir=args.out, resume=True)

    per_lineup: dict[str, list[str]] = defaultdict(list)
    for job_id in report.results:
        per_lineup[job_id.split("/")[0]].append(job_id)
    print(f"{'lineup':<16} {'jobs':>4} {'tokens':>7}  first job id")
    for lineup, job_ids in per_lineup.items():
        tokens = sum(report.results[j].tokens_generated for j in job_ids)
        print(f"{lineup:<16} {len(job_ids):>4} {tokens:>7}  {job_ids[0]}")
    print(f"jobs: {len(report.results)}  failed: {len(report.failed)}", end="  ")
    print(f"skipped(resumed): {len(report.skipped)}")


if __name__ == "__main__":
    main()
