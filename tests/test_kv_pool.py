"""The engine's one KV pool (``engine/_kv_pool.py``) as the only KV storage of a static batch, on the CPU.

Every prefill path of a static batch (one left-padded block, identical prompts, a shared prefix, length
groups, kept KV laid out) writes straight into views of the pool: no cache layer allocates storage of its
own (transformers' cache layers' initialisations counted), the decoder finds every batch's prompt KV in the
pool (none copied in), and a row's KV in the pool is its prompt's KV computed alone. Tokens and
log-probabilities stay the eager loop's (``test_static_decode.same``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from test_static_decode import engines, ids, requests, same
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from interlens.engine._buckets import length_bucket
from interlens.engine._generation import (
    GenerationRequest,
    GenerationResult,
    LocalEngine,
    SamplingSettings,
    token_budget_estimate,
)
from interlens.engine._slot_decode import SlotDecoder
from interlens.engine._static_decode import ENV_SWITCH, StaticDecoder
from interlens.scheduler import ExecutionMode


@pytest.fixture(scope="module")
def loaded(qwen2_path: str) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(qwen2_path).eval(), AutoTokenizer.from_pretrained(qwen2_path)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    return count_allocations(monkeypatch)


def count_allocations(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the KV storage transformers' cache layers allocate for themselves (a static layer's lazy or
    early initialisation, a dynamic layer's first update): every KV tensor a batch could make outside the
    pool."""
    counts: Counter[str] = Counter()
    for cls in (StaticLayer, DynamicLayer):
        original = cls.lazy_initialization

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = cls.__name__) -> Any:
            counts[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(cls, "lazy_initialization", counted)
    return counts


def prompt_kv(model: Any, prompt: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) of ``prompt`` prefilled alone, (kv heads, tokens, head dim)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def test_every_prefill_path_writes_into_the_pool_and_allocates_no_kv(
    loaded: tuple[Any, Any], allocations: Counter[str]
) -> None:
    """One left-padded block, identical prompts, rows sharing a long prefix next to a lone row, and length
    groups: the eager engine's batches allocate their caches, the static engine's none (the same tokens),
    and each batch's prompt KV was found in the pool by the decoder, none copied in."""
    tokenizer = loaded[1]
    eager, static, decoder = engines(loaded)
    head = ids(tokenizer, "A long shared system block. " * 6)
    cases = {
        "block": [ids(tokenizer, f"row {i} opens " + "tabs " * i) for i in range(3)],
        "twins": [ids(tokenizer, "the same prompt")] * 3 + [ids(tokenizer, "another one")],
        "prefix": [(*head, *ids(tokenizer, "x " * i)) for i in range(1, 4)] + [ids(tokenizer, "alone")],
        "groups": [ids(tokenizer, "w " * (1 + 12 * (i % 4) * (i % 3))) for i in range(9)],
    }
    for name, prompts in cases.items():
        new = [5 + i % 3 for i in range(len(prompts))]
        before = sum(allocations.values())
        expected = eager.generate_batch(requests(prompts, new=new))
        assert sum(allocations.values()) > before, name  # the eager loop's own cache (the count works)
        before = sum(allocations.values())
        got = static.generate_batch(requests(prompts, new=new))
        assert sum(allocations.values()) == before, name
        same(got, expected)
        if name == "prefix":
            assert sum(r.shared_prefix_tokens > 0 for r in got if isinstance(r, GenerationResult)) == 3
        if name == "twins":
            assert [r.shared_prefix_tokens for r in got if isinstance(r, GenerationResult)][:3] != [0, 0, 0]
    assert decoder.stats["prefills: in the pool"] == len(cases)
    assert decoder.stats["prefills: copied in"] == 0


def test_the_prefills_kv_lies_in_the_pool(loaded: tuple[Any, Any]) -> None:
    """After a batch whose rows all end at their cap together (no hand-over moves them), each row's prompt
    slots in the pool hold its prompt's KV as a prefill of it alone computes it."""
    model, tokenizer = loaded
    _, static, decoder = engines(loaded)
    prompts = [ids(tokenizer, f"row {i} opens " + "tabs " * (2 * i)) for i in range(3)]
    got = static.generate_batch(requests(prompts, new=[4, 4, 4]))
    assert [r.n_tokens for r in got if isinstance(r, GenerationResult)] == [4, 4, 4]
    width = max(len(p) for p in prompts)
    length = length_bucket(width + 4, quantum=decoder.quantum)
    pool = decoder.pool.span(0, len(prompts), length=length, width=width)
    for row, prompt in enumerate(prompts):
        alone = prompt_kv(model, prompt)
        for layer, (keys, values) in zip(pool.layers, alone, strict=True):
            torch.testing.assert_close(layer.keys[row, :, width - len(prompt) :], keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(
                layer.values[row, :, width - len(prompt) :], values, atol=1e-5, rtol=1e-4
            )


def test_kept_kv_is_laid_out_in_the_pool(loaded: tuple[Any, Any], allocations: Counter[str]) -> None:
    """Two turns of four streams and two rows without one: the second turn reuses kept KV and lays it
    straight into the pool, the fresh rows (one longer than every new suffix: prefilled apart) in a range
    of rows after the kept ones, no cache allocated, the eager engine's tokens."""
    eager, static, decoder = engines(loaded)
    eager._reused.always_reuse = static._reused.always_reuse = True
    tokenizer = loaded[1]
    keys = [None, "a", "b", "c", None, "d"]
    prompts = [ids(tokenizer, f"stream {i} opens " + "with words " * i) for i in range(4)]
    prompts.insert(3, ids(tokenizer, "a fresh row " * 2))
    prompts.insert(0, ids(tokenizer, "hi"))
    for turn in range(2):
        batch = [
            GenerationRequest(prompt_ids=p, sampling=r.sampling, reuse_key=k, record_logprobs=True)
            for p, r, k in zip(prompts, requests(prompts, new=[1, 5, 7, 6, 5, 8]), keys, strict=True)
        ]
        expected = eager.generate_batch(batch)
        before = sum(allocations.values())
        got = static.generate_batch(batch)
        assert sum(allocations.values()) == before
        same(got, expected)
        if turn:
            assert sum(r.kv_reused_tokens > 0 for r in got if isinstance(r, GenerationResult)) == 4
        words = ids(tokenizer, " and then")
        prompts = [  # the rows without a stream keep their prompts: the short one sorts among the kept ones
            (*p, *r.token_ids[:-1], *words) if k else p  # type: ignore[union-attr]
            for p, r, k in zip(prompts, got, keys, strict=True)
        ]
    assert decoder.stats["prefills: copied in"] == 0 and decoder.stats["prefills: in the pool"] == 2


# ------------------------------------------------------------------------------ the pool sized from a budget


def test_a_batch_past_the_pool_is_split_and_gives_the_eager_tokens(loaded: tuple[Any, Any]) -> None:
    """A pool of 128 slots (4 rows x one 32-slot length bucket): seven rows run as 4 + 2 co-stepped rows
    and, alone, a row whose prompt needs more slots than the whole pool (its own cache, the eager loop); the
    eager engine's tokens (one batch of seven), the pool allocated once at the budget's size."""
    eager, static, decoder = engines(loaded)
    decoder.budget = lambda: 128
    tokenizer = loaded[1]
    prompts = [ids(tokenizer, f"row {i} speaks") for i in range(6)] + [ids(tokenizer, "long " * 140)]
    new = [6, 9, 4, 7, 5, 8, 6]
    expected = eager.generate_batch(requests(prompts, new=new))
    got = static.generate_batch(requests(prompts, new=new))
    same(got, expected)
    assert [r.batch_size for r in got if isinstance(r, GenerationResult)] == [4, 4, 4, 4, 2, 2, 1]
    assert decoder.pool.slots == 128 and decoder.pool.generation == 1
    assert decoder.stats["batches"] == 2 and decoder.stats["eager batches: pool full"] == 1
    assert decoder.stats["prefills: in the pool"] == 2


def test_the_pool_is_not_reallocated_across_a_rollout_of_growing_prompts(loaded: tuple[Any, Any]) -> None:
    """Four streams over four turns, their prompts growing from the 96-slot length bucket into the 128-slot
    one: a pool sized once from a budget of 4 x 128 slots holds every batch, never reallocated (a pool
    grown by need is reallocated as they grow: the check can fail)."""
    tokenizer = loaded[1]
    generations = {}
    for budget in (512, None):
        eager, static, decoder = engines(loaded)
        decoder.budget = (lambda slots=budget: slots) if budget else None
        keys = ["a", "b", "c", "d"]
        prompts = [ids(tokenizer, f"stream {i} opens the debate " + "with words " * 8) for i in range(4)]
        lengths = set()
        for _ in range(4):
            batch = [
                GenerationRequest(prompt_ids=p, sampling=r.sampling, reuse_key=k, record_logprobs=True)
                for p, r, k in zip(prompts, requests(prompts, new=[12, 10, 11, 12]), keys, strict=True)
            ]
            got = static.generate_batch(batch)
            same(got, eager.generate_batch(batch))
            lengths |= {key[1] for key in decoder.loop.steps}
            words = ids(tokenizer, " and then")
            prompts = [(*p, *r.token_ids[:-1], *words) for p, r in zip(prompts, got, strict=True)]  # type: ignore[union-attr]
        assert lengths == {96, 128}  # 4 x 128 slots at most: within the budget
        assert decoder.stats["prefills: in the pool"] == 4 and decoder.stats["eager batches: pool full"] == 0
        generations[budget] = decoder.pool.generation
    assert generations == {512: 1, None: 2}


def test_the_engine_sizes_its_pool_from_its_batch_budget(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine hands its static decoder its own token budget (the scheduler's first batch budget): None
    on the CPU, so the pool grows by need there."""
    monkeypatch.setenv(ENV_SWITCH, "1")
    engine = LocalEngine(*loaded, device="cpu")
    decoder = engine._runner.static_decode
    assert isinstance(decoder, StaticDecoder)
    assert decoder.budget == engine.token_budget and engine.token_budget() is None


def test_the_engines_two_decoders_share_one_pool_and_see_each_others_reallocation(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine hands its batched and its deterministic rows' decoders one pool (counted once in its
    memory figures, freed once by the out-of-memory retry). When the deterministic rows' decoder grows it
    (a probe step of more slots, as its self-test or a larger batch does), the batched decoder's steps are
    stale: the next batched batch rebuilds them over the new storage, its prefill found in place (none
    copied in into a step over the old storage), the eager loop's tokens."""
    monkeypatch.setenv(ENV_SWITCH, "1")
    engine = LocalEngine(*loaded, device="cpu")
    decoder, slots = engine._runner.static_decode, engine._slots.decoder
    assert isinstance(decoder, StaticDecoder) and isinstance(slots, SlotDecoder)
    pool = decoder.pool
    assert slots.pool is pool
    tokenizer = loaded[1]
    plain = requests([ids(tokenizer, "a first row"), ids(tokenizer, "and a second, longer row")], new=[5, 4])
    expected = engines(loaded)[0].generate_batch(plain)
    same(engine.generate_batch(plain), expected)
    generation = pool.generation
    slots.probe_step(12, 1024)
    assert pool.generation > generation
    same(engine.generate_batch(plain), expected)
    assert decoder.stats["prefills: in the pool"] == 2 and decoder.stats["prefills: copied in"] == 0
    assert decoder.loop.steps and all(pool.holds(step.cache) for step in decoder.loop.steps.values())
    assert engine.memory_held()["kv_pool"] == pool.nbytes() >= 12 * 1024 * pool.slot_bytes()
    engine.release_memory()
    assert engine.memory_held()["kv_pool"] == 0 and not decoder.loop.steps and not slots.loop.steps


# ------------------------------------------------------------------------------ what the budgets count


def test_memory_held_is_counted_by_the_budget_and_released_by_an_out_of_memory_retry(
    loaded: tuple[Any, Any],
) -> None:
    """A static batch (the pool), a stream's kept KV and a deterministic batch on the slot layout (its
    prompt blocks kept in the prefix store): the engine says what each holds, its token budget counts the
    pool back in and the prefix store's room out, and ``release_memory`` (the out-of-memory retry) frees
    all three."""
    _, static, decoder = engines(loaded)
    tokenizer = loaded[1]
    long = ids(tokenizer, "a long prompt of many words " * 12)
    static.generate_batch(
        [GenerationRequest(prompt_ids=long, sampling=SamplingSettings(max_new_tokens=4), reuse_key="s")]
    )
    deterministic = [GenerationRequest(prompt_ids=long, sampling=SamplingSettings(max_new_tokens=3))] * 2
    static.generate_batch(deterministic, mode=ExecutionMode.DETERMINISTIC)
    held = static.memory_held()
    assert held["kv_pool"] == decoder.pool.nbytes() > 0
    assert held["kept_kv"] == static.kept_bytes() > 0
    store = static._slots.prefixes
    assert held["prefix_store"] == store.nbytes() > 0 and len(store) >= 2
    free = 1 << 30
    counted = free + held["kv_pool"] - (store.capacity - held["prefix_store"])
    assert static._tokens_fitting(free) == token_budget_estimate(
        static.model.config, free_bytes=counted, dtype_bytes=4
    )
    assert static._tokens_fitting(free) > token_budget_estimate(
        static.model.config, free_bytes=free - store.capacity, dtype_bytes=4
    )
    static.release_memory()
    assert static.memory_held() == {"kept_kv": 0, "prefix_store": 0, "kv_pool": 0}
