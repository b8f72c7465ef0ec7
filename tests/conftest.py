"""Shared fixtures: tiny local models (built once per machine into a cache, loaded via from_pretrained)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from interlens.testing import FakeProviderServer, tiny_model


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the README's ``-n 2``) the test processes share the machine's cores: each runs
    torch on its share. torch's OpenMP threads spin at every barrier, so two processes using all cores each
    slow each other several-fold (seen: one real-model test 44 s alone, 217 s beside another). The processes
    a test starts (scripts, examples, the CLI, worker processes) get the same share through
    ``OMP_NUM_THREADS``, unless the caller set it (seen: the GPU check's CPU rehearsal 36 s on one core,
    99 s beside another test with a thread per core)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        share = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@pytest.fixture(scope="session", autouse=True)
def _verdicts_in_a_session_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test reads or writes the user's kept batch-invariance verdicts (``engine._verdicts``): the session's
    own folder (what session fixtures and child processes see), and each test its own below."""
    before = os.environ.get("INTERLENS_CACHE_DIR")
    os.environ["INTERLENS_CACHE_DIR"] = str(tmp_path_factory.mktemp("interlens-cache"))
    yield
    if before is None:
        os.environ.pop("INTERLENS_CACHE_DIR", None)
    else:
        os.environ["INTERLENS_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _verdicts_per_test(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Each test starts with no kept verdict, as before they were kept: its engines run their self-test."""
    import hashlib

    name = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setenv("INTERLENS_CACHE_DIR", os.path.join(os.environ["INTERLENS_CACHE_DIR"], name))


@pytest.fixture(scope="session")
def qwen2_path() -> str:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def llama_path() -> str:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def gemma2_path() -> str:
    return tiny_model("gemma2")


def _first_dtype_passing(qwen2_path: str, passes: Any, what: str) -> str:
    import platform

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import LocalEngine

    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    for name in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=getattr(torch, name)).eval()
        with torch.inference_mode():
            if passes(LocalEngine(model, tokenizer, device="cpu")):
                return name
    pytest.fail(
        f"{what} fails the batch-invariance self-test in float32 and bfloat16 on this CPU "
        f"({platform.processor() or platform.machine()}, torch {torch.__version__})"
    )


@pytest.fixture(scope="session")
def co_step_dtype(qwen2_path: str) -> str:
    """The dtype in which deterministic rows co-step on THIS CPU: float32, else bfloat16.

    Whether the slot layout is batch-invariant depends on the kernels the BLAS picks for each matrix shape,
    so it differs by CPU; where the stock kernels fail, the engine computes linear layers in fixed-row
    chunks and tests again (``_slot_rows``). Tests that check co-stepped deterministic rows run in the dtype
    that co-steps here; a CPU where neither does fails here, by name, since deterministic turns would then
    run alone at a fraction of batched speed."""
    return _first_dtype_passing(qwen2_path, lambda engine: engine.batch_invariant, "the engine")


@pytest.fixture(scope="session")
def stock_invariant_dtype(qwen2_path: str) -> str:
    """The dtype whose STOCK kernels pass the self-test on the slot layout on this CPU (no fixed-row linear
    chunks): measured, an Intel AVX-512 machine in both dtypes, an AMD AVX2 one in float32, an Intel AMX one
    only in bfloat16 (its float32 GEMM picks another kernel for 4 rows than for 8 or 16)."""
    from interlens.engine._batch_invariance import batch_invariant

    return _first_dtype_passing(
        qwen2_path, lambda engine: batch_invariant(engine._slots), "the slot layout on stock kernels"
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
