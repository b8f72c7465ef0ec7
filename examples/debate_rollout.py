"""A two-model debate, rolled out many times with checkpointing: the spec's first example, runnable offline.

    python examples/debate_rollout.py [--model ID_OR_PATH] [--out runs/tabs_spaces] [-n 16] [--turns 6]

Without ``--model`` it builds a tiny random-weight Qwen2 model locally (interlens.testing.tiny_model), so the
text is gibberish but every moving part is real: lazy participants, co-stepped batched generation, shared
prefill on turn 1, the SQLite ledger, resume. Run it twice: the second run skips every finished job
("skipped(resumed): 16"). With a real model (``--model Qwen/Qwen2.5-3B-Instruct``) the weights load once and
both participants share them.
"""

from __future__ import annotations

import argparse

from interlens import AutoModelParticipant, Conversation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    parser.add_argument("--model", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("--out", default="runs/tabs_spaces", help="out_dir for the ledger (resumable)")
    parser.add_argument("-n", "--n", type=int, default=16, help="number of rollouts")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="token cap per turn")
    args = parser.parse_args()
    model = args.model or args.model_arg
    if model is None:
        from interlens.testing import tiny_model

        model = tiny_model("qwen2")

    conv = Conversation(
        participants=[
            AutoModelParticipant.from_pretrained(
                model, name="a", temperature=0.9, max_new_tokens=args.max_new_tokens
            ),
            AutoModelParticipant.from_pretrained(
                model, name="b", temperature=0.9, max_new_tokens=args.max_new_tokens
            ),
        ],
        shared_context="Debate: tabs vs spaces.",  # scenario framing is a constructor field
    ).turns(args.turns)  # rollout/data fields use dot-modifier sugar

    report = conv.rollout(
        n=args.n,
        devices=None,  # None: every visible GPU, else this process's CPU
        out_dir=args.out,  # checkpoints each conversation: a rerun resumes
        seed=0,  # per-rollout seeds are seed, seed+1, ...
    )
    for job_id, res in report.results.items():
        if res.error is None and res.transcript is not None:
            print(job_id, "→", repr(res.transcript[-1].content[:60]), f"({res.tokens_generated} tokens)")
    print("failed:", report.failed, "skipped(resumed):", len(report.skipped))


if __name__ == "__main__":
    main()
