"""A fresh process's deterministic batch on a tiny model: prints how many decode steps its first and second
batches ran (the first includes the batch-invariance self-test unless a kept verdict served) and the tokens.

Usage: verdict_child.py MODEL_DIR DTYPE ROWS (the verdicts' folder comes from INTERLENS_CACHE_DIR)."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens.engine._decode import ModelRunner
from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings
from interlens.scheduler import ExecutionMode


class CountingRunner(ModelRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.steps += 1
        return super().step(*args, **kwargs)


class CountingEngine(LocalEngine):
    _runner_type = CountingRunner


def main() -> None:
    path, dtype, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    engine = CountingEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")
    runner = engine._runner
    assert isinstance(runner, CountingRunner)
    requests = [
        GenerationRequest(
            [(11 * i + 3 * j + 5) % 200 + 1 for j in range(3 + i % 7)],
            sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=90 + i),
        )
        for i in range(rows)
    ]
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
