"""A two-model debate, rolled out 16 times with checkpointing: the spec's first example, runnable offline.

    python examples/debate_rollout.py [MODEL_ID_OR_PATH] [--out runs/tabs_spaces]

Without a model argument it builds a tiny random-weight Qwen2 model locally (interlens.testing.tiny_model),
so the text is gibberish but every moving part is real: lazy participants, co-stepped batched generation,
shared prefill on turn 1, the SQLite ledger, resume. Run it twice: the second run skips every finished job.
"""

from __future__ import annotations

import argparse

from interlens import AutoModelParticipant, Conversation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("--out", default="runs/tabs_spaces", help="out_dir for the ledger (resumable)")
    parser.add_argument("-n", type=int, default=16, help="number of rollouts")
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")

    conv = Conversation(
        participants=[
            AutoModelParticipant.from_pretrained(args.model, name="a", temperature=0.9, max_new_tokens=32),
            AutoModelParticipant.from_pretrained(args.model, name="b", temperature=0.9, max_new_tokens=32),
        ],
        shared_context="Debate: tabs vs spaces.",
    ).turns(6)

    report = conv.rollout(n=args.n, out_dir=args.out, seed=0)
    for job_id, res in report.results.items():
        if res.error is None:
            print(job_id, "→", repr(res.transcript[-1].content[:60]), f"({res.tokens_generated} tokens)")
    print("failed:", report.failed, "skipped(resumed):", len(report.skipped))


if __name__ == "__main__":
    main()
