"""A mixed local + API debate against the local-only run of the same local turns (issue #14). Prints only.

    python benchmarks/bench_mixed.py [--rollouts 16] [--turns 4] [--new-tokens 32] [--latency 0.05]
                                     [--repeats 3] [--threads N] [--dtype auto]

Two rollouts of the same shape, interleaved after one warm-up of each:

* mixed: speaker ``local`` (the bench-size random-weight Qwen2, T = 0.9) and speaker ``hosted``, an
  ``APIParticipant`` (openai, single requests) against ``interlens.testing.FakeProviderServer`` answering
  each request after ``--latency`` seconds; the server runs in its OWN process (in-process its thread would
  fight the rollout for the GIL, see bench_api.py);
* local-only: the same ``local`` speaker and a ``ScriptedParticipant`` answering at once with a reply of the
  same shape, so the local turns (how many, their batches, their tokens) are the same.

The hosted turns of one round run concurrently, so the mixed run can at best take local-only + one latency
per hosted round. Goal: mixed ≤ local-only + 0.2 s (API turns never hold local batches back). Also printed:
the local turns' batch sizes in each run (a local batch that left before every conversation had caught up
would show as smaller batches), and the gap from each hosted round's last reply to the next local batch's
start (from the turns' recorded ``at`` and ``seconds``: a batch held back by the batcher would show here).
Medians of ``--repeats`` with (min–max).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from _common import cpu_summary, fast_dtype, spread

KEY = "sk-bench-not-a-real-key"


def _serve(conn: Connection, latency: float) -> None:
    from interlens.testing._fake_provider import FakeProviderServer

    with FakeProviderServer(latency=latency) as server:
        conn.send(server.env(api_key=KEY))
        while conn.recv() != "stop":
            conn.send({"requests": len(server.requests), "errors": len(server.handler_errors)})


def conversations(path: str, args: argparse.Namespace) -> tuple[Any, Any]:
    from interlens import AutoModelParticipant, Conversation, ScriptedParticipant
    from interlens.participants._api_participant import APIParticipant

    local = AutoModelParticipant.from_pretrained(
        path, name="local", temperature=0.9, max_new_tokens=args.new_tokens, dtype=args.dtype
    )
    hosted = APIParticipant(
        name="hosted", provider="openai", model_id="bench-model", system_prompt="Disagree."
    )
    # the fake server answers "reply to <the last user message's first 40 chars> [<8 hex digits>]"; the script
    # answers the same shape at once
    scripted = ScriptedParticipant(
        "hosted",
        lambda view: f"reply to {' '.join(view.messages[-1].content.split())[:40]} [0123abcd]",
        system_prompt="Disagree.",
    )
    context = "Debate: tabs vs spaces."
    mixed = Conversation([local, hosted], shared_context=context).turns(args.turns)
    alone = Conversation([local, scripted], shared_context=context).turns(args.turns)
    return mixed, alone


def timed(conv: Any, n: int) -> tuple[float, list[int], int, list[float]]:
    """Wall seconds, the local turns' batch sizes, tokens generated locally, and for each local turn after a
    hosted round the gap from that round's LAST reply to the local batch's start (run in a fresh thread:
    the main thread's torch ops are slower on a loaded VM, see bench_rollout.py)."""
    out: list[Any] = []

    def target() -> None:
        with tempfile.TemporaryDirectory() as out_dir:
            start = time.perf_counter()
            report = conv.rollout(n=n, devices=["cpu"], out_dir=out_dir, progress=False, seed=1)
            seconds = time.perf_counter() - start
            assert not report.failed, [report.results[j].error for j in report.failed[:3]]
            transcripts = [list(r.transcript[1:]) for r in report.results.values()]
        local = [m for t in transcripts for m in t if m.author == "local"]
        gaps = []
        for k in range(2, len(transcripts[0]), 2):  # a local turn after a hosted one
            if any("at" not in t[k - 1].metadata for t in transcripts):
                break  # scripted replies carry no time
            last_reply = max(t[k - 1].metadata["at"] for t in transcripts)
            batch_start = min(t[k].metadata["at"] - t[k].metadata["seconds"] for t in transcripts)
            gaps.append(batch_start - last_reply)
        sizes = sorted({m.metadata["batch_size"] for m in local})
        out.append((seconds, sizes, sum(m.n_tokens for m in local), gaps))

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the rollout failed (see the traceback above)")
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware has it, else fp32")
    args = parser.parse_args()
    args.dtype = fast_dtype(args.dtype)
    print("command:", shlex.join(["python", *sys.argv]))

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(theirs, args.latency), daemon=True)
    server.start()
    os.environ.update(ours.recv())

    import torch

    from interlens.testing import tiny_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = tiny_model("qwen2", size="bench")
    mixed, alone = conversations(path, args)
    hosted_rounds = args.turns // 2
    print(
        f"{args.rollouts} rollouts x {args.turns} turns (local first), {args.new_tokens} new tokens a local "
        f"turn, {hosted_rounds} hosted rounds at {args.latency * 1000:.0f} ms, "
        f"{torch.get_num_threads()} torch threads, {args.dtype}; CPU: {cpu_summary()}"
    )
    runs: dict[str, list[tuple[float, list[int], int, list[float]]]] = {"local-only": [], "mixed": []}
    timed(alone, args.rollouts)  # warm-ups
    timed(mixed, args.rollouts)
    for _ in range(args.repeats):
        runs["local-only"].append(timed(alone, args.rollouts))
        runs["mixed"].append(timed(mixed, args.rollouts))
    for name, rs in runs.items():
        sizes = sorted({s for _, batch, _, _ in rs for s in batch})
        walls = spread([r[0] for r in rs], ".2f")
        print(f"  {name:10s} wall {walls} s; local tokens {rs[-1][2]}; local batch sizes {sizes}")
    extra = [m[0] - a[0] for a, m in zip(runs["local-only"], runs["mixed"], strict=True)]
    floor = hosted_rounds * args.latency
    print(f"  mixed - local-only = {spread(extra, '.2f')} s per run (floor {floor:.2f} s; goal <= 0.20 s)")
    gaps = [g * 1000 for r in runs["mixed"] for g in r[3]]
    if gaps:
        print(
            "  mixed: a hosted round's last reply -> the next local batch's start: median "
            f"{statistics.median(gaps):.1f} ms, max {max(gaps):.1f} ms ({len(gaps)} rounds; a batch held "
            "back would show as a long gap)"
        )
    ours.send("meters")
    meters = ours.recv()
    print(f"  fake server: {meters['requests']} requests, {meters['errors']} handler errors")
    ours.send("stop")
    server.join(timeout=10)


if __name__ == "__main__":
    main()
