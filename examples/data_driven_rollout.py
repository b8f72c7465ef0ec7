"""A data-driven rollout: one conversation per dataset row, its prompts templated from the row's columns.

    python examples/data_driven_rollout.py [--model ID_OR_PATH] [--out runs/motions] [--streaming]

A benchmark is N different scenarios, not N copies. The rows here are a few debate motions in a
``datasets.Dataset``; every template form is used once:

- ``shared_context``: a tuple, ``("Motion: ", dataset_field("motion"))``, joined per row;
- participant ``a``'s ``system_prompt``: a callable ``row -> str``;
- participant ``b``'s ``system_prompt``: a plain ``str``;
- the analyzer reads ``conv.row["motion_id"]``, side data that never reaches the models' view.

``n`` defaults to ``len(data)``; job ids are ``row_00000``, ``row_00001``, ... (row i ⟷ job i, so resume stays
correct). ``--streaming`` passes the same rows as an ``IterableDataset`` (what ``load_dataset(...,
streaming=True)`` returns): nothing else changes. Without ``--model`` a tiny random-weight model speaks.
"""

from __future__ import annotations

import argparse
from typing import Any

from interlens import AutoModelParticipant, Conversation, dataset_field

MOTIONS = [
    {"motion_id": "M1", "motion": "Tabs are better than spaces.", "side": "for"},
    {"motion_id": "M2", "motion": "Code review slows teams down.", "side": "against"},
    {"motion_id": "M3", "motion": "Every function needs a docstring.", "side": "for"},
    {"motion_id": "M4", "motion": "Monorepos beat many small repositories.", "side": "against"},
]


def side_prompt(row: dict[str, Any]) -> str:
    """A callable template: called once per row when the rollout expands its jobs."""
    return f"You argue {row['side']} the motion. Two sentences at most."


def summarize(conv: Conversation) -> dict[str, Any]:
    """conv.row is the dataset row that produced this conversation (a dict), read here, never templated."""
    row = conv.row
    assert row is not None  # a job of a data-driven rollout always has its row
    return {"motion_id": row["motion_id"], "turns": len(conv.transcript), "tokens": conv.tokens_generated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("--out", default="runs/motions", help="out_dir for the ledger (resumable)")
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="token cap per turn")
    parser.add_argument("--streaming", action="store_true", help="pass the rows as an IterableDataset")
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")

    from datasets import Dataset

    data: Any = Dataset.from_list(MOTIONS)
    if args.streaming:
        data = data.to_iterable_dataset()  # no len(): n is "every row"

    a = AutoModelParticipant.from_pretrained(
        args.model, name="a", system_prompt=side_prompt, max_new_tokens=args.max_new_tokens
    )
    b = AutoModelParticipant.from_pretrained(
        args.model, name="b", system_prompt="You take the other side.", max_new_tokens=args.max_new_tokens
    )
    conv = (
        Conversation(participants=[a, b], shared_context=("Motion: ", dataset_field("motion")))
        .turns(args.turns)
        .data(data)
        .analyzer(summarize)
    )
    report = conv.rollout(out_dir=args.out, seed=0)  # n defaults to len(data)

    for job_id, res in report.results.items():
        if res.error is not None or res.transcript is None:
            print(job_id, "failed:", res.error)
            continue
        framing = res.transcript[0].content  # the resolved shared context of this row
        print(f"{job_id}  {framing!r:52} analysis={res.analysis}")
    print(f"jobs: {len(report.results)}  failed: {len(report.failed)}", end="  ")
    print(f"skipped(resumed): {len(report.skipped)}")


if __name__ == "__main__":
    main()
