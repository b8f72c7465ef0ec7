"""The engine's memory on a real tiny model: grouped prefill keeps one small cache alive at a time."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens._generation import GenerationRequest, GenerationResult, LocalEngine, _prefill_groups
from interlens.testing import tiny_model


class WatchedEngine(LocalEngine):
    """A LocalEngine that notes, at each prefill forward, how many caches of EARLIER forwards are alive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.caches: list[weakref.ref[Any]] = []
        self.alive_at_forward: list[int] = []

    def _forward(self, ids: list[list[int]], mask: list[list[int]], cache: Any, device: str) -> torch.Tensor:
        self.alive_at_forward.append(sum(ref() is not None for ref in self.caches))
        self.caches.append(weakref.ref(cache))
        return super()._forward(ids, mask, cache, device)


@pytest.fixture(scope="module")
def qwen2_model() -> tuple[Any, Any]:
    path = tiny_model("qwen2")  # plain static layers: the grouped prefill applies
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _prompt(tokenizer: Any, text: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(ids)


def test_grouped_prefill_drops_each_group_cache_before_the_next(qwen2_model: tuple[Any, Any]) -> None:
    model, tokenizer = qwen2_model
    engine = WatchedEngine(model, tokenizer, device="cpu")
    texts = [" ".join(["spaces"] * n) for n in (1, 40, 3, 25, 8, 60, 2, 15, 33, 5, 50, 4)]
    requests = [
        GenerationRequest(prompt_ids=_prompt(tokenizer, t), max_new_tokens=6, temperature=0) for t in texts
    ]
    groups = _prefill_groups([len(r.prompt_ids) for r in requests])
    assert len(groups) >= 3
    batched = engine.generate_batch(requests)
    assert engine.alive_at_forward == [0] * len(groups)  # each group's cache gone before the next forward
    alone = [engine.generate_batch([r])[0] for r in requests]
    assert all(isinstance(r, GenerationResult) for r in batched + alone)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]  # type: ignore[union-attr]
