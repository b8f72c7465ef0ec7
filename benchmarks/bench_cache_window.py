"""Decode steps over the written slots only vs over the whole preallocated static cache (issue 26 item 6).

    python benchmarks/bench_cache_window.py [--model real] [--rows 16] [--max-new 512] [--repeats 3] [--same]

One ``LocalEngine.generate_batch`` of ``--rows`` chat prompts on the real model (dtype: bfloat16 where the CPU
has it), each allowed ``--max-new`` tokens and ending at its own end-of-turn token (as chat turns do, mostly
far below the cap), T = 0.9, seeded. Timed three ways, interleaved after a warm-up of each, in a fresh thread:
the engine as it is (each step attends over the slots written so far: exactly those and with no mask where
no row is padded, else rounded up to ``WINDOW_BLOCK`` under the padding mask), with the window always rounded
and masked (the engine before unpadded batches went mask-free), and with the window switched off (every step
attends over the whole preallocation, as stock static layers do). ``--same`` gives every row the same
question (a rollout's first turn: n copies of one prompt, no row padded); without it the questions differ
in length, the rows are padded, and the first two ways are the same code. Prints tok/s (median (min-max))
and the tokens each way: the windows change the reduction's length, so a sampled row may part ways after a
near-tie; the token counts say whether each did the same work.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import add_batch_options, in_thread, question_batch, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_options(parser, max_new=512)
    parser.add_argument("--same", action="store_true", help="every row the same question (no row padded)")
    args = parser.parse_args()
    engine, prompts = question_batch(parser, args, same=args.same)

    from interlens.engine import _narrow_cache
    from interlens.engine._generation import GenerationRequest, SamplingSettings

    requests = [
        GenerationRequest(p, sampling=SamplingSettings(max_new_tokens=args.max_new, temperature=0.9, seed=i))
        for i, p in enumerate(prompts)
    ]
    block = _narrow_cache.WINDOW_BLOCK
    cache_class, _ = _narrow_cache._classes()
    narrow = cache_class.narrow
    arms = {"as is": (block, True), "rounded+mask": (block, False), "whole cache": (10**9, False)}

    def run(arm: str) -> tuple[float, int, int]:
        window, exact = arms[arm]
        _narrow_cache.WINDOW_BLOCK = window
        if not exact:  # the window rounded and masked even where no row is padded
            cache_class.narrow = lambda self, used, exact=False: narrow(self, used, exact=False)
        try:
            start = time.perf_counter()
            results: list[Any] = engine.generate_batch(requests)
            seconds = time.perf_counter() - start
        finally:
            _narrow_cache.WINDOW_BLOCK = block
            cache_class.narrow = narrow
        tokens = sum(r.n_tokens for r in results)
        return tokens / seconds, tokens, max(r.n_tokens for r in results)

    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    work: dict[str, list[tuple[int, int]]] = {arm: [] for arm in arms}
    for arm in arms:
        in_thread(lambda a=arm: run(a))  # warm-up
    for _ in range(args.repeats):
        for arm in arms:
            rate, tokens, longest = in_thread(lambda a=arm: run(a))
            rates[arm].append(rate)
            work[arm].append((tokens, longest))
    for arm in arms:
        print(f"  {arm:13s} {spread(rates[arm])} tok/s; (tokens, longest row) per run {work[arm]}")
    for arm in ("rounded+mask", "whole cache"):
        ratios = [a / b for a, b in zip(rates["as is"], rates[arm], strict=True)]
        print(f"  as is / {arm} = {spread(ratios, '.2f')} (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
