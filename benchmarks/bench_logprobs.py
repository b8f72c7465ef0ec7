"""What recording each token's log-probabilities costs a batch (issue 27: at most 5 % of batched throughput).

    python benchmarks/bench_logprobs.py [--model real] [--rows 16] [--max-new 128] [--repeats 3]
    python benchmarks/bench_logprobs.py --ledger [--model real] [--ledger-tokens 64]

``--ledger`` measures the records' size instead: 16 debates x 8 turns x up to ``--ledger-tokens`` tokens
(``_common.debate``, T = 0.9) run into a fresh ledger with ``record_tokens`` off and on; prints each
ledger's size after ``VACUUM``, the turns' text, the records (their ``turn_tokens`` rows' bytes and the
markers their turns keep: schema 5) and what the records add.

One ``LocalEngine.generate_batch`` of ``--rows`` chat questions on the real model (dtype: bfloat16 where
the CPU has it), each allowed ``--max-new`` tokens and ending at its own end-of-turn token, T = 0.9, seeded.
Timed with ``record_logprobs`` off and on, interleaved after a warm-up of each, each run in a fresh thread.
Recording changes no token (the tokens of every run are compared), so both ways do the same work but the
recording: a log-sum-exp over each row's logits per step, and one read of the values per batch. Prints
tok/s (median (min-max)) each way and the ratio. This machine's noise between runs is larger than the cost,
so the sampler's step is timed on its own too (``Sampler.choose`` on the batch's rows x the model's vocabulary
in the model's dtype, 200 calls, recording off and on): the added milliseconds against the batch's step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import (
    add_batch_options,
    cpu_summary,
    debate,
    fast_dtype,
    in_thread,
    model_path,
    question_batch,
    spread,
)


def ledger_sizes(path: str, dtype: str, new_tokens: int) -> None:
    """The ``--ledger`` measurement (see the module docstring)."""
    import json
    import os
    import sqlite3
    import tempfile

    sizes = {}
    for record in (False, True):
        with tempfile.TemporaryDirectory() as out:
            conv = debate(path, turns=8, new_tokens=new_tokens, dtype=dtype, record_tokens=record)
            conv.rollout(n=16, out_dir=out, seed=1)
            db = sqlite3.connect(os.path.join(out, "ledger.sqlite"))
            turns = [json.loads(text) for (text,) in db.execute("SELECT turn_json FROM turns")]
            # Schema 5 (issue 40): the records' bytes are in turn_tokens, a marker in each turn's JSON.
            table = sum(
                n or 0
                for (n,) in db.execute(
                    "SELECT length(facts_json) + length(ids) + length(model_logprobs) "
                    "+ coalesce(length(sampling_logprobs), 0) + length(prompt_ids) FROM turn_tokens"
                )
            )
            db.execute("VACUUM")
            db.close()  # the write-ahead log folded in: the files' size is the ledger's
            size = sum(
                os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.startswith("ledger")
            )
        text = sum(len(t["content"].encode()) for t in turns)
        markers = sum(len(json.dumps(t["metadata"]["tokens"])) for t in turns if "tokens" in t["metadata"])
        records = table + markers
        tokens = sum(t["metadata"].get("n_tokens", 0) for t in turns)
        sizes[record] = size
        print(
            f"  record_tokens={record}: ledger {size / 1024:.0f} KiB; turn text {text / 1024:.0f} KiB; "
            f"records {records / 1024:.0f} KiB ({records / text:.1f}x the text); {tokens} tokens"
        )
    print(
        f"  the records grow the ledger by {(sizes[True] - sizes[False]) / 1024:.0f} KiB: "
        f"{(sizes[True] - sizes[False]) / sizes[False]:.2f}x the ledger without them, "
        f"{(sizes[True] - sizes[False]) / text:.1f}x the turns' text"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_options(parser, max_new=128)
    parser.add_argument("--ledger", action="store_true", help="measure the records' size in the ledger")
    parser.add_argument("--ledger-tokens", type=int, default=64, help="--ledger: tokens per turn at most")
    args = parser.parse_args()
    if args.ledger:
        path, label = model_path(parser, args.model)
        dtype = fast_dtype(args.dtype)
        print(f"{label}, {dtype}; CPU: {cpu_summary()}")
        ledger_sizes(path, dtype, args.ledger_tokens)
        return
    engine, prompts = question_batch(parser, args)

    import torch

    from interlens.engine._generation import GenerationRequest

    model = engine.model

    def run(record: bool) -> tuple[float, list[tuple[int, ...]]]:
        requests = [
            GenerationRequest(
                p,
                sampling=SamplingSettings(max_new_tokens=args.max_new, temperature=0.9, seed=i),
                record_logprobs=record,
            )
            for i, p in enumerate(prompts)
        ]
        start = time.perf_counter()
        results: list[Any] = engine.generate_batch(requests)
        seconds = time.perf_counter() - start
        return sum(r.n_tokens for r in results) / seconds, [tuple(r.token_ids) for r in results]

    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, set[Any]] = {False: set(), True: set()}
    for record in (False, True):
        in_thread(lambda r=record: run(r))  # warm-up
    for _ in range(args.repeats):
        for record in (False, True):
            rate, ids = in_thread(lambda r=record: run(r))
            rates[record].append(rate)
            tokens[record].add(tuple(ids))
    from interlens.engine._sampler import Sampler
    from interlens.engine._sampling import SamplingSettings

    logits = torch.randn(args.rows, model.config.vocab_size).to(model.dtype)
    settings = [SamplingSettings(max_new_tokens=1, temperature=0.9, seed=i) for i in range(args.rows)]

    def choose(record: bool) -> float:
        sampler = Sampler(settings, "cpu", record=record)
        start = time.perf_counter()
        for _ in range(200):
            sampler.choose(logits)
        return (time.perf_counter() - start) / 200 * 1000

    step_ms = {
        record: statistics.median(in_thread(lambda r=record: choose(r)) for _ in range(3))
        for record in (False, True)
    }
    same = tokens[False] == tokens[True] and len(tokens[True]) == 1
    total = sum(len(t) for t in next(iter(tokens[True])))
    for record, name in ((False, "not recorded"), (True, "recorded")):
        print(f"  {name:12s} {spread(rates[record])} tok/s")
    ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    print(f"  recorded / not = {spread(ratios, '.3f')} (median {statistics.median(ratios):.3f}x)")
    print(f"  {total} tokens a run; the same tokens every run, both ways: {same}")
    steps = max(len(t) for t in next(iter(tokens[True])))  # the batch's decode steps: its longest row's
    batch_ms = 1000 * total / statistics.median(rates[False]) / steps
    added = step_ms[True] - step_ms[False]
    print(
        f"  sampler step: {step_ms[False]:.2f} ms, recording {step_ms[True]:.2f} ms (+{added:.2f} ms) "
        f"against a batch step of ~{batch_ms:.0f} ms: {100 * added / batch_ms:.1f} % (3 x 200 calls)"
    )


if __name__ == "__main__":
    main()
