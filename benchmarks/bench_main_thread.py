"""Torch work on the main thread slows every later CPU generation in another thread (issue 24, unfixed).

    python benchmarks/bench_main_thread.py [--op add|matmul|bf16-matmul] [--rounds 3000]

Times a decode-step-like loop (a 16-row linear layer of SmolLM2's MLP shape, a sum, an exp over 64 rows of a
49,152-token vocabulary) in a fresh thread, as the engine's generation runs in the rollout's worker thread:
twice before and twice after the MAIN thread runs ``--op`` a few times. Prints seconds, torch threads and the
process's thread count each time.

Measured 2026-12-03 (Intel Xeon, 2 cores, torch 2.13 CPU): 1.98 s before, 2.56 s after an elementwise add or
an fp32 matmul on the main thread; no change after a bf16 matmul (oneDNN's path). With ``GOMP_SPINCOUNT=0``
the loop takes 2.57 s before as well: after the main thread has run an OpenMP parallel region, its thread
pool stays, libgomp then manages more threads than there are CPUs and throttles its spin-waiting, and every
parallel region of the worker thread pays a futex wake-up. ``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000``
(no throttling) recovers part of it (2.40 s). Worker processes (``devices=["cpu", "cpu"]``) are not affected.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
from typing import Any

from _common import cpu_summary


def loop(rounds: int) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}

    def go() -> None:
        logits = torch.randn(64, 49152)
        rows, weight = torch.randn(16, 576), torch.randn(1536, 576)
        start = time.perf_counter()
        for _ in range(rounds):
            torch.nn.functional.linear(rows, weight).sum()
            logits.exp()
        out["seconds"] = round(time.perf_counter() - start, 2)
        out["torch_threads"] = torch.get_num_threads()
        out["process_threads"] = len(os.listdir(f"/proc/{os.getpid()}/task"))

    thread = threading.Thread(target=go)
    thread.start()
    thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("add", "matmul", "bf16-matmul"), default="add")
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    print("command:", shlex.join(["python", *sys.argv]), f"CPU: {cpu_summary()}")
    import torch

    for _ in range(2):
        print("  before:", loop(args.rounds), flush=True)
    if args.op == "add":
        a = torch.randn(4096, 4096)
        for _ in range(5):
            a + a
    else:
        a = torch.randn(512, 512, dtype=torch.bfloat16 if args.op == "bf16-matmul" else torch.float32)
        for _ in range(50):
            a @ a
    for _ in range(2):
        print(f"  after the main thread's {args.op}:", loop(args.rounds), flush=True)


if __name__ == "__main__":
    main()
