"""Each generated token's log-probabilities, recorded by the engine (issue 27, its first part).

The reference is computed here from the model's own forward pass on the prompt and the generated tokens
(plain transformers, none of the engine's code): the log-softmax of the logits for the model's distribution,
and the temperature- and nucleus-restricted distribution for the one the token was drawn from. Float32 tiny
models: the engine's batched arithmetic differs from one forward pass only in rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens._core._exceptions import ConfigurationTypeError
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

#: (prompt words, temperature, top_p): a greedy row, plain sampling rows, nucleus rows, in one batch
_ROWS = ((1, 0.0, 1.0), (4, 0.7, 1.0), (7, 1.0, 0.9), (2, 1.3, 0.5), (5, 1.0, 1.0))


def _engine(family: str = "qwen2", **settings: Any) -> LocalEngine:
    path = tiny_model(family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu", **settings)


def _prompt(engine: LocalEngine, text: str) -> tuple[int, ...]:
    chat = [{"role": "user", "content": text}]
    return tuple(engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))


def _requests(engine: LocalEngine, *, record: bool = True, **extra: Any) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_ids=_prompt(engine, "tabs or spaces " * n),
            sampling=SamplingSettings(max_new_tokens=10 + n, temperature=t, top_p=p, seed=n),
            record_logprobs=record,
            **extra,
        )
        for n, t, p in _ROWS
    ]


def _ok(results: Sequence[GenerationResult | Exception]) -> list[GenerationResult]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return [r for r in results if isinstance(r, GenerationResult)]


def _reference(engine: LocalEngine, request: GenerationRequest, tokens: list[int]) -> tuple[list[float], ...]:
    """The tokens' log-probabilities from one forward pass of prompt + tokens: under the model's
    distribution, and under the one the sampler drew from (greedy: certain, 0.0)."""
    ids = torch.tensor([[*request.prompt_ids, *tokens]])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(request.prompt_ids) - 1 : -1].float()
    chosen = torch.tensor(tokens)
    model = logits.log_softmax(-1).gather(1, chosen[:, None]).squeeze(1)
    if request.sampling.temperature <= 0:
        return model.tolist(), [0.0] * len(tokens)
    probs = (logits / request.sampling.temperature).softmax(-1)
    if request.sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)
        kept = (ordered.cumsum(-1) < request.sampling.top_p).roll(1, -1)
        kept[:, 0] = True  # every token below top_p, and the one that reaches it
        nucleus = torch.zeros_like(probs).scatter(1, order, ordered * kept)
        probs = nucleus / nucleus.sum(-1, keepdim=True)
    return model.tolist(), probs.gather(1, chosen[:, None]).squeeze(1).log().tolist()


def _close(got: Sequence[float] | None, want: Sequence[float], tol: float = 1e-4) -> bool:
    if got is None or len(got) != len(want):
        return False
    return max(abs(a - b) for a, b in zip(got, want, strict=True)) < tol


def test_recorded_logprobs_equal_one_forward_pass_of_the_generated_tokens() -> None:
    engine = _engine()
    requests = _requests(engine)
    results = _ok(engine.generate_batch(requests))
    assert results[0].batch_size == len(_ROWS)
    for request, result in zip(requests, results, strict=True):
        model, sampling = _reference(engine, request, result.token_ids)
        assert result.n_tokens == len(result.model_logprobs or ()) == len(result.sampling_logprobs or ())
        assert _close(result.model_logprobs, model), (result.model_logprobs, model)
        assert _close(result.sampling_logprobs, sampling), (result.sampling_logprobs, sampling)
        assert engine.tokenizer.decode(result.token_ids, skip_special_tokens=True) == result.text
    greedy, hot, nucleus = results[0], results[3], results[2]
    assert greedy.sampling_logprobs == [0.0] * greedy.n_tokens
    assert hot.sampling_logprobs != hot.model_logprobs  # temperature 1.3 changes the distribution
    # top_p < 1: the nucleus's share is renormalised away, so each token was likelier than the model says
    assert all(
        s >= m for s, m in zip(nucleus.sampling_logprobs or (), nucleus.model_logprobs or (), strict=True)
    )
    plain = results[4]  # temperature 1, every token: the two distributions are the model's
    assert _close(plain.sampling_logprobs, plain.model_logprobs or (), 1e-5)


def test_recording_changes_no_token_and_rows_that_did_not_ask_get_none() -> None:
    engine = _engine()
    recorded = _ok(engine.generate_batch(_requests(engine)))
    plain = _ok(engine.generate_batch(_requests(engine, record=False)))
    assert [r.token_ids for r in recorded] == [r.token_ids for r in plain]
    assert all(r.model_logprobs is None and r.sampling_logprobs is None for r in plain)
    mixed = _requests(engine)
    mixed[1] = _requests(engine, record=False)[1]
    results = _ok(engine.generate_batch(mixed))
    assert results[1].model_logprobs is None and results[0].model_logprobs is not None
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


def test_a_turn_on_its_kept_cache_records_what_a_full_prefill_would() -> None:
    """KV reuse: the second turn of each stream runs on its kept cache (its prompt's KV laid out, not
    prefilled again); its recorded log-probabilities still equal a forward pass of the whole prompt."""
    engine = _engine()
    first = _requests(engine)
    first = [
        GenerationRequest(
            prompt_ids=r.prompt_ids, sampling=r.sampling, reuse_key=f"s{i}", record_logprobs=True
        )
        for i, r in enumerate(first)
    ]
    done = _ok(engine.generate_batch(first))
    more = tuple(engine.tokenizer(" and the other side?", add_special_tokens=False).input_ids)
    second = [
        GenerationRequest(
            prompt_ids=(*r.prompt_ids, *d.token_ids, *more),
            sampling=r.sampling,
            reuse_key=r.reuse_key,
            record_logprobs=True,
        )
        for r, d in zip(first, done, strict=True)
    ]
    results = _ok(engine.generate_batch(second))
    assert all(r.kv_reused_tokens > 0 for r in results)
    for request, result in zip(second, results, strict=True):
        model, sampling = _reference(engine, request, result.token_ids)
        assert _close(result.model_logprobs, model) and _close(result.sampling_logprobs, sampling)


def test_deterministic_rows_record_bitwise_what_they_record_alone() -> None:
    engine = _engine()
    det = ExecutionMode.DETERMINISTIC
    requests = _requests(engine)
    together = _ok(engine.generate_batch(requests, mode=det))
    assert engine.batch_invariant and together[0].batch_size == len(requests)  # the rows co-stepped
    for request, result in zip(requests, together, strict=True):
        (alone,) = _ok(engine.generate_batch([request], mode=det))
        assert alone.token_ids == result.token_ids
        assert alone.model_logprobs == result.model_logprobs
        assert alone.sampling_logprobs == result.sampling_logprobs
        model, _ = _reference(engine, request, result.token_ids)
        assert _close(result.model_logprobs, model)


def test_record_logprobs_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationTypeError, match=r"record_logprobs='yes'\): must be True or False"):
        GenerationRequest(
            prompt_ids=(1, 2),
            sampling=SamplingSettings(max_new_tokens=2),
            record_logprobs="yes",  # type: ignore[arg-type]
        )
