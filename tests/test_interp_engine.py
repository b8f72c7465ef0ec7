"""Engine-level interp on real tiny models of every family: capture, steering and scoring in ``LocalEngine``.

References are independent of ``interlens.interp._hooks``: a teacher-forced forward of the HF model over
prompt + answer, read through the model's own ``output_hidden_states`` and through hooks this file installs on
the modules by their attribute names (``model.model.layers[i].self_attn`` ...), and steering re-done by hand
with such a hook. Nothing of interlens is mocked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens._core._exceptions import ConfigurationError
from interlens.engine._generation import (
    GenerationRequest,
    GenerationResult,
    LocalEngine,
    SamplingSettings,
    ScoreRequest,
    ScoreResult,
)
from interlens.interp._capture import CaptureSpec
from interlens.interp._hooks import decoder_layers, hooked
from interlens.interp._steering import SteeringSpec
from interlens.scheduler import BatchCancelled, ExecutionMode
from interlens.testing import TINY_FAMILIES, tiny_model

ALL_SITES = ("residual", "attn", "mlp")
TIGHT = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def engine(request: pytest.FixtureRequest) -> LocalEngine:
    path = tiny_model(request.param)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")


def _prompt(
    engine: LocalEngine, text: str = "Debate: tabs versus spaces. Argue for tabs."
) -> tuple[int, ...]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(ids)


def _one(engine: LocalEngine, request: GenerationRequest) -> GenerationResult:
    [result] = engine.generate_batch([request])
    assert isinstance(result, GenerationResult), result
    return result


def _request(engine: LocalEngine, **kwargs: Any) -> GenerationRequest:
    kwargs.setdefault("max_new_tokens", 10)
    kwargs.setdefault("seed", 7)
    settings = {
        k: kwargs.pop(k) for k in ("max_new_tokens", "temperature", "top_p", "stop", "seed") if k in kwargs
    }
    return GenerationRequest(_prompt(engine), sampling=SamplingSettings(**settings), **kwargs)


def _blocks(engine: LocalEngine) -> Any:
    return engine.model.model.layers  # by name, on purpose: the reference does not use _hooks


def _d_model(engine: LocalEngine) -> int:
    return int(engine.model.config.hidden_size)


def _hooks(model: nn.Module) -> set[tuple[str, int]]:
    """Every forward (pre-)hook on the model. Not always empty: transformers installs its own output
    capturing hooks for good on the first ``output_hidden_states=True`` call."""
    return {
        (name, key) for name, m in model.named_modules() for key in [*m._forward_hooks, *m._forward_pre_hooks]
    }


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def _reference_hooks(engine: LocalEngine) -> Iterator[dict[tuple[str, int], torch.Tensor]]:
    """Each site's output of one forward pass, read by attribute name."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for i, block in enumerate(_blocks(engine)):
        for site, module in (("residual", block), ("attn", block.self_attn), ("mlp", block.mlp)):
            handles.append(
                module.register_forward_hook(
                    lambda m, a, out, key=(site, i): seen.__setitem__(key, _first(out)[0].clone())
                )
            )
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _teacher_forced(engine: LocalEngine, ids: list[int]) -> tuple[dict[tuple[str, int], torch.Tensor], Any]:
    with torch.inference_mode(), _reference_hooks(engine) as seen:
        out = engine.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return dict(seen), out


@contextmanager
def _added(engine: LocalEngine, layer: int, vector: torch.Tensor) -> Iterator[None]:
    """Steering done by hand: ``vector`` added to one decoder layer's output."""

    def add(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] + vector, *output[1:])
        return output + vector

    handle = _blocks(engine)[layer].register_forward_hook(add)
    try:
        yield
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------- capture


def test_capture_of_a_generated_row_equals_a_teacher_forced_forward(engine: LocalEngine) -> None:
    plain = _one(engine, _request(engine))
    result = _one(engine, _request(engine, capture=CaptureSpec(sites=ALL_SITES)))
    assert result.token_ids == plain.token_ids  # capturing does not change the answer
    n, prompt = result.n_tokens, _prompt(engine)
    assert n >= 3, "the test needs a few decode steps"
    captured = result.captured
    assert captured is not None and plain.captured is None
    assert captured.answer_ids == tuple(result.token_ids)
    assert captured.prompt_len == len(prompt) and captured.with_prompt is False
    layers = len(_blocks(engine))
    assert set(captured.tensors) == {(s, i) for s in ALL_SITES for i in range(layers)}

    seen, out = _teacher_forced(engine, [*prompt, *result.token_ids])
    for (site, layer), tensor in captured.tensors.items():
        assert tensor.shape == (n, _d_model(engine))
        assert tensor.device.type == "cpu" and not tensor.is_inference()  # usable with autograd (probes)
        torch.testing.assert_close(tensor, seen[(site, layer)][len(prompt) :], **TIGHT)
        if site == "residual" and layer < layers - 1:  # the last entry has the final norm applied
            torch.testing.assert_close(tensor, out.hidden_states[layer + 1][0, len(prompt) :], **TIGHT)


def test_capture_with_prompt_puts_the_prompt_rows_first(engine: LocalEngine) -> None:
    spec = CaptureSpec(sites=("residual", "mlp"), layers=(1,), prompt=True)
    result = _one(engine, _request(engine, capture=spec))
    prompt = _prompt(engine)
    assert result.captured is not None and result.captured.with_prompt
    assert set(result.captured.tensors) == {("residual", 1), ("mlp", 1)}
    seen, _ = _teacher_forced(engine, [*prompt, *result.token_ids])
    for key, tensor in result.captured.tensors.items():
        assert tensor.shape == (len(prompt) + result.n_tokens, _d_model(engine))
        torch.testing.assert_close(tensor, seen[key], **TIGHT)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_capture_across_the_sliding_window(family: str) -> None:
    path = tiny_model(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")
    window = model.config.sliding_window
    text = "Summarise the rules of chess, then explain castling to a child who knows nothing. " * 4
    prompt = tuple(engine.tokenizer(text)["input_ids"][: window - 6])
    request = GenerationRequest(
        prompt,
        sampling=SamplingSettings(max_new_tokens=20, temperature=0.0),
        capture=CaptureSpec(prompt=True),
    )
    result = _one(engine, request)
    assert len(prompt) + result.n_tokens > window, "the answer must cross the window"
    assert result.captured is not None
    seen, _ = _teacher_forced(engine, [*prompt, *result.token_ids])
    for (site, layer), tensor in result.captured.tensors.items():
        torch.testing.assert_close(tensor, seen[(site, layer)], **TIGHT)


def _captured_kept_and_offloaded(device: str) -> tuple[Any, Any]:
    path = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, device_map={"": device})
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(path), device=device)
    kept = _one(engine, _request(engine, capture=CaptureSpec(offload=None)))
    offloaded = _one(engine, _request(engine, capture=CaptureSpec()))
    assert kept.captured is not None and offloaded.captured is not None
    assert kept.captured.tensors.keys() == offloaded.captured.tensors.keys()
    for key, tensor in kept.captured.tensors.items():
        torch.testing.assert_close(tensor.cpu(), offloaded.captured.tensors[key], rtol=0, atol=0)
    return kept.captured.tensors, offloaded.captured.tensors


def test_a_capture_kept_on_the_device_holds_what_the_offloaded_one_holds() -> None:
    _captured_kept_and_offloaded("cpu")


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="offload=None keeps tensors on the model's device: only an accelerator tells it from offloading "
    "(on a CPU-only machine both captures are on the CPU)",
)
def test_a_capture_with_offload_none_stays_on_the_accelerator() -> None:
    kept, offloaded = _captured_kept_and_offloaded("cuda:0")
    assert {t.device.type for t in kept.values()} == {"cuda"}
    assert {t.device.type for t in offloaded.values()} == {"cpu"}


def test_a_bfloat16_model_is_steered_in_float32_and_captured_in_its_own_dtype() -> None:
    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")
    direction = torch.linspace(-1.0, 1.0, _d_model(engine))
    unit = direction / direction.norm()
    spec = SteeringSpec(direction, layers=0, mode="ablate")
    result = _one(engine, _request(engine, capture=CaptureSpec(layers=(0,)), steering=[spec]))
    assert result.captured is not None
    tensor = result.captured.tensors[("residual", 0)]
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (result.n_tokens, _d_model(engine))
    # bf16 keeps ~3 significant digits: what is left along the direction is rounding, not signal
    scale = tensor.float().norm(dim=-1).max()
    assert (tensor.float() @ unit).abs().max() < 2e-2 * scale
    plain = _one(engine, _request(engine, capture=CaptureSpec(layers=(0,))))
    assert plain.captured is not None
    assert (plain.captured.tensors[("residual", 0)].float() @ unit).abs().max() > 5e-2 * scale
    [scored] = engine.score([ScoreRequest(_prompt(engine), (5, 6), steering=[spec])])
    assert isinstance(scored, ScoreResult) and len(scored.logprobs) == 2


# ---------------------------------------------------------------------------------------------- steering


def test_steering_adds_the_direction_and_changes_the_answer(engine: LocalEngine) -> None:
    torch.manual_seed(0)
    direction = torch.randn(_d_model(engine))
    spec = SteeringSpec(direction, layers=0, coef=8.0)
    firsts: list[torch.Tensor] = []

    def first_logits(module: nn.Module, args: Any, output: Any) -> None:
        firsts.append(output.logits[0, -1].clone())

    handle = engine.model.register_forward_hook(first_logits)
    try:
        plain = _one(engine, _request(engine))
        plain_first = firsts[0]
        firsts.clear()
        steered = _one(engine, _request(engine, steering=(spec,)))
        steered_first = firsts[0]
    finally:
        handle.remove()
    assert steered.token_ids != plain.token_ids
    assert (steered_first - plain_first).abs().max() > 0.5
    with torch.inference_mode(), _added(engine, 0, 8.0 * direction):  # the same steering, by hand
        by_hand = engine.model(input_ids=torch.tensor([_prompt(engine)])).logits[0, -1]
    torch.testing.assert_close(steered_first, by_hand, **TIGHT)


def test_ablation_leaves_no_component_along_the_direction(engine: LocalEngine) -> None:
    torch.manual_seed(1)
    direction = torch.randn(_d_model(engine))
    unit = direction / direction.norm()
    capture = CaptureSpec(layers=(0, 1), prompt=True)
    plain = _one(engine, _request(engine, capture=capture))
    ablated = _one(
        engine, _request(engine, capture=capture, steering=SteeringSpec(direction, 0, mode="ablate"))
    )
    assert plain.captured is not None and ablated.captured is not None
    assert (
        plain.captured.tensors[("residual", 0)] @ unit
    ).abs().max() > 0.05  # there was something to remove
    assert (ablated.captured.tensors[("residual", 0)] @ unit).abs().max() < 1e-4
    assert (ablated.captured.tensors[("residual", 1)] @ unit).abs().max() > 1e-3  # only at the steered layer


def test_a_hooked_row_leaves_its_batch_mates_untouched(engine: LocalEngine) -> None:
    a = _request(engine, seed=1)
    b = GenerationRequest(
        _prompt(engine, "What is 2 + 2?"), sampling=SamplingSettings(max_new_tokens=10, seed=2)
    )
    steer = SteeringSpec(torch.ones(_d_model(engine)), layers=(0, 1), coef=6.0)
    steered = _request(engine, seed=3, steering=[steer])
    captured = _request(engine, seed=4, capture=CaptureSpec(layers=(0,)))
    together = engine.generate_batch([a, steered, b, captured])
    assert all(isinstance(r, GenerationResult) for r in together), together
    plain_pair = engine.generate_batch([a, b])
    for got, want in zip([together[0], together[2]], plain_pair, strict=True):
        assert isinstance(got, GenerationResult) and isinstance(want, GenerationResult)
        assert got.token_ids == want.token_ids and got.captured is None and got.batch_size == 2
    alone = _one(engine, steered)
    assert isinstance(together[1], GenerationResult) and together[1].token_ids == alone.token_ids
    assert together[1].batch_size == 1
    assert isinstance(together[3], GenerationResult) and together[3].captured is not None


def test_a_hooked_row_neither_reads_nor_updates_its_reuse_stream(engine: LocalEngine) -> None:
    engine.clear_reuse()
    prompt = _prompt(engine)
    first = _one(
        engine, GenerationRequest(prompt, sampling=SamplingSettings(max_new_tokens=4, seed=1), reuse_key="s")
    )
    kept = engine._kept["s"]
    longer = (*prompt, *first.token_ids, *prompt[-3:])
    hooked_row = _one(
        engine,
        GenerationRequest(
            longer, sampling=SamplingSettings(max_new_tokens=4, seed=1), reuse_key="s", capture=CaptureSpec()
        ),
    )
    assert hooked_row.kv_reused_tokens == 0
    assert engine._kept["s"] is kept  # the stream's cache is the one from the first turn
    again = _one(
        engine, GenerationRequest(longer, sampling=SamplingSettings(max_new_tokens=4, seed=1), reuse_key="s")
    )
    assert again.kv_reused_tokens > 0
    engine.clear_reuse()


# ---------------------------------------------------------------------------------------------- score


def test_score_equals_a_hand_computed_log_softmax(engine: LocalEngine) -> None:
    prompt = _prompt(engine)
    continuation = tuple(engine.tokenizer("Tabs, because they are one byte.")["input_ids"])
    [result] = engine.score([ScoreRequest(prompt, continuation)])
    assert isinstance(result, ScoreResult)
    assert result.continuation_ids == continuation and result.prompt_tokens == len(prompt)
    assert result.captured is None
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([[*prompt, *continuation]])).logits[0].float()
    table = torch.log_softmax(logits, dim=-1)
    by_hand = [float(table[len(prompt) - 1 + i, token]) for i, token in enumerate(continuation)]
    assert result.logprobs == pytest.approx(by_hand, abs=1e-5)
    assert all(lp < 0 for lp in result.logprobs)


def test_score_capture_aligns_with_the_continuation_and_with_generation(engine: LocalEngine) -> None:
    spec = CaptureSpec(sites=ALL_SITES)
    generated = _one(engine, _request(engine, capture=spec))
    prompt, answer = _prompt(engine), tuple(generated.token_ids)
    [scored, with_prompt] = engine.score(
        [
            ScoreRequest(prompt, answer, capture=spec),
            ScoreRequest(prompt, answer, capture=CaptureSpec(layers=(0,), prompt=True)),
        ]
    )
    assert isinstance(scored, ScoreResult) and scored.captured is not None and generated.captured is not None
    assert scored.captured.answer_ids == answer
    for key, tensor in scored.captured.tensors.items():
        assert tensor.shape == (len(answer), _d_model(engine))
        torch.testing.assert_close(tensor, generated.captured.tensors[key], **TIGHT)
    assert isinstance(with_prompt, ScoreResult) and with_prompt.captured is not None
    seen, _ = _teacher_forced(engine, [*prompt, *answer])
    torch.testing.assert_close(with_prompt.captured.tensors[("residual", 0)], seen[("residual", 0)], **TIGHT)


def test_score_with_steering_equals_steering_by_hand(engine: LocalEngine) -> None:
    torch.manual_seed(2)
    direction = torch.randn(_d_model(engine))
    prompt, continuation = _prompt(engine), (5, 6, 7, 8)
    [plain, steered] = engine.score(
        [
            ScoreRequest(prompt, continuation),
            ScoreRequest(prompt, continuation, steering=[SteeringSpec(direction, 1, coef=3.0)]),
        ]
    )
    assert isinstance(plain, ScoreResult) and isinstance(steered, ScoreResult)
    with torch.inference_mode(), _added(engine, 1, 3.0 * direction):
        logits = engine.model(input_ids=torch.tensor([[*prompt, *continuation]])).logits[0].float()
    table = torch.log_softmax(logits, dim=-1)
    by_hand = [float(table[len(prompt) - 1 + i, t]) for i, t in enumerate(continuation)]
    assert steered.logprobs == pytest.approx(by_hand, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(plain.logprobs, steered.logprobs, strict=True)) > 1e-3


def test_score_answers_bad_rows_in_place(engine: LocalEngine) -> None:
    prompt = _prompt(engine)
    good = ScoreRequest(prompt, (5, 6))
    results = engine.score(
        [
            ScoreRequest(prompt, ()),
            good,
            ScoreRequest(prompt, (10**6,)),
            ScoreRequest(prompt, (5,), capture=CaptureSpec(layers=(9,))),
        ]
    )
    assert isinstance(results[0], ConfigurationError) and "continuation_ids=()" in str(results[0])
    assert isinstance(results[1], ScoreResult)
    [alone] = engine.score([good])
    assert isinstance(alone, ScoreResult) and results[1].logprobs == alone.logprobs
    assert isinstance(results[2], ConfigurationError) and "vocabulary" in str(results[2])
    assert isinstance(results[3], ConfigurationError) and "2 decoder layers (0..1)" in str(results[3])
    with pytest.raises(TypeError, match="ScoreRequest"):
        engine.score([_request(engine)])  # type: ignore[list-item]
    assert engine.score([]) == []


# ---------------------------------------------------------------------------------------------- errors, hooks


def test_bad_layer_or_direction_fails_only_its_row(engine: LocalEngine) -> None:
    d = _d_model(engine)
    good = _request(engine, seed=5)
    results = engine.generate_batch(
        [
            _request(engine, capture=CaptureSpec(layers=(0, 7))),
            good,
            _request(engine, steering=[SteeringSpec(torch.ones(d), layers=[1, 2])]),
            _request(engine, steering=[SteeringSpec(torch.ones(d + 1), layers=0)]),
        ]
    )
    assert isinstance(results[0], ConfigurationError)
    assert "capture(layers=[0, 7])" in str(results[0]) and "2 decoder layers (0..1)" in str(results[0])
    assert isinstance(results[1], GenerationResult) and results[1].token_ids == _one(engine, good).token_ids
    assert isinstance(results[2], ConfigurationError)
    assert "SteeringSpec(layers=[1, 2])" in str(results[2]) and "(0..1)" in str(results[2])
    assert isinstance(results[3], ConfigurationError)
    assert f"has {d + 1} entries" in str(results[3]) and f"{d} wide" in str(results[3])


def test_hooks_are_removed_after_the_row_even_when_it_fails(engine: LocalEngine) -> None:
    before = _hooks(engine.model)
    _one(
        engine,
        _request(
            engine,
            capture=CaptureSpec(sites=ALL_SITES),
            steering=SteeringSpec(torch.ones(_d_model(engine)), 0),
        ),
    )
    assert _hooks(engine.model) == before

    cancelled = threading.Event()
    calls: list[int] = []

    def cancel_after_prefill(module: nn.Module, args: Any, output: Any) -> None:
        calls.append(len(_hooks(engine.model)))
        cancelled.set()

    handle = engine.model.register_forward_hook(cancel_after_prefill)
    try:
        request = _request(engine, max_new_tokens=20, capture=CaptureSpec(sites=ALL_SITES))
        with pytest.raises(BatchCancelled):
            engine.generate_batch([request], mode=ExecutionMode.DETERMINISTIC, cancelled=cancelled)
    finally:
        handle.remove()
    assert calls and calls[0] == len(before) + 1 + 3 * len(_blocks(engine))  # the row's hooks, while it ran
    assert _hooks(engine.model) == before

    layers = decoder_layers(engine.model)
    with pytest.raises(RuntimeError, match="boom"), hooked(layers, capture=CaptureSpec(sites=ALL_SITES)):
        assert len(_hooks(engine.model)) == len(before) + 3 * len(layers)
        raise RuntimeError("boom")
    assert _hooks(engine.model) == before


# ---------------------------------------------------------------------------------------------- structure


def test_decoder_layers_are_found_by_structure(engine: LocalEngine) -> None:
    found = decoder_layers(engine.model)
    blocks = list(_blocks(engine))
    assert [f.module for f in found] == blocks
    assert [f.attn for f in found] == [b.self_attn for b in blocks]
    assert [f.mlp for f in found] == [b.mlp for b in blocks]


class _Mixer(nn.Module):  # class names that say neither Attention nor MLP: found by attribute name
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)


class _Block(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.self_attn = _Mixer(width)
        self.mlp = _Mixer(width)


class _SelfAttention(nn.Module):
    pass


class _GatedFeedForward(nn.Module):
    pass


class _Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _SelfAttention()
        self.ff = _GatedFeedForward()


class _Toy(nn.Module):
    def __init__(self, blocks: list[nn.Module], n_layers: int | None) -> None:
        super().__init__()
        self.config = type("Config", (), {"num_hidden_layers": n_layers, "hidden_size": 4})()
        self.heads = nn.ModuleList([nn.Linear(4, 4) for _ in range(len(blocks))])
        self.stack = nn.Sequential(nn.ModuleList(blocks))


def test_structure_search_without_a_family_table() -> None:
    by_name = _Toy([_Block(), _Block(), _Block()], 3)
    found = decoder_layers(by_name)
    assert [f.module for f in found] == list(by_name.stack[0])
    assert [f.attn for f in found] == [b.self_attn for b in by_name.stack[0]]

    by_class = _Toy([_Other(), _Other()], None)  # no layer count: the list of attention+MLP blocks
    found = decoder_layers(by_class)
    assert [f.attn for f in found] == [b.mixer for b in by_class.stack[0]]
    assert [f.mlp for f in found] == [b.ff for b in by_class.stack[0]]

    vision_first = _Toy([_Block(8), _Block(8)], 2)  # a vision tower as deep as the text stack, but 8 wide
    vision_first.text = nn.ModuleList([_Block(), _Block()])
    assert [f.module for f in decoder_layers(vision_first)] == list(vision_first.text)

    with pytest.raises(ConfigurationError, match="cannot find the decoder layers of this _Toy"):
        decoder_layers(_Toy([nn.Linear(4, 4)] * 2, 5))


# ---------------------------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capture": "residual"}, "capture='residual'"),
        ({"capture": {"sites": ["residual"]}}, "must be a CaptureSpec or None"),
        ({"steering": [1.0, 2.0]}, "steering= takes a SteeringSpec, a list of them"),
        ({"steering": "add"}, "steering='add'"),
        ({"capture": CaptureSpec(sites=("resid",))}, "capture(sites=('resid',))"),
        ({"capture": CaptureSpec(layers=(-1,))}, "capture(layers=(-1,))"),
    ],
)
def test_interp_fields_are_validated_on_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match="GenerationRequest") as info:
        GenerationRequest((1, 2), sampling=SamplingSettings(max_new_tokens=4), **kwargs)
    assert message in str(info.value)
    with pytest.raises(ConfigurationError, match="ScoreRequest") as info:
        ScoreRequest((1, 2), (3,), **kwargs)
    assert message in str(info.value)


def test_request_fields_are_normalised() -> None:
    spec = SteeringSpec([1.0, 0.0], layers=0)
    request = GenerationRequest([1, 2], sampling=SamplingSettings(max_new_tokens=4), steering=spec)  # type: ignore[arg-type]
    assert request.steering == (spec,) and request.interp and request.capture is None
    assert not GenerationRequest([1], sampling=SamplingSettings(max_new_tokens=4)).interp
    repeated = GenerationRequest(
        [1], sampling=SamplingSettings(max_new_tokens=4), capture=CaptureSpec(layers=(1, 0, 1))
    )
    assert repeated.capture == CaptureSpec(layers=(0, 1))
    score = ScoreRequest([1, 2], [3], steering=[spec])
    assert score.prompt_ids == (1, 2) and score.continuation_ids == (3,) and score.steering == (spec,)
    with pytest.raises(ConfigurationError, match=r"ScoreRequest\(continuation_ids='ab'\)"):
        ScoreRequest([1], "ab")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="every continuation id must be a non-negative int"):
        ScoreRequest([1], [-1])
    with pytest.raises(ConfigurationError, match="prompt is empty"):
        ScoreRequest([], [1])
