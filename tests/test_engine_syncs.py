"""The decode loop waits for the device once a step: to read the chosen tokens, nothing else.

On a GPU every host read of a device value (``.tolist()``, ``.item()``, ``int()``, ``bool()``, ``.cpu()``)
and every copy from pageable host memory to the device (``torch.tensor(list, device=cuda)``) waits for the
stream, so the host cannot queue the next step's kernels while the device runs this one. On the CPU the same
calls are counted as they pass through torch's function dispatch (a ``TorchFunctionMode``), per decode step:
the difference between a batch run for 8 and for 24 tokens, divided by 16 (prefill and setup cancel out).
``benchmarks/gpu_check.py`` counts the real syncs on a GPU (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

#: Tensor methods that read a device value on the host.
HOST_READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})


class CountedCalls(TorchFunctionMode):
    """Counts host reads and ``torch.tensor`` constructions (a host-to-device copy on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS or func is torch.tensor:
            self.calls["to_device" if func is torch.tensor else "host_read"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model() -> tuple[Any, Any]:
    path = tiny_model("qwen2")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def per_step(model: tuple[Any, Any], mode: ExecutionMode, **engine: Any) -> dict[str, float]:
    """Host reads and host-to-device constructions per decode step of a 6-row batch: prompts of different
    lengths (padding), greedy, seeded and unseeded rows, every row running to its token cap."""
    net, tokenizer = model
    calls = []
    for new in (8, 24):
        runner = LocalEngine(net, tokenizer, device="cpu", **engine)
        runner._runner.eos_ids = frozenset()  # every row runs its whole length: no row leaves mid-way
        requests = [
            GenerationRequest(
                prompt_ids=tuple(tokenizer(f"row {i}: {'tabs ' * i}").input_ids),
                sampling=SamplingSettings(
                    max_new_tokens=new,
                    temperature=0 if i == 0 else 0.9,
                    seed=None if i == 1 and mode is ExecutionMode.BATCHED else i,
                ),
            )
            for i in range(6)
        ]
        runner.generate_batch(requests, mode=mode)  # warm: the first call runs one-off checks
        with CountedCalls() as counted:
            results = runner.generate_batch(requests, mode=mode)
        assert all(r.n_tokens == new and r.batch_size == 6 for r in results)  # type: ignore[union-attr]
        calls.append(counted.calls)
    return {key: (calls[1][key] - calls[0][key]) / 16 for key in ("host_read", "to_device")}


def test_a_batched_step_reads_the_device_once(model: tuple[Any, Any]) -> None:
    steps = per_step(model, ExecutionMode.BATCHED)
    assert steps["host_read"] == 1.0  # the chosen tokens
    assert steps["to_device"] <= 1 / 8  # the uniforms, a block of steps at a time


def test_a_deterministic_co_stepped_step_reads_the_device_once(model: tuple[Any, Any]) -> None:
    steps = per_step(model, ExecutionMode.DETERMINISTIC)
    assert steps["host_read"] == 1.0
    assert steps["to_device"] <= 1 / 8
