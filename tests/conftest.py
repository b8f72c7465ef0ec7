"""Shared fixtures: tiny local models (built once per machine into a cache, loaded via from_pretrained)."""

from __future__ import annotations

import pytest

from interlens.testing import tiny_model


@pytest.fixture(scope="session")
def qwen2_path() -> str:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def llama_path() -> str:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def gemma2_path() -> str:
    return tiny_model("gemma2")
