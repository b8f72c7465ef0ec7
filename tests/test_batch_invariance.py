"""Deterministic rows co-step only where the engine's batch-invariance self-test passed (_batch_invariance).

On this CPU the stock kernels are NOT batch-invariant for the tiny models (float32: a matmul of 18 rows
rounds differently from one of 9; bfloat16: the same, now and then, after rounding), so the self-test says
no and deterministic rows run alone. The co-stepping path is exercised with batch-invariant kernels, which
are the outside world's to provide: :class:`_InvariantKernels` computes linear layers, matmuls and softmax
with running-sum reductions (one fixed order per output element, whatever the batch, its padding or the
cache length). The failing case uses a forward hook that adds batch-size-dependent noise to the logits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import AutoModelParticipant, Conversation, RunReport
from interlens._generation import GenerationRequest, GenerationResult, LocalEngine
from interlens._model_cache import clear_engine_cache, load_engine
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

DET = ExecutionMode.DETERMINISTIC
_TEXTS = ("hi", "Debate: tabs versus spaces, strongest argument first.", "2 + 2?", "Explain castling.")
_FAMILY = "gemma2"  # eager attention by default: its matmuls and softmax go through the kernels below


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as one running sum: one order for every element; exact zeros change nothing."""
    return (a.float() * b.float()).cumsum(-1)[..., -1]


class _InvariantKernels(TorchFunctionMode):
    """Batch-invariant linear / matmul / softmax (slow, exact): what a batch-invariant kernel library does."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = _dot(x.unsqueeze(-2), weight)
            return (out if bias is None else out + bias.float()).to(x.dtype)
        if func is torch.matmul or func is torch.Tensor.__matmul__:
            a, b = args
            return _dot(a.unsqueeze(-2), b.transpose(-1, -2).unsqueeze(-3)).to(a.dtype)
        if func is F.softmax:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            x = x if kwargs.get("dtype") is None else x.to(kwargs["dtype"])
            e = (x - x.amax(dim, keepdim=True)).exp()
            return e / e.cumsum(dim).narrow(dim, e.shape[dim] - 1, 1)
        return func(*args, **kwargs)


def _invariant(model: Any) -> Any:
    forward = model.forward

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _InvariantKernels():  # entered in the thread that runs the forward pass
            return forward(*args, **kwargs)

    model.forward = wrapped
    return model


def _engine(*, invariant: bool) -> LocalEngine:
    path = tiny_model(_FAMILY)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return LocalEngine(
        _invariant(model) if invariant else model, AutoTokenizer.from_pretrained(path), device="cpu"
    )


def _requests(engine: LocalEngine) -> list[GenerationRequest]:
    out = []
    for i, text in enumerate(_TEXTS):
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        out.append(GenerationRequest(ids, max_new_tokens=6 + 3 * i, temperature=0.9, seed=40 + i))
    return out


def _ok(results: list[Any]) -> list[GenerationResult]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return results


def test_a_batch_invariant_engine_co_steps_deterministic_rows_token_identical_to_alone() -> None:
    engine = _engine(invariant=True)
    requests = _requests(engine)
    together = _ok(engine.generate_batch(requests, mode=DET))
    assert engine.batch_invariant is True
    assert [(r.batch_size, r.batch_invariant, r.shared_prefill) for r in together] == [(4, True, False)] * 4
    alone = [_ok(engine.generate_batch([q], mode=DET))[0] for q in requests]
    assert [r.batch_size for r in alone] == [1] * 4
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({len(r.token_ids) for r in together}) > 1  # rows left the batch at different steps


def test_the_stock_cpu_kernels_fail_the_self_test_and_deterministic_rows_run_alone() -> None:
    engine = _engine(invariant=False)
    results = _ok(engine.generate_batch(_requests(engine), mode=DET))
    assert engine.batch_invariant is False
    assert [(r.batch_size, r.batch_invariant) for r in results] == [(1, False)] * 4


def test_batch_dependent_logits_fail_the_self_test_and_deterministic_rows_run_alone() -> None:
    engine = _engine(invariant=True)
    # the outside world's kernel: logits that depend on how many rows share the forward pass
    engine.model.lm_head.register_forward_hook(lambda _m, _i, out: out + 0.25 * (out.shape[0] - 1))
    requests = _requests(engine)
    results = _ok(engine.generate_batch(requests, mode=DET))
    assert engine.batch_invariant is False
    assert [(r.batch_size, r.batch_invariant) for r in results] == [(1, False)] * 4
    batched = _ok(engine.generate_batch(requests))  # batched mode still co-steps, and says what was found
    assert [(r.batch_size, r.batch_invariant) for r in batched] == [(4, False)] * 4


def test_batched_mode_does_not_run_the_self_test() -> None:
    engine = _engine(invariant=True)
    results = _ok(engine.generate_batch(_requests(engine)))
    assert [r.batch_invariant for r in results] == [None] * 4
    assert engine._batch_invariant is None


def _debate() -> Conversation:
    path = tiny_model(_FAMILY)
    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=12)
    b = AutoModelParticipant.from_pretrained(path, name="b", max_new_tokens=12)
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(4)


def _texts(report: RunReport) -> dict[str, list[str]]:
    return {job: [m.content for m in r.transcript] for job, r in report.results.items()}


def test_a_deterministic_rollout_co_steps_and_equals_each_job_run_alone() -> None:
    clear_engine_cache()
    try:
        _invariant(load_engine(tiny_model(_FAMILY)).model)  # the run's engine (the process-wide cache)
        conv = _debate()
        together = conv.rollout(n=6, devices=["cpu"], seed=9, batched=False, progress=False)
        metas = [m.metadata for r in together.results.values() for m in r.transcript[1:]]
        assert max(m["batch_size"] for m in metas) > 1
        assert all(m["batched"] == (m["batch_size"] > 1) and m["batch_invariant"] is True for m in metas)
        single = conv.rollout(n=6, devices=["cpu"], seed=9, batched=False, progress=False, max_batch_size=1)
        assert {m.metadata["batch_size"] for r in single.results.values() for m in r.transcript[1:]} == {1}
        assert _texts(together) == _texts(single)
    finally:
        clear_engine_cache()


def test_a_deterministic_rollout_on_stock_kernels_runs_every_turn_alone() -> None:
    clear_engine_cache()
    report = _debate().rollout(n=3, devices=["cpu"], seed=9, batched=False, progress=False)
    metas = [m.metadata for r in report.results.values() for m in r.transcript[1:]]
    assert {(m["batch_size"], m["batched"], m["batch_invariant"]) for m in metas} == {(1, False, False)}
