"""Decode steps over the written slots only vs over the whole preallocated static cache (issue 26 item 6).

    python benchmarks/bench_cache_window.py [--model real] [--rows 16] [--max-new 512] [--repeats 3]

One ``LocalEngine.generate_batch`` of ``--rows`` chat prompts on the real model (dtype: bfloat16 where the CPU
has it), each allowed ``--max-new`` tokens and ending at its own end-of-turn token (as chat turns do, mostly
far below the cap), T = 0.9, seeded. Timed two ways, interleaved after a warm-up of each, in a fresh thread:
the engine as it is (each step attends over the slots written so far, rounded up to ``WINDOW_BLOCK``) and
with the window switched off (``WINDOW_BLOCK`` set past the cache: every step attends over the whole
preallocation, as stock static layers do). Prints tok/s (median (min-max)) and the tokens each way: the
windows change the reduction's length, so a sampled row may part ways after a near-tie; the token counts say
whether both did the same work.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from typing import Any

from _common import add_model_option, cpu_summary, fast_dtype, in_thread, model_path, spread

QUESTIONS = [
    "Tabs or spaces? Give your strongest argument.",
    "Should a code review block on style?",
    "Is a monorepo worth it for a team of five?",
    "When is a global variable acceptable?",
    "Explain why tests that cannot fail are a defect.",
    "Is Python's GIL still a problem?",
    "What makes an error message good?",
    "Should APIs take keyword-only arguments?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(parser)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    print("command:", shlex.join(["python", *sys.argv]))
    path, label = model_path(parser, args.model)
    dtype = fast_dtype(args.dtype)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine import _narrow_cache
    from interlens.engine._generation import GenerationRequest, LocalEngine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = LocalEngine(model, tokenizer, device="cpu", kv_reuse_capacity=0)
    requests = []
    for i in range(args.rows):
        chat = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        ids = tuple(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
        requests.append(GenerationRequest(ids, max_new_tokens=args.max_new, temperature=0.9, seed=i))
    print(f"{label}, {dtype}, {args.rows} rows, max_new_tokens {args.max_new}; CPU: {cpu_summary()}")
    block = _narrow_cache.WINDOW_BLOCK

    def run(narrowed: bool) -> tuple[float, int, int]:
        _narrow_cache.WINDOW_BLOCK = block if narrowed else 10**9
        try:
            start = time.perf_counter()
            results: list[Any] = engine.generate_batch(requests)
            seconds = time.perf_counter() - start
        finally:
            _narrow_cache.WINDOW_BLOCK = block
        tokens = sum(r.n_tokens for r in results)
        return tokens / seconds, tokens, max(r.n_tokens for r in results)

    rates: dict[bool, list[float]] = {True: [], False: []}
    work: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for narrowed in (True, False):
        in_thread(lambda n=narrowed: run(n))  # warm-up
    for _ in range(args.repeats):
        for narrowed in (True, False):
            rate, tokens, longest = in_thread(lambda n=narrowed: run(n))
            rates[narrowed].append(rate)
            work[narrowed].append((tokens, longest))
    for narrowed, name in ((True, "written slots"), (False, "whole cache")):
        print(f"  {name:13s} {spread(rates[narrowed])} tok/s; (tokens, longest row) per run {work[narrowed]}")
    ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    print(f"  written / whole = {spread(ratios, '.2f')} (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
