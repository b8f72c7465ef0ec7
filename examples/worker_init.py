"""``register_worker_init``: heavy per-worker set-up (a probe, a classifier) done ONCE per device worker.

    python examples/worker_init.py [--model ID_OR_PATH] [--devices cpu cpu] [-n 6] [--out runs/worker_init]

The init function runs once in each worker before its first job; what it loads into a module global is what
the analyzers registered in this script read, in that worker (each worker imports this script as spawn
does, so the global, the init and the analyzer are the worker's own copies). Here the "classifier" is a
keyword scorer standing in for something costly to load (a reward model, a probe's weights on the GPU); each
analysis says which process loaded it and how often the init ran there: once.

Offline the workers are two CPU processes; on a GPU machine pass ``--devices cuda:0 cuda:1``. With a single
device the init runs once in this process at the start of the run.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Any

from interlens import (
    AutoModelParticipant,
    Conversation,
    ScriptedParticipant,
    register_analyzer,
    register_worker_init,
)

CLASSIFIER: dict[str, Any] | None = None  # set by the init hook, in each worker
INIT_CALLS = 0


@register_worker_init
def load_classifier() -> None:
    """Runs once per worker before its first job (in a real script: load weights onto the worker's GPU)."""
    global CLASSIFIER, INIT_CALLS
    INIT_CALLS += 1
    CLASSIFIER = {"loaded_in_pid": os.getpid(), "positive": {"yes", "agree", "good", "true"}}


def classify(conv: Conversation) -> dict[str, Any]:
    assert CLASSIFIER is not None, "the worker init hook did not run"
    words = conv.transcript[-1].content.lower().split()
    hits = sum(w.strip(".,!?") in CLASSIFIER["positive"] for w in words)
    return {
        "positive_words": hits,
        "classifier_loaded_in": CLASSIFIER["loaded_in_pid"],
        "init_calls_in_this_worker": INIT_CALLS,
    }


register_analyzer("classify", classify)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu"], help="one worker per device")
    parser.add_argument("-n", "--n", type=int, default=6, help="number of rollouts")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="token cap per turn")
    parser.add_argument("--out", default="runs/worker_init", help="out_dir for the ledger (resumable)")
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")

    model = AutoModelParticipant.from_pretrained(args.model, name="model", max_new_tokens=args.max_new_tokens)
    host = ScriptedParticipant("host", ["Do you agree that tests are good?", "Say yes or no."])
    conv = Conversation([host, model], shared_context="A short interview.").turns(4).analyzer("classify")
    report = conv.rollout(n=args.n, devices=args.devices, out_dir=args.out, seed=0)

    for job_id, res in report.results.items():
        print(f"{job_id}: {res.analysis}")
    per_worker = Counter(a["classifier_loaded_in"] for a in report.analyses().values())
    inits = {a["classifier_loaded_in"]: a["init_calls_in_this_worker"] for a in report.analyses().values()}
    print(f"jobs per classifier process: {dict(per_worker)}; init calls per process: {inits}")
    print(f"this process ran the init {INIT_CALLS} time(s); failed: {len(report.failed)}")


if __name__ == "__main__":
    main()
