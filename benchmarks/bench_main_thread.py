"""Torch work on the caller's thread and CPU generation in another thread: the trap, and its fix (issue 24).

    python benchmarks/bench_main_thread.py [--op add|matmul|bf16-matmul] [--rounds 1500] [--repeats 5]
    python benchmarks/bench_main_thread.py --debate [--model real] [--repeats 3]

The trap: after the MAIN thread has run an OpenMP parallel region (an elementwise add, an fp32 matmul; not a
bf16 matmul, which takes oneDNN's path), its libgomp thread pool stays, libgomp manages more threads than
there are CPUs and throttles its spin-waiting, and every parallel region of the thread that generates pays a
futex wake-up. The fix: interlens gives the calling thread's pool back (``omp_pause_resource_all``) before it
hands generation to another thread (``interlens.scheduler.release_openmp_pool``; scheduler/_openmp.py).

Default: a decode-step-like loop (a 16-row linear layer of SmolLM2's MLP shape, a sum, an exp over 64 rows of
a 49,152-token vocabulary), each time in a fresh thread as the engine's generation runs: ``--repeats`` times
before the main thread runs ``--op``, after it (the pool kept), and after ``release_openmp_pool()``. Prints
seconds (median (min-max)) and the ratios to "before".

``--debate``: the real thing. A 4-turn debate rollout of 8 conversations on ``--model`` (in-process, the
default), each run after 50 fp32 matmuls on the main thread, interleaved ``--repeats`` times: with the
release switched off (the baseline: interlens before the fix; the benchmark swaps the scheduler's function
for a no-op) and on (what users get). Prints tok/s and the ratio.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time

from _common import add_model_option, cpu_summary, debate, fast_dtype, model_path, spread


def loop(rounds: int) -> float:
    """Seconds of the decode-like loop in a fresh thread."""
    import torch

    out: list[float] = []

    def go() -> None:
        logits = torch.randn(64, 49152)
        rows, weight = torch.randn(16, 576), torch.randn(1536, 576)
        start = time.perf_counter()
        for _ in range(rounds):
            torch.nn.functional.linear(rows, weight).sum()
            logits.exp()
        out.append(time.perf_counter() - start)

    thread = threading.Thread(target=go)
    thread.start()
    thread.join()
    return out[0]


def main_thread_op(op: str) -> None:
    """``op`` a few times on this (the main) thread."""
    import torch

    if op == "add":
        a = torch.randn(4096, 4096)
        for _ in range(5):
            a + a
    else:
        a = torch.randn(512, 512, dtype=torch.bfloat16 if op == "bf16-matmul" else torch.float32)
        for _ in range(50):
            a @ a


def loop_arms(args: argparse.Namespace) -> None:
    from interlens.scheduler import release_openmp_pool

    arms: dict[str, list[float]] = {"before": [loop(args.rounds) for _ in range(args.repeats)]}
    main_thread_op(args.op)
    arms[f"after the main thread's {args.op}"] = [loop(args.rounds) for _ in range(args.repeats)]
    released = release_openmp_pool()
    arms[f"after release_openmp_pool() ({released})"] = [loop(args.rounds) for _ in range(args.repeats)]
    base = statistics.median(arms["before"])
    for name, seconds in arms.items():
        print(f"  {name}: {spread(seconds, '.2f')} s, {statistics.median(seconds) / base:.2f}x before")


def debate_arms(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import interlens.scheduler._threads as threads

    path, label = model_path(parser, args.model)
    dtype = fast_dtype("auto")
    print(f"  {label}, {dtype}")
    conv = debate(path, turns=4, new_tokens=48, dtype=dtype)
    conv.rollout(n=2, seed=0, progress=False)  # load and warm up

    def rate(release: bool) -> float:
        main_thread_op("matmul")  # the pool the trap needs, before each run of either arm
        threads.release_openmp_pool = release_openmp_pool if release else lambda: False
        start = time.perf_counter()
        report = conv.rollout(n=8, seed=1, progress=False)
        tokens = sum(r.transcript.tokens_generated for r in report.results.values())
        return tokens / (time.perf_counter() - start)

    release_openmp_pool = threads.release_openmp_pool
    arms: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):  # interleaved: this machine's drift hits both arms alike
        for release in (False, True):
            arms[release].append(rate(release))
    threads.release_openmp_pool = release_openmp_pool
    ratio = statistics.median(arms[True]) / statistics.median(arms[False])
    print(f"  pool kept (as before the fix): {spread(arms[False])} tok/s")
    print(f"  pool released (interlens now): {spread(arms[True])} tok/s")
    print(f"  released / kept: {ratio:.2f}x (the same seeds: the same tokens in both arms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("add", "matmul", "bf16-matmul"), default="add")
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5, help="runs per arm (--debate: 3 is plenty)")
    parser.add_argument("--debate", action="store_true", help="time a real debate rollout instead")
    add_model_option(parser)
    args = parser.parse_args()
    print("command:", shlex.join(["python", *sys.argv]), f"CPU: {cpu_summary()}")
    if args.debate:
        debate_arms(args, parser)
    else:
        loop_arms(args)


if __name__ == "__main__":
    main()
