"""What the verdict tests and their child process share (tests/test_verdicts.py, scripts/verdict_child.py): an
engine whose runner counts its decode steps (the evidence that a self-test ran, counted, not timed), and the
deterministic batch they ask of it."""

from __future__ import annotations

from typing import Any

import torch

from interlens.engine._decode import ModelRunner
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.scheduler import ExecutionMode

__all__ = ["CountingEngine", "CountingRunner", "counted_requests"]


class CountingRunner(ModelRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.steps += 1
        return super().step(*args, **kwargs)


class CountingEngine(LocalEngine):
    """A LocalEngine whose runner counts its decode steps."""

    _runner_type = CountingRunner

    def steps_of(self, requests: list[GenerationRequest]) -> tuple[int, list[list[int]]]:
        """One deterministic batch: the decode steps it took and each row's tokens."""
        runner = self._runner
        assert isinstance(runner, CountingRunner)
        before = runner.steps
        results = self.generate_batch(requests, mode=ExecutionMode.DETERMINISTIC)
        ok = [r for r in results if isinstance(r, GenerationResult)]
        assert len(ok) == len(results), results
        return runner.steps - before, [list(r.token_ids) for r in ok]


def counted_requests(rows: int) -> list[GenerationRequest]:
    """``rows`` prompts of 3 to 9 ids, 6 seeded new tokens each at T = 0.9."""
    return [
        GenerationRequest(
            [(11 * i + 3 * j + 5) % 200 + 1 for j in range(3 + i % 7)],
            sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=90 + i),
        )
        for i in range(rows)
    ]
