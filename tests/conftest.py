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
