"""The chat-template capability cache follows the tokenizer object and its template, never a memory address.

Real tokenizers of two families whose templates differ (Qwen2 accepts a system role, Gemma2 rejects it).
Shallow copies are real tokenizer objects that are cheap to make, so hundreds of them can be created and
dropped in turn: CPython then hands a new tokenizer the address of the one just freed, which is how an
``id()``-keyed cache gave a Gemma tokenizer Qwen's capabilities.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
from transformers import AutoTokenizer

from interlens.engine._chat_template import TemplateCaps, probe_template
from interlens.testing import tiny_model


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, object]:
    return {family: AutoTokenizer.from_pretrained(tiny_model(family)) for family in ("qwen2", "gemma2")}


def test_a_new_tokenizer_at_a_reused_address_gets_its_own_capabilities(tokenizers: dict[str, object]) -> None:
    expected = {
        "qwen2": TemplateCaps(True, True, True, True),
        "gemma2": TemplateCaps(True, False, False, False),
    }
    addresses: list[int] = []
    for i in range(300):
        family = ("qwen2", "gemma2")[i % 2]
        tokenizer = copy.copy(tokenizers[family])
        addresses.append(id(tokenizer))
        assert probe_template(tokenizer) == expected[family], f"tokenizer {i} ({family})"
        del tokenizer  # freed at once, or by the next automatic collection (rendering leaves cycles)
    assert len(addresses) - len(set(addresses)) >= 10  # addresses were reused: the case really happened


def test_a_new_chat_template_on_the_same_tokenizer_is_probed_again(tokenizers: dict[str, object]) -> None:
    tokenizer: object = copy.copy(tokenizers["qwen2"])
    assert probe_template(tokenizer).system_role
    tokenizer.chat_template = tokenizers["gemma2"].chat_template  # type: ignore[attr-defined]
    assert not probe_template(tokenizer).system_role
    tokenizer.chat_template = None  # type: ignore[attr-defined]
    assert probe_template(tokenizer) == TemplateCaps(False, False, False, False)


def test_the_cache_does_not_keep_a_tokenizer_alive(tokenizers: dict[str, object]) -> None:
    tokenizer = copy.copy(tokenizers["gemma2"])
    probe_template(tokenizer)
    ref = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()  # rendering a template leaves reference cycles in the tokenizer; the cache adds no reference
    assert ref() is None
