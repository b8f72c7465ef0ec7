"""A fresh process's deterministic batch on a tiny model: prints how many decode steps its first and second
batches ran (the first includes the batch-invariance self-test unless a kept verdict served) and the tokens.

Usage: verdict_child.py MODEL_DIR DTYPE ROWS (the verdicts' folder comes from INTERLENS_CACHE_DIR)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens.scheduler import ExecutionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the testkit the tests use too
from verdict_testkit import CountingEngine, CountingRunner, counted_requests


def main() -> None:
    path, dtype, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    engine = CountingEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")
    runner = engine._runner
    assert isinstance(runner, CountingRunner)
    requests = counted_requests(rows)
    steps = []
    tokens = []
    for _ in range(2):
        before = runner.steps
        results = engine.generate_batch(requests, mode=ExecutionMode.DETERMINISTIC)
        steps.append(runner.steps - before)
        tokens.append([list(r.token_ids) for r in results])  # type: ignore[union-attr]
    assert tokens[0] == tokens[1]
    out = {"steps": steps, "tokens": tokens[0], "invariant": engine.batch_invariant}
    print(json.dumps(out | {"sizes": [r.batch_size for r in results]}))  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
