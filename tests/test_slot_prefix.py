"""Deterministic turns load the prompt blocks an earlier turn prefilled (engine/_slot_prefix.py): a row's
tokens and log-probabilities are bitwise the same with the blocks loaded, computed in a fresh engine, and
computed alone."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens.engine import _slot_rows as slot_rows
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

DET = ExecutionMode.DETERMINISTIC


def _engine(dtype: str) -> LocalEngine:
    path = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")


def _request(ids: list[int], seed: int) -> GenerationRequest:
    sampling = SamplingSettings(max_new_tokens=8, temperature=1.0, seed=seed)
    return GenerationRequest(ids, sampling=sampling, record_logprobs=True)


def _signature(results: list[GenerationResult | Exception]) -> list[tuple[list[int], list[float] | None]]:
    ok = [r for r in results if isinstance(r, GenerationResult)]
    assert len(ok) == len(results), results
    return [(r.token_ids, r.model_logprobs) for r in ok]


def test_a_later_turn_loads_the_blocks_an_earlier_turn_prefilled_and_gets_the_same_tokens(
    co_step_dtype: str,
) -> None:
    engine = _engine(co_step_dtype)
    block = slot_rows.PREFILL_BLOCK
    history = [(11 * j + 5) % 400 + 20 for j in range(2 * block + 7)]  # two full blocks and some
    first = [_request([*history, 3 + r], seed=r) for r in range(3)]
    engine.generate_batch(first, mode=DET)
    store = engine._slots.prefixes
    assert store.misses == 2 and len(store) == 2  # both full blocks, shared: prefilled once, then loaded
    assert store.hits == 3 * 2
    # the next turn: each row's prompt extends the history (three full blocks now, the first two kept)
    later = [_request(history + [3 + r] * (block + 1) + [9, 8 - r], seed=10 + r) for r in range(4)]
    warm = _signature(engine.generate_batch(later, mode=DET))
    assert store.hits == 3 * 2 + 4 * 2  # blocks 0 and 1 loaded for every row; block 2 computed
    fresh = _engine(co_step_dtype)
    cold = _signature(fresh.generate_batch(later, mode=DET))
    # the fresh engine prefilled the two blocks all four prompts start with once, then loaded them per row
    assert (fresh._slots.prefixes.misses, fresh._slots.prefixes.hits) == (2 + 4, 4 * 2)
    alone = [_signature(_engine(co_step_dtype).generate_batch([q], mode=DET))[0] for q in later]
    assert warm == cold == alone
    assert len({tuple(tokens) for tokens, _ in warm}) > 1  # the rows differ: a real comparison


def test_the_store_is_emptied_when_the_kernels_change_and_bounded_by_bytes(co_step_dtype: str) -> None:
    engine = _engine(co_step_dtype)
    block = slot_rows.PREFILL_BLOCK
    prompts = [[(7 * j + r) % 300 + 30 for j in range(3 * block + 2)] for r in range(2)]
    engine.generate_batch([_request(p, seed=1) for p in prompts], mode=DET)
    store = engine._slots.prefixes
    assert len(store) == 2 * 3
    one_block = store._bytes // len(store)
    store.use_kernels((True, False))  # fixed-row linear layers switched on: blocks of other arithmetic
    assert len(store) == 0 and store._bytes == 0
    store.capacity = 4 * one_block
    engine._slots.fixed_linear_rows = False  # back: the store is emptied once more, then refilled
    engine.generate_batch([_request(p, seed=1) for p in prompts], mode=DET)
    assert len(store) == 4 and store._bytes == 4 * one_block  # the least recently kept went first
    engine.release_memory()  # an out-of-memory retry drops the kept blocks too
    assert len(store) == 0 and store._bytes == 0


def test_on_cuda_a_steps_rows_are_padded_to_their_row_bucket_and_stay_there_as_rows_leave() -> None:
    """Every batch of a bucket is one shape (one graph, and the shape the bucket's probe ran); the CPU pads
    to a multiple of ROW_BLOCK only."""
    from interlens.engine._buckets import row_bucket

    assert [slot_rows.padded_rows(n, buckets=True) for n in (1, 3, 5, 9, 17, 25, 100, 256)] == [
        4, 4, 8, 16, 24, 32, 128, 256,
    ]  # fmt: skip
    assert all(slot_rows.padded_rows(n, buckets=True) == max(4, row_bucket(n)) for n in range(1, 257))
    assert [slot_rows.padded_rows(n, buckets=False) for n in (1, 5, 9, 17)] == [4, 8, 12, 20]
    engine = _engine("float32")
    cache = slot_rows.slot_cache(engine.model.config, rows=20, length=8, dtype=torch.float32, buckets=True)
    assert cache.rows == 24
    with torch.inference_mode():
        engine.model(input_ids=torch.ones((20, 4), dtype=torch.long), cache=cache, use_cache=True)
        cache.reorder_cache(torch.arange(17))
    assert cache.rows == 24 and cache.layers[0].keys.shape[0] == 24
    cache.reorder_cache(torch.arange(13))
    assert cache.rows == 16 and cache.layers[0].keys.shape[0] == 16
