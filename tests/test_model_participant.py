"""Local model participants on tiny real models of three families, loaded through from_pretrained."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from interlens import (
    AutoModelParticipant,
    Conversation,
    ModelLoadError,
    ModelParticipant,
    ScriptedParticipant,
    TokenBudget,
)
from interlens.engine._chat_template import fold_messages, probe_template, render_view
from interlens.testing import TINY_FAMILIES, tiny_model


@pytest.fixture(scope="module", params=["qwen2", "llama", "gemma2"])
def family(request):
    return request.param, tiny_model(request.param)


def _debate(path: str, **settings):
    a = AutoModelParticipant.from_pretrained(
        path, name="a", system_prompt="Argue for tabs.", max_new_tokens=6, **settings
    )
    b = AutoModelParticipant.from_pretrained(
        path, name="b", system_prompt="Argue for spaces.", max_new_tokens=6, **settings
    )
    return Conversation(
        participants=[a, b], shared_context="Debate: tabs vs spaces.", shared_system_prompt="Be kind."
    )


def test_three_families_available():
    assert {"qwen2", "llama", "gemma2"} <= set(TINY_FAMILIES)


def test_from_pretrained_resolves_family_without_loading_weights(family):
    from interlens.engine._model_cache import clear_engine_cache

    clear_engine_cache()
    name, path = family
    p = AutoModelParticipant.from_pretrained(path, name="x")
    assert type(p) is ModelParticipant and p.needs_device  # one class: templates are probed, not dispatched
    assert p.family == name and p.to_json()["family"] == name  # the config's model_type, recorded


@pytest.mark.parametrize(
    "old", ["Qwen2Participant", "LlamaParticipant", "Gemma2Participant", "Gemma3Participant"]
)
def test_removed_family_classes_warn_and_resolve_to_model_participant(old):
    import interlens.participants._model_participant as module

    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
        assert getattr(module, old) is ModelParticipant
    with pytest.warns(DeprecationWarning, match="register_family is deprecated"):
        decorate = module.register_family("qwen2")
    assert decorate(ModelParticipant) is ModelParticipant
    with pytest.raises(AttributeError):
        _ = module.NoSuchParticipant


def test_kv_reuse_auto_is_a_deprecated_alias_of_true():
    assert ModelParticipant("m", name="x").kv_reuse is True  # the default
    with pytest.warns(DeprecationWarning, match="kv_reuse='auto' is deprecated"):
        p = ModelParticipant("m", name="x", kv_reuse="auto")
    assert p.kv_reuse is True
    old = p.to_json() | {"kv_reuse": "auto"}  # a recipe saved before the deprecation loads silently
    assert ModelParticipant.from_json(old).kv_reuse is True


def test_views_render_with_family_template(family):
    name, path = family
    conv = _debate(path)
    from interlens import Message

    conv.transcript.append(Message("a", "Tabs are compact."))
    engine = conv.participants[1].live_engine()
    caps = probe_template(engine.tokenizer)
    view = conv.view("b")
    text = render_view(engine.tokenizer, view)
    assert "Argue for spaces." in text and "Be kind." in text and "Tabs are compact." in text
    messages = fold_messages(view, caps)
    if name == "gemma2":  # no system role: folded into the first user turn; strict alternation
        assert not caps.system_role and not caps.consecutive_roles
        assert [m["role"] for m in messages] == ["user"]
        assert messages[0]["content"].startswith("Be kind.\n\nArgue for spaces.\n\nDebate: tabs vs spaces.")
        assert "<start_of_turn>user" in text and text.rstrip().endswith("<start_of_turn>model")
    else:
        assert caps.system_role
        assert messages[0] == {"role": "system", "content": "Be kind.\n\nArgue for spaces."}
        assert [m["role"] for m in messages[1:]] == ["user", "user"]


def test_live_debate_generates_with_honest_token_counts(family):
    _, path = family
    conv = _debate(path, temperature=0.0)
    conv.run(turns=3)
    assert [m.author for m in conv.transcript] == ["moderator", "a", "b", "a"]
    for m in conv.transcript[1:]:
        assert 1 <= m.n_tokens <= 6
        assert m.metadata["finish_reason"] in {"eos", "length"}
        assert m.metadata["batched"] is False
    # n_tokens counts what was generated: a turn cut by the cap generated exactly the cap
    for m in conv.transcript[1:]:
        if m.metadata["finish_reason"] == "length":
            assert m.n_tokens == 6
    reply = conv.sample("b")
    assert reply.n_tokens == (6 if reply.metadata["finish_reason"] == "length" else reply.n_tokens)
    assert len(conv.transcript) == 4  # sample did not commit


def test_batched_generation_through_engine(family):
    _, path = family
    conv = _debate(path, temperature=0.0)
    conv.run(turns=1)
    participant = conv.participants[1]
    engine = participant.live_engine()
    from interlens._core._view import GenerationOptions

    requests = [participant.request(conv.view("b"), GenerationOptions(max_new_tokens=k)) for k in (2, 4, 6)]
    results = engine.generate_batch(requests)
    assert [r.n_tokens <= k for r, k in zip(results, (2, 4, 6), strict=True)] == [True, True, True]
    assert all(r.batch_size == 3 and r.n_tokens == len(r.token_ids) for r in results)
    # rows of one prompt, greedy: the shorter ones are prefixes of the longest
    assert results[2].token_ids[: results[0].n_tokens] == results[0].token_ids


def test_request_tokens_counts_prompt_plus_max_new_and_is_rendered_once(qwen2_path):
    from interlens._core._view import GenerationOptions

    conv = _debate(qwen2_path, temperature=0.0)
    participant = conv.participants[1]
    engine = participant.live_engine()
    request = participant.request(conv.view("b"), GenerationOptions(max_new_tokens=6))
    prompt = len(engine.prompt_ids(conv.view("b")))
    assert prompt > 5 and engine.request_tokens(request) == prompt + 6  # the batch budget's unit
    assert id(request) in engine._rendered  # rendered when queued, off the device thread
    [result] = engine.generate_batch([request])
    assert result.prompt_tokens == prompt and id(request) not in engine._rendered


def test_two_participants_with_one_id_share_one_model(qwen2_path):
    a = AutoModelParticipant.from_pretrained(qwen2_path, name="a")
    b = AutoModelParticipant.from_pretrained(qwen2_path, name="b", temperature=0.3)
    assert a.live_engine().engine.model is b.live_engine().engine.model


def test_pickled_lazy_participant_is_small(qwen2_path):
    p = AutoModelParticipant.from_pretrained(qwen2_path, name="a")
    p.live_engine()  # weights loaded in this process...
    blob = pickle.dumps(p)
    assert len(blob) < 2_000  # ...but the participant ships none of them
    clone = pickle.loads(blob)
    assert clone.live_engine().engine.model is p.live_engine().engine.model


def test_token_budget_caps_model_turns(qwen2_path):
    p = AutoModelParticipant.from_pretrained(
        qwen2_path, name="solo", max_new_tokens=50, temperature=0.0, stop=()
    )
    conv = Conversation(participants=[p], shared_context="Count.").turns(None)
    conv = conv.run_until(TokenBudget(per_conversation=7, per_turn=3))
    conv.run()
    assert all(m.n_tokens <= 3 for m in conv.transcript[1:])
    assert conv.tokens_generated <= 7
    assert conv.tokens_generated == sum(m.n_tokens for m in conv.transcript)


def test_mixed_scripted_and_model(qwen2_path):
    mod = ScriptedParticipant("host", ["Next question."])
    p = AutoModelParticipant.from_pretrained(qwen2_path, name="guest", max_new_tokens=3)
    conv = Conversation(participants=[mod, p]).turns(4)
    conv.run()
    assert [m.author for m in conv.transcript] == ["host", "guest", "host", "guest"]


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        AutoModelParticipant.from_pretrained(str(tmp_path), name="x")
    p = ModelParticipant(str(tmp_path / "nowhere"), name="x")
    with pytest.raises(ModelLoadError):
        p.live_engine()


def test_a_checkpoint_missing_a_weight_is_refused_naming_it_not_run_with_random_values(qwen2_path, tmp_path):
    """transformers fills weights a checkpoint lacks with random values and only logs it: the engine would
    generate noise as the model's answer (seen with a GGUF file whose LM head was not tied)."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no_lm_head"
    shutil.copytree(qwen2_path, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["lm_head.weight"]  # the tiny Qwen2 does not tie it to the embedding
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    p = AutoModelParticipant.from_pretrained(str(broken), name="x")
    with pytest.raises(
        ModelLoadError,
        match=r"1 weight\(s\) of Qwen2ForCausalLM are not in the checkpoint "
        r"\(lm_head\.weight\).*random values",
    ):
        p.live_engine()


def _tied_checkpoint(qwen2_path: str, out: Path) -> Path:
    """The tiny Qwen2 with its LM head tied to its embedding, as SmolLM2 or Qwen2.5-0.5B ship: no lm_head
    tensor in the file, ``tie_word_embeddings`` in the config."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen2_path, out)
    weights = load_file(str(out / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return out


def test_models_loaded_in_threads_leave_weight_tying_working(qwen2_path, llama_path, gemma2_path, tmp_path):
    """transformers swaps PreTrainedModel.tie_weights for a no-op on the class while it builds a model; loads
    in several threads interleave the swap and leave the no-op for good, and every tied model loaded later
    gets a random LM head. Loads through interlens run one at a time, and repair what plain transformers
    loads in threads left behind."""
    tied = _tied_checkpoint(qwen2_path, tmp_path / "tied")
    script = textwrap.dedent(
        """
        import sys, threading
        from transformers import PreTrainedModel
        from interlens.engine._model_cache import clear_engine_cache, load_engine
        tied, paths = sys.argv[1], sys.argv[2:]

        def at_once(load):
            start = threading.Barrier(len(paths))
            def run(p):
                start.wait()
                load(p)
            threads = [threading.Thread(target=run, args=(p,)) for p in paths]
            for t in threads: t.start()
            for t in threads: t.join()

        def head_is_embedding():
            model = load_engine(tied, device="cpu").model
            clear_engine_cache()
            return model.lm_head.weight is model.get_input_embeddings().weight

        print("first", head_is_embedding())
        for _ in range(3):
            at_once(lambda p: load_engine(p, device="cpu"))
            clear_engine_cache()
        print("after interlens", PreTrainedModel.tie_weights.__name__, head_is_embedding())
        # two plain loads in two threads, interleaved: A enters, B enters, A leaves, B leaves
        from transformers.initialization import no_tie_weights
        first, second = no_tie_weights(), no_tie_weights()
        first.__enter__(); second.__enter__()
        first.__exit__(None, None, None); second.__exit__(None, None, None)
        print("left by transformers", PreTrainedModel.tie_weights.__name__)
        print("after repair", head_is_embedding(), PreTrainedModel.tie_weights.__name__)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tied), qwen2_path, llama_path, gemma2_path],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "first True"
    assert lines[1] == "after interlens tie_weights True"  # no no-op left behind by our own loads
    assert lines[2] == "left by transformers empty_func"  # what interleaved plain loads leave
    assert lines[3] == "after repair True tie_weights"
    assert "tie_weights was left replaced" in proc.stderr


def test_two_models_loading_at_once_in_a_fresh_process_both_load(qwen2_path, llama_path):
    """Two engines loading in two threads before transformers was imported (a run of two models): the
    first ``from transformers import ...`` raced in transformers' lazy module, one load got ImportError."""
    script = textwrap.dedent(
        """
        import sys, threading
        from interlens.engine._model_cache import load_engine
        start, errors, engines = threading.Barrier(2), [], []
        def load(path):
            start.wait()
            try:
                engines.append(load_engine(path, device="cpu"))
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=load, args=(p,)) for p in sys.argv[1:]]
        for t in threads: t.start()
        for t in threads: t.join()
        print(len(engines), errors)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, qwen2_path, llama_path], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "2 []"


def test_a_transformers_older_than_the_floor_is_refused_naming_both_versions(
    qwen2_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers < 5.24 takes no cache= in a model's forward: tokens silently differ (5.17, measured)."""
    import transformers

    from interlens.engine._model_cache import clear_engine_cache, load_engine

    clear_engine_cache()
    monkeypatch.setattr(
        transformers, "__version__", "5.17.0"
    )  # the installed release, as the outside world says
    with pytest.raises(
        ModelLoadError, match=r"needs transformers >= 5\.24, and 5\.17\.0 is installed.*pip install"
    ):
        load_engine(qwen2_path, device="cpu")
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    assert load_engine(qwen2_path, device="cpu").model is not None


def test_a_masked_lm_and_a_directory_without_a_tokenizer_are_refused_by_name(qwen2_path, tmp_path) -> None:
    """transformers builds BertLMHeadModel for a BERT masked-LM checkpoint (it 'succeeds' and generates
    noise), and a tokenizer of an empty vocabulary for a directory without tokenizer files (every prompt
    empty): both are refused at load, saying what is wrong."""
    import shutil

    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer is there: only the head is wrong
        shutil.copy(Path(qwen2_path) / name, tmp_path / "bert" / name)
    with pytest.raises(
        ModelLoadError, match=r"its checkpoint is BertForMaskedLM, not a causal language model"
    ):
        AutoModelParticipant.from_pretrained(str(tmp_path / "bert"), name="x").live_engine()
    shutil.copytree(qwen2_path, tmp_path / "no_tokenizer")
    for path in (tmp_path / "no_tokenizer").iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            path.unlink()
    with pytest.raises(ModelLoadError, match=r"it holds no tokenizer.*tokenizer\.save_pretrained"):
        AutoModelParticipant.from_pretrained(str(tmp_path / "no_tokenizer"), name="x").live_engine()
