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
from interlens.engine._generation import GenerationRequest, GenerationResult


@pytest.fixture(scope="module")
def loaded(qwen2_path: str) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(qwen2_path).eval(), AutoTokenizer.from_pretrained(qwen2_path)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
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
    """Two turns of four streams and a row without one (laid out with a hole, or prefilled apart when its
    prompt is the longest): the second turn reuses kept KV and lays it straight into the pool, no cache
    allocated, the eager engine's tokens."""
    eager, static, decoder = engines(loaded)
    eager._reused.always_reuse = static._reused.always_reuse = True
    tokenizer = loaded[1]
    keys = ["a", "b", "c", None, "d"]
    prompts = [ids(tokenizer, f"stream {i} opens " + "with words " * i) for i in range(4)]
    prompts.insert(3, ids(tokenizer, "a fresh row " * 2))
    for turn in range(2):
        batch = [
            GenerationRequest(prompt_ids=p, sampling=r.sampling, reuse_key=k, record_logprobs=True)
            for p, r, k in zip(prompts, requests(prompts, new=[5, 7, 6, 5, 8]), keys, strict=True)
        ]
        expected = eager.generate_batch(batch)
        before = sum(allocations.values())
        got = static.generate_batch(batch)
        assert sum(allocations.values()) == before
        same(got, expected)
        if turn:
            assert sum(r.kv_reused_tokens > 0 for r in got if isinstance(r, GenerationResult)) == 4
        words = ids(tokenizer, " and then")
        prompts = [(*p, *r.token_ids[:-1], *words) for p, r in zip(prompts, got, strict=True)]  # type: ignore[union-attr]
    assert decoder.stats["prefills: copied in"] == 0 and decoder.stats["prefills: in the pool"] == 2
