"""A fresh process's first deterministic rollout with no kept self-test verdict vs with one (issue #37).

    python benchmarks/bench_verdict_cache.py [--model real] [--rollouts 16] [--turns 4] [--new-tokens 24]
        [--repeats 3]

Each measurement is a new Python process (``--child``) that builds the debate and times its first
``batched=False`` rollout: "cold" with an empty verdict folder (``INTERLENS_CACHE_DIR`` pointed at a fresh
temporary directory: the engine runs its batch-invariance self-test first), "warm" with the folder a first
process filled (the engine reads its verdict, ``interlens.engine._verdicts``). Cold and warm alternate; prints
each run, then medians with (min-max) spread and the saving.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from _common import cpu_summary, debate, fast_dtype


def child(path: str, dtype: str, rollouts: int, turns: int, new_tokens: int) -> None:
    conv = debate(path, new_tokens=new_tokens, turns=turns, dtype=dtype, kv_reuse=True)
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        report = conv.rollout(
            n=rollouts, devices=["cpu"], out_dir=out_dir, progress=False, batched=False, seed=1
        )
        seconds = time.perf_counter() - start
        assert not report.failed, report.failed
        metas = [m.metadata for r in report.results.values() for m in (r.transcript or [])[1:]]
        tokens = sum(r.tokens_generated for r in report.results.values())
    sizes = sorted({m["batch_size"] for m in metas})
    print(json.dumps({"seconds": seconds, "tokens": tokens, "sizes": sizes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model", default="real", help="a model directory, or 'real' (SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware has it, else fp32")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = args.model
    if path == "real":
        from interlens.testing import REAL_MODEL_INSTALL, real_model

        found = real_model()
        if found is None:
            parser.error(f"--model real needs the real model: {REAL_MODEL_INSTALL}")
        path = str(found)
    dtype = fast_dtype(args.dtype)
    if args.child:
        child(path, dtype, args.rollouts, args.turns, args.new_tokens)
        return
    print("command:", shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"model: {path}; dtype {dtype}; CPU: {cpu_summary()}")
    shape = [
        "--rollouts",
        str(args.rollouts),
        "--turns",
        str(args.turns),
        "--new-tokens",
        str(args.new_tokens),
    ]
    command = [sys.executable, __file__, "--child", "--model", path, "--dtype", dtype, *shape]

    def measure(cache: str) -> dict[str, object]:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=os.environ | {"INTERLENS_CACHE_DIR": cache},
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    runs: dict[str, list[float]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as root:
        kept = os.path.join(root, "kept")
        first = measure(kept)  # fills the verdict folder the warm runs read
        print(f"  filling run: {first['seconds']:.1f} s, batch sizes {first['sizes']}")
        for i in range(args.repeats):
            for kind in ("cold", "warm"):
                got = measure(os.path.join(root, f"cold{i}") if kind == "cold" else kept)
                runs[kind].append(float(got["seconds"]))  # type: ignore[arg-type]
                print(f"  {kind}: {got['seconds']:.1f} s, {got['tokens']} tokens, batch sizes {got['sizes']}")
    cold, warm = statistics.median(runs["cold"]), statistics.median(runs["warm"])
    for kind in ("cold", "warm"):
        r = runs[kind]
        print(
            f"  first rollout, {kind} verdicts: {statistics.median(r):.1f} s "
            f"(min {min(r):.1f}, max {max(r):.1f})"
        )
    print(f"  saved by the kept verdict: {cold - warm:.1f} s ({warm / cold:.2f}x the cold time)")


if __name__ == "__main__":
    main()
