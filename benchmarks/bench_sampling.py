"""Seeded vs unseeded sampling in a batch: what per-row generators cost (issue #9).

Run:  python benchmarks/bench_sampling.py [--repeats 3] [--rows 64] [--new-tokens 64]

Every local turn of a rollout now samples from its own seeded generator, in batched mode too, so a batch
of 64 rows is 64 seeded rows. This measures, side by side in one process:

(a) ``LocalEngine.generate_batch``: 64 chat prompts, 64 new tokens, T=0.9, every row seeded vs no row seeded
    (the shared global RNG), on the "bench" qwen2 tiny model (vocabulary 4,096);
(b) the sampler alone on random logits, 64 rows, at the tiny vocabulary and at a real one (151,936, Qwen2):
    milliseconds per decode step, seeded vs unseeded, with and without top_p.

Medians of ``--repeats`` interleaved runs after a warm-up (the timing helpers of bench_generation.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generation import _MALLOC, _WORDS, _line, _measure, _run


def _part_a(engine: Any, rows: int, new: int, repeats: int) -> None:
    from interlens.engine._generation import GenerationRequest, SamplingSettings

    rng = random.Random(0)
    prompts = []
    for _ in range(rows):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 90)))
        messages = [{"role": "user", "content": f"Debate: tabs vs spaces. {words}"}]
        prompts.append(
            tuple(
                engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            )
        )
    unseeded = [
        GenerationRequest(prompt_ids=p, sampling=SamplingSettings(max_new_tokens=new, temperature=0.9))
        for p in prompts
    ]
    seeded = [
        GenerationRequest(
            prompt_ids=p, sampling=SamplingSettings(max_new_tokens=new, temperature=0.9, seed=i)
        )
        for i, p in enumerate(prompts)
    ]
    print(f"\n(a) generate_batch: {rows} prompts, {new} new tokens, T=0.9")
    figs = _measure(
        {
            "unseeded": lambda: sum(r.n_tokens for r in _run(engine, unseeded)),
            "seeded": lambda: sum(r.n_tokens for r in _run(engine, seeded)),
        },
        repeats,
    )
    print(_line("no row seeded (global RNG)", figs["unseeded"]))
    print(_line("every row seeded", figs["seeded"]))
    rate = {name: fig.tokens / fig.wall for name, fig in figs.items()}
    print(f"  seeded / unseeded tok/s = {rate['seeded'] / rate['unseeded']:.3f}")


def _part_b(rows: int, repeats: int, steps: int) -> None:
    import torch

    from interlens.engine._generation import GenerationRequest, SamplingSettings
    from interlens.engine._sampler import Sampler

    print(f"\n(b) sampler alone, {rows} rows, ms per decode step (median of {repeats} runs x {steps} steps)")
    for vocab in (4096, 151_936):
        logits = torch.randn(rows, vocab) * 3
        for top_p in (1.0, 0.9):
            timings = {}
            for label, seeded in (("unseeded", False), ("seeded", True)):
                requests = [
                    GenerationRequest(
                        prompt_ids=(1,),
                        sampling=SamplingSettings(
                            max_new_tokens=1, temperature=0.9, top_p=top_p, seed=i if seeded else None
                        ),
                    )
                    for i in range(rows)
                ]
                sampler = Sampler([r.sampling for r in requests], "cpu")
                sampler(logits)
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(steps):
                        sampler(logits)
                    runs.append((time.perf_counter() - start) / steps * 1e3)
                timings[label] = statistics.median(runs)
            print(
                f"  vocab {vocab:7d} top_p {top_p}: unseeded {timings['unseeded']:7.1f} ms, "
                f"seeded {timings['seeded']:7.1f} ms ({timings['seeded'] / timings['unseeded']:.2f}x)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="sampler calls per timed run in (b)")
    parser.add_argument("--no-malloc-tuning", action="store_true")
    args = parser.parse_args()
    if not args.no_malloc_tuning and any(os.environ.get(k) != v for k, v in _MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC})

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import LocalEngine
    from interlens.testing import tiny_model

    path = tiny_model("qwen2", size="bench")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    _part_a(engine, args.rows, args.new_tokens, args.repeats)
    _part_b(args.rows, args.repeats, args.steps)


if __name__ == "__main__":
    main()
