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
    parser.add_argument("--same", action="store_true", help="every row the same question (no row padded)")
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
        chat = [{"role": "user", "content": QUESTIONS[0 if args.same else i % len(QUESTIONS)]}]
        ids = tuple(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
        requests.append(GenerationRequest(ids, max_new_tokens=args.max_new, temperature=0.9, seed=i))
    print(f"{label}, {dtype}, {args.rows} rows, max_new_tokens {args.max_new}; CPU: {cpu_summary()}")
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
