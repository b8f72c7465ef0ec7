"""Analyzers: measure each finished conversation while its models are resident, on one device and on several.

    python examples/analyzers_multi_device.py [--model ID_OR_PATH] [--devices cpu cpu] [-n 4] [--out runs/x]

An analyzer runs inside the worker right after its conversation finishes, so it can ``sample`` a follow-up
from a live participant; only its JSON-serializable return value is kept (``RunResult.analysis``).

1. In-process (one device): any callable works, a closure over local variables included.
2. Several devices (one spawned worker process each): spawned workers inherit no parent state, so the
   analyzer is registered by NAME at import time with ``register_analyzer`` and attached as
   ``.analyzer("stance_probe")``; each worker imports this script (as spawn does) and finds it.

Offline the "several devices" are two CPU worker processes (``devices=["cpu", "cpu"]``); on a GPU machine
pass ``--devices cuda:0 cuda:1`` (or ``--devices all``: every visible GPU) and ``--model`` a real model.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from interlens import AutoModelParticipant, Conversation, register_analyzer


def stance_probe(conv: Conversation) -> dict[str, Any]:
    """Ask participant a one more question, off the record (the transcript is not changed)."""
    return {"a": conv.sample("a", "One word stance?").content.strip()[:24], "worker_pid": os.getpid()}


register_analyzer("stance_probe", stance_probe)  # at module import: spawned workers register it too


def debate(model: str, max_new_tokens: int, turns: int) -> Conversation:
    a = AutoModelParticipant.from_pretrained(model, name="a", temperature=0.9, max_new_tokens=max_new_tokens)
    b = AutoModelParticipant.from_pretrained(model, name="b", temperature=0.9, max_new_tokens=max_new_tokens)
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="hub id or local path (default: a tiny local test model)")
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu"], help="devices of part 2, or 'all'")
    parser.add_argument("-n", "--n", type=int, default=4, help="rollouts per part")
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="token cap per turn")
    parser.add_argument("--out", default="runs/analyzers", help="parent folder of the two runs' ledgers")
    args = parser.parse_args()
    if args.model is None:
        from interlens.testing import tiny_model

        args.model = tiny_model("qwen2")
    conv = debate(args.model, args.max_new_tokens, args.turns)
    out = Path(args.out)

    # 1. One device, this process: a closure is fine.
    question = "One word: your final stance?"

    def summarize(conv: Conversation) -> dict[str, Any]:
        return {"n_turns": len(conv.transcript), "a_stance": conv.sample("a", question).content.strip()[:24]}

    report = conv.analyzer(summarize).rollout(n=args.n, out_dir=out / "in_process", seed=0)
    print("in-process analyzer (a closure):")
    for job_id, res in report.results.items():
        print(f"  {job_id} on {res.device}: {res.analysis}")

    # 2. Several devices, one worker process each: the analyzer is found by its registered name.
    devices = None if args.devices == ["all"] else args.devices
    report = conv.analyzer("stance_probe").rollout(n=args.n, devices=devices, out_dir=out / "devices", seed=0)
    print(f"registered analyzer on devices={args.devices}:")
    for job_id, res in report.results.items():
        print(f"  {job_id} on {res.device}: {res.analysis}")
    pids = {res.analysis["worker_pid"] for res in report.results.values() if res.analysis}
    me = os.getpid()
    print(f"worker processes used: {len(pids)} (this process: {me} not among them: {me not in pids})")
    print("failed:", len(report.failed))


if __name__ == "__main__":
    main()
