"""Tiny test models: real families, tokenizers and chat templates; cached and safe to build concurrently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens._core._exceptions import ConfigurationError
from interlens.testing import TINY_FAMILIES, TINY_SIZES, tiny_model

_EXPECTED = {
    # family: (model class, tokenizer eos token, end-of-turn token, pad token)
    "qwen2": ("Qwen2ForCausalLM", "<|im_end|>", "<|im_end|>", "<|endoftext|>"),
    "llama": ("LlamaForCausalLM", "<|eot_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"),
    "gemma2": ("Gemma2ForCausalLM", "<eos>", "<end_of_turn>", "<pad>"),
    "gemma3": ("Gemma3ForCausalLM", "<eos>", "<end_of_turn>", "<pad>"),
}


def _load(family: str) -> tuple[Any, Any]:
    path = tiny_model(family)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_loads_through_the_auto_classes(family: str) -> None:
    model, tokenizer = _load(family)
    model_class, eos, end_of_turn, pad = _EXPECTED[family]
    assert type(model).__name__ == model_class
    files = set(os.listdir(tiny_model(family)))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    n_params = sum(p.numel() for p in model.parameters())
    assert 50_000 < n_params < 300_000
    assert 512 <= len(tokenizer) <= 1000

    turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    assert tokenizer.eos_token == eos and tokenizer.pad_token == pad
    assert turn_id in model.generation_config.eos_token_id
    assert turn_id in model.config.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == model.config.pad_token_id
    # Special tokens are single ids that encoding never splits, and decoding can skip.
    ids = tokenizer(f"hello{end_of_turn}", add_special_tokens=False).input_ids
    assert ids[-1] == turn_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello"


def test_qwen2_uses_chatml_with_the_default_system_prompt() -> None:
    _, tokenizer = _load("qwen2")
    assert _render(tokenizer, [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert _render(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama_uses_the_llama3_header_template() -> None:
    _, tokenizer = _load("llama")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    assert _render(tokenizer, messages) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tokenizer("Hi").input_ids[0] == tokenizer.bos_token_id


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_renders_the_assistant_as_model_and_requires_alternation(family: str) -> None:
    _, tokenizer = _load(family)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert _render(tokenizer, messages) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(
        TemplateError, match=r"Conversation roles must alternate user/assistant/user/assistant/\.\.\."
    ):
        _render(tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        _render(tokenizer, [{"role": "assistant", "content": "I speak first"}])


def test_gemma2_refuses_a_system_role_and_gemma3_folds_it_into_the_first_turn() -> None:
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, gemma2 = _load("gemma2")
    with pytest.raises(TemplateError, match="System role not supported"):
        _render(gemma2, system)
    _, gemma3 = _load("gemma3")
    assert _render(gemma3, system) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_gemma_families_have_real_sliding_window_layers() -> None:
    gemma2, _ = _load("gemma2")
    gemma3, _ = _load("gemma3")
    assert gemma2.config.sliding_window == gemma3.config.sliding_window == 64
    assert gemma2.config.layer_types == ["sliding_attention", "full_attention"]
    assert gemma3.config.layer_types == ["sliding_attention", "full_attention"]


def test_builds_are_seeded_and_cached(tmp_path: Path) -> None:
    first = Path(tiny_model("llama", cache_dir=tmp_path / "a"))
    second = Path(tiny_model("llama", cache_dir=tmp_path / "b"))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    recipe = json.loads((first / "interlens_tiny_model.json").read_text())
    assert recipe["family"] == "llama" and recipe["size"] == "tiny"

    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model("llama", cache_dir=tmp_path / "a") == str(first)  # a cache hit: nothing rebuilt
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert os.listdir(tmp_path / "a") == [first.name]  # no temporary build directory left behind


def test_default_cache_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INTERLENS_TEST_MODELS", str(tmp_path))
    path = Path(tiny_model("gemma3"))
    assert path.parent == tmp_path and path.name.startswith("gemma3-tiny-")


def test_concurrent_builders_in_separate_processes_agree(tmp_path: Path) -> None:
    """Processes released at one moment race to build one model: all get it whole, none sees a partial."""
    script = (
        "import sys\n"
        "from interlens.testing import tiny_model\n"
        "import transformers, tokenizers, torch\n"  # pay the imports before the start line
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "print(tiny_model('qwen2', cache_dir=sys.argv[1]), flush=True)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    (path,) = paths
    assert os.listdir(tmp_path) == [Path(path).name]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_bench_size_is_tens_of_millions_of_parameters() -> None:
    assert TINY_SIZES == ("tiny", "bench")
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2", size="bench"))
    n_params = sum(p.numel() for p in model.parameters())
    assert 20_000_000 <= n_params <= 40_000_000


def test_unknown_family_or_size_is_refused_with_the_choices() -> None:
    with pytest.raises(
        ConfigurationError, match="unknown family; choose one of qwen2, llama, gemma2, gemma3"
    ):
        tiny_model("mistral")
    with pytest.raises(ConfigurationError, match="unknown size; choose one of tiny, bench"):
        tiny_model("qwen2", size="huge")


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_the_ends_turns_variant_ends_rows_mid_batch_and_the_batch_goes_on(family: str) -> None:
    """A random model's turns always run to the token cap; the ``ends_turns`` variant's end at its end token
    at different steps, and each row of a batch is still the row run alone."""
    from interlens.engine._generation import (
        GenerationRequest,
        GenerationResult,
        LocalEngine,
        SamplingSettings,
    )

    path = tiny_model(family, ends_turns=True)
    assert (
        path != tiny_model(family)
        and json.loads(Path(path, "interlens_tiny_model.json").read_text())["ends_turns"]
    )
    engine = LocalEngine(
        AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), device="cpu"
    )
    texts = [
        "hi",
        "Debate: tabs versus spaces.",
        "2 + 2?",
        "Explain castling.",
        "A hot dog?",
        "Name a color.",
    ]
    requests = [
        GenerationRequest(
            tuple(
                engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
                )
            ),
            sampling=SamplingSettings(max_new_tokens=32, temperature=0.9 * (i % 2), seed=i),
        )
        for i, t in enumerate(texts)
    ]
    batch = engine.generate_batch(requests)
    assert all(isinstance(r, GenerationResult) for r in batch), batch
    ended = [r for r in batch if r.finish_reason == "eos"]
    assert ended and all(len(r.token_ids) < 32 for r in ended)
    first_end = min(len(r.token_ids) for r in ended)
    assert any(len(r.token_ids) > first_end for r in batch)  # others went on after a row ended
    assert [r.token_ids for r in batch] == [engine.generate_batch([q])[0].token_ids for q in requests]
