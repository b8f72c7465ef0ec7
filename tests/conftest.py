"""Shared fixtures: tiny local models (built once per machine into a cache, loaded via from_pretrained)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from interlens.testing import FakeProviderServer, tiny_model


@pytest.fixture(scope="session")
def qwen2_path() -> str:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def llama_path() -> str:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def gemma2_path() -> str:
    return tiny_model("gemma2")


@pytest.fixture(scope="session")
def co_step_dtype(qwen2_path: str) -> str:
    """The dtype in which deterministic rows co-step on THIS CPU: float32, else bfloat16.

    Whether the slot layout is batch-invariant depends on the kernels the BLAS picks for each matrix shape,
    so it differs by CPU (measured: an Intel AVX-512 machine passed the engine's self-test in both dtypes; an
    AMD AVX2 one in float32; an Intel AMX one only in bfloat16, its float32 GEMM switching kernels between 4
    and 8-16 rows). Tests that check co-stepped deterministic rows run in the dtype that passes here, so they
    exercise co-stepping on every CPU seen so far; a CPU where neither passes fails here, by name, since
    deterministic turns then run alone at a fraction of batched speed."""
    import platform

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import LocalEngine

    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    for name in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=getattr(torch, name)).eval()
        if LocalEngine(model, tokenizer, device="cpu").batch_invariant:
            return name
    pytest.fail(
        f"the slot layout fails the batch-invariance self-test in float32 and bfloat16 on this CPU "
        f"({platform.processor() or platform.machine()}, torch {torch.__version__}): deterministic rows "
        "would all run alone here"
    )


@pytest.fixture
def hermetic_api_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real key or endpoint leaks in (the product code path is the users' one: no test-only switch)."""
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ANTHROPIC_", "OPENROUTER_")) or name.endswith("_CUSTOM_HEADERS"):
            monkeypatch.delenv(name)


@pytest.fixture
def api_key() -> str:
    """The key the fake provider expects; a module overrides it to plant its own."""
    return "sk-test-0123456789"


@pytest.fixture
def server(
    monkeypatch: pytest.MonkeyPatch, hermetic_api_env: None, api_key: str
) -> Iterator[FakeProviderServer]:
    """A FakeProviderServer on loopback, with the provider env vars pointing at it."""
    with FakeProviderServer() as srv:
        for name, value in srv.env(api_key=api_key).items():
            monkeypatch.setenv(name, value)
        yield srv
    assert srv.handler_errors == []
