"""Deterministic vs batched rollout throughput on the 4-turn debate, side by side (issue #14).

    python benchmarks/bench_deterministic.py [--rollouts 16] [--turns 4] [--new-tokens 32] [--repeats 3]
        [--slot-steps]

The same two-speaker debate (one local Qwen2, random weights, T = 0.9), rolled out ``--rollouts`` times
``batched=True`` and ``batched=False``, interleaved (batched, deterministic, batched, ...) after one warm-up
of each. Deterministic turns co-step only where the engine's batch-invariance self-test passed
(``interlens.engine._batch_invariance``); the script prints the verdict for this model, device and dtype,
what the self-test costs, and the turns' batch sizes, so the ratio can be read for what it is. Prints
generated tok/s, medians with (min-max) spread, and the ratio deterministic / batched (goal >= 0.8x).
With ``--slot-steps`` a third side runs the deterministic turns through the static slot steps
(``interlens/engine/_slot_decode.py``: CUDA's graph path, eager steps on the CPU), interleaved with the two
others, and the ratio static / eager slot steps is printed too.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import cpu_summary, debate, fast_dtype

from interlens import Conversation
from interlens.testing import tiny_model


def run_once(
    conv: Conversation, n: int, *, batched: bool, engine: Any = None
) -> tuple[float, int, set[int], set[Any]]:
    if engine is not None and not batched:  # a new store: the repeats' prompts are the same (one seed), and
        # an earlier repeat's kept prompt blocks would serve every turn (engine/_slot_prefix.py)
        from interlens.engine._slot_prefix import PrefixStore

        engine._slots.prefixes = PrefixStore(block=engine._slots.prefixes.block)
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        report = conv.rollout(n=n, devices=["cpu"], out_dir=out_dir, progress=False, batched=batched, seed=1)
        seconds = time.perf_counter() - start
        assert not report.failed, report.failed
        metas = [m.metadata for r in report.results.values() for m in r.transcript[1:]]
        tokens = sum(r.tokens_generated for r in report.results.values())
    return seconds, tokens, {m["batch_size"] for m in metas}, {m.get("batch_invariant") for m in metas}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=0, help="each speaker's system prompt, tokens")
    parser.add_argument("--family", default="qwen2")
    parser.add_argument(
        "--model", help="a model directory, or 'real' for SmolLM2-135M-Instruct (default: the tiny --family)"
    )
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware has it, else fp32")
    parser.add_argument(
        "--keep-prefixes",
        action="store_true",
        help="deterministic runs keep the prompt blocks earlier repeats prefilled (by default each starts "
        "with an empty store: the repeats' prompts are identical)",
    )
    parser.add_argument(
        "--slot-steps",
        action="store_true",
        help="also time the deterministic turns through the static slot steps (CUDA's graph path)",
    )
    parser.add_argument(
        "--no-kv-reuse",
        action="store_true",
        help="both modes prefill every turn in full (deterministic turns never reuse a kept KV cache): the "
        "ratio then measures the co-stepped kernels alone",
    )
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    if args.model == "real":
        from interlens.testing import REAL_MODEL_INSTALL, real_model

        found = real_model()
        if found is None:
            parser.error(f"--model real needs the real model: {REAL_MODEL_INSTALL}")
        path = str(found)
    elif args.model:
        path = args.model
    else:
        path = tiny_model(args.family, size="bench") if args.family == "qwen2" else tiny_model(args.family)
    args.dtype = fast_dtype(args.dtype)
    print(f"model: {path}; dtype {args.dtype}; CPU: {cpu_summary()}")
    conv = debate(
        path,
        new_tokens=args.new_tokens,
        turns=args.turns,
        dtype=args.dtype,
        kv_reuse=not args.no_kv_reuse,
        system_tokens=args.system_tokens,
    )

    from interlens.engine._model_cache import load_engine

    engine = load_engine(path, dtype=args.dtype)
    start = time.perf_counter()
    verdict = engine.batch_invariant
    chunked = engine._slots.fixed_linear_rows
    print(
        f"self-test: batch_invariant={verdict} ({time.perf_counter() - start:.3f} s)"
        + ("; linear layers in fixed-row chunks (the stock kernels failed it)" if chunked else "")
    )

    static = None
    if args.slot_steps:
        from interlens.engine._batch_invariance import batch_invariant
        from interlens.engine._slot_decode import SlotDecoder

        static = SlotDecoder(engine._runner)
        engine._slots.decoder = static
        import torch

        with torch.inference_mode():
            print(f"self-test through the static slot steps: {batch_invariant(engine._slots)}")
        engine._slots.decoder = None
    sides = {"batched=True ": (True, None), "batched=False": (False, None)}
    if static is not None:
        sides["batched=False, static slot steps"] = (False, static)
    runs: dict[str, list[tuple[float, int]]] = {label: [] for label in sides}
    seen: dict[str, tuple[set[int], set[Any]]] = {}
    fresh = None if args.keep_prefixes else engine
    for batched, decoder in sides.values():
        engine._slots.decoder = decoder
        run_once(conv, args.rollouts, batched=batched, engine=fresh)  # warm-up
    for _ in range(args.repeats):
        for label, (batched, decoder) in sides.items():
            engine._slots.decoder = decoder
            seconds, tokens, sizes, invariant = run_once(conv, args.rollouts, batched=batched, engine=fresh)
            runs[label].append((seconds, tokens))
            seen[label] = (sizes, invariant)
    rates = {label: [tok / s for s, tok in r] for label, r in runs.items()}
    for label, r in rates.items():
        sizes, invariant = seen[label]
        print(
            f"  {label}: {statistics.median(r):7.1f} tok/s (min {min(r):.1f}, max {max(r):.1f}); "
            f"batch sizes {sorted(sizes)}; batch_invariant {sorted(map(str, invariant))}"
        )
    store = engine._slots.prefixes
    print(f"  prompt blocks of the last deterministic run: {store.hits} loaded, {store.misses} prefilled")
    ratio = statistics.median(rates["batched=False"]) / statistics.median(rates["batched=True "])
    print(f"  deterministic / batched = {ratio:.2f}x   (goal >= 0.8x)")
    if static is not None:
        label = "batched=False, static slot steps"
        steps = statistics.median(rates[label]) / statistics.median(rates["batched=False"])
        print(f"  static / eager slot steps = {steps:.2f}x; the static steps ran: {dict(static.stats)}")


if __name__ == "__main__":
    main()
