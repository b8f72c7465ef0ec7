"""The static decode step (``engine/_static_step.py``) on the CPU: what a CUDA graph of it would need.

Its tokens are the engine's eager decode's (greedy, seeded temperature and top-p rows, recorded
log-probabilities), with or without dummy rows up to the bucket; ``torch.compile(fullgraph=True)`` takes it
as one frame per bucket over 128+ steps with the same tokens; a stand-in for a CUDA graph sees every static
buffer at its captured address at each replay, across two batches; a step reads nothing back from the
device and sends at most the uniforms' block to it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_engine_syncs import CountedCalls
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import ConfigurationError
from interlens.engine._buckets import ROW_BUCKETS, length_bucket, row_bucket
from interlens.engine._cpu_attention import use_cpu_decode_attention
from interlens.engine._decode import left_pad
from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings
from interlens.engine._sampler import Sampler
from interlens.engine._static_sampler import sample_rows, variant_for
from interlens.engine._static_step import StaticDecodeStep, static_cache
from interlens.testing import tiny_model

#: A greedy row, a seeded row at temperature 0.8, a seeded nucleus row, a seeded nucleus row at T = 1.3.
SETTINGS = (
    SamplingSettings(max_new_tokens=24, temperature=0),
    SamplingSettings(max_new_tokens=24, temperature=0.8, seed=11),
    SamplingSettings(max_new_tokens=24, temperature=1.0, top_p=0.7, seed=-5),
    SamplingSettings(max_new_tokens=24, temperature=1.3, top_p=0.9, seed=2),
)
PROMPTS = ("The cat sat on", "a", "Numbers: 1 2 3 4 5 6 7", "tabs tabs tabs")


@pytest.fixture(scope="module")
def loaded(qwen2_path: str) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(qwen2_path).eval(), AutoTokenizer.from_pretrained(qwen2_path)


def prompts(tokenizer: Any, n: int = len(PROMPTS)) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS[:n]]


def prefill(model: Any, ids: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The prompts left-padded and prefilled in a cache of their own (what ``ModelRunner.forward`` does):
    the cache, the prompt mask and the last position's logits."""
    width = max(len(p) for p in ids)
    padded, mask = left_pad(ids, width, 0)
    attention = torch.tensor(mask)
    kv = static_cache(model, rows=len(ids), length=width)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(padded),
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
            cache=kv,
            use_cache=True,
            logits_to_keep=1,
        )
    return kv, attention, out.logits[:, -1, :]


def generate(
    step: StaticDecodeStep, model: Any, ids: list[list[int]], settings: tuple[SamplingSettings, ...], new: int
) -> tuple[list[list[int]], list[list[list[float]]]]:
    """``new`` tokens per real row through ``step`` (the first from the prefill's logits): per row, its
    tokens and their (model, sampling) log-probabilities."""
    kv, mask, logits = prefill(model, ids)
    n = len(ids)
    first = step.begin(settings, kv=kv, prompt_mask=mask, logits=logits)
    tokens, logprobs = (
        [first.tokens.tolist()],
        [first.logprobs.tolist() if first.logprobs is not None else []],
    )
    for _ in range(new - 1):
        step.step()
        tokens.append(step.tokens[:n].tolist())
        logprobs.append(step.logprobs[:n].tolist())
    return [list(row) for row in zip(*tokens, strict=True)], [list(r) for r in zip(*logprobs, strict=True)]


def flat(logprobs: list[list[list[float]]]) -> list[float]:
    return [x for row in logprobs for pair in row for x in pair]


def built(model: Any, settings: tuple[SamplingSettings, ...], *, rows: int, length: int) -> StaticDecodeStep:
    return StaticDecodeStep(model, rows=rows, length=length, variant=variant_for(settings), record=True)


# ---------------------------------------------------------------------------------------------- buckets


def test_row_and_length_buckets() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 5, 16, 17, 25, 33, 200, 256)] == [
        1, 2, 4, 8, 16, 24, 32, 48, 256, 256,
    ]  # fmt: skip
    assert all(row_bucket(b) == b for b in ROW_BUCKETS)
    assert [length_bucket(n) for n in (1, 256, 257, 700)] == [256, 256, 512, 768]
    assert [length_bucket(n, quantum=32) for n in (1, 32, 33)] == [32, 32, 64]
    with pytest.raises(ConfigurationError, match=r"row_bucket\(n=257\).*split the batch"):
        row_bucket(257)
    with pytest.raises(ConfigurationError, match=r"row_bucket\(n=0\): n must be an int >= 1"):
        row_bucket(0)


# ---------------------------------------------------------------------------------------------- tokens


def load(family: str) -> Any:
    """A tiny model of ``family``; gemma2 (sliding and full layers alternating) with a window of 8 slots,
    which the prompts and the steps pass."""
    window = {"sliding_window": 8} if family == "gemma2" else {}
    return AutoModelForCausalLM.from_pretrained(tiny_model(family), **window).eval()


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_tokens_and_logprobs_equal_the_engines_eager_decode(family: str) -> None:
    """Each variant's batch (all greedy; greedy and tempered; every kind, nucleus rows too) in its own row
    bucket and in one of 8: the engine's tokens exactly, its recorded log-probabilities to float32 rounding
    (its prefill groups and attention differ in the last bits). gemma2's sliding layers are full-length
    here, their window in the model's mask; the engine's eager loop keeps them as ring buffers."""
    path = tiny_model(family)
    model = load(family)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = LocalEngine(model, tokenizer, device="cpu")
    engine._runner.eos_ids = frozenset()  # every row runs its whole length: the step never ends a row
    greedy = (SETTINGS[0], SamplingSettings(max_new_tokens=24, temperature=0, top_p=0.5))
    for settings in (greedy, SETTINGS[:2], SETTINGS):
        ids = prompts(tokenizer, len(settings))
        requests = [
            GenerationRequest(prompt_ids=tuple(p), sampling=s, record_logprobs=True)
            for p, s in zip(ids, settings, strict=True)
        ]
        expected = engine.generate_batch(requests)
        for rows in (row_bucket(len(settings)), 8):
            tokens, logprobs = generate(
                built(model, settings, rows=rows, length=64), model, ids, settings, 24
            )
            for result, row_tokens, row_lps in zip(expected, tokens, logprobs, strict=True):
                assert not isinstance(result, Exception)
                assert row_tokens == result.token_ids, (variant_for(settings), rows)
                assert result.model_logprobs is not None and result.sampling_logprobs is not None
                assert [m for m, _ in row_lps] == pytest.approx(result.model_logprobs, abs=1e-4)
                assert [s for _, s in row_lps] == pytest.approx(result.sampling_logprobs, abs=1e-4)
    assert any(lp != 0.0 for lp in expected[1].sampling_logprobs or [])  # type: ignore[union-attr]


def test_the_sampler_is_the_eager_samplers_bit_for_bit() -> None:
    """``sample_rows`` against ``Sampler.choose`` on the same logits and uniforms at a vocabulary of 5,000
    (the block-wise draw), every kind of row, one row of NaN and one of -inf: the same tokens, finite flags
    and log-probabilities, bit for bit."""
    rows, vocab = 7, 5000
    settings = (*SETTINGS, SETTINGS[0], SETTINGS[3], SETTINGS[1])  # row 4 (NaN) greedy, row 5 (-inf) not
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[4] = float("nan")
    logits[5] = float("-inf")
    eager = Sampler(settings, "cpu", record=True)
    expected = eager.choose(logits)
    uniforms = torch.full((rows,), 0.5)
    again = Sampler(settings, "cpu", record=True)  # the same streams: the uniforms the eager draw used
    uniforms[torch.tensor(again.greedy.sampling)] = again.uniforms.next()
    is_greedy = torch.tensor([s.temperature <= 0 for s in settings])
    tokens, finite, logprobs = sample_rows(
        logits,
        temperature=torch.tensor([1.0 if s.temperature <= 0 else s.temperature for s in settings]),
        top_p=torch.tensor([1.0 if s.temperature <= 0 else s.top_p for s in settings]),
        greedy=is_greedy,
        uniforms=uniforms,
        variant=variant_for(settings),
        record=True,
    )
    assert finite.tolist() == expected.finite.tolist() == [True] * 4 + [False, False, True]
    usable = expected.finite
    assert torch.equal(tokens[usable], expected.tokens[usable])
    assert logprobs is not None and expected.logprobs is not None
    assert torch.equal(logprobs[usable], expected.logprobs[usable])


def test_real_rows_are_the_same_with_dummy_rows(loaded: tuple[Any, Any]) -> None:
    """Two real rows in a bucket of 2 and of 8 (six dummies): the same tokens, log-probabilities to
    float32 rounding (a matrix product of 8 rows may block its sums otherwise than one of 2)."""
    model, tokenizer = loaded
    ids, settings = prompts(tokenizer, 2), SETTINGS[1:3]
    alone = generate(built(model, settings, rows=2, length=48), model, ids, settings, 32)
    padded = generate(built(model, settings, rows=8, length=48), model, ids, settings, 32)
    assert alone[0] == padded[0]
    assert flat(alone[1]) == pytest.approx(flat(padded[1]), abs=1e-4)


# ---------------------------------------------------------------------------------------------- compile


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_compiles_to_one_frame_per_bucket_with_the_eager_tokens(family: str, loaded: tuple[Any, Any]) -> None:
    """``torch.compile(fullgraph=True)`` of the step's function: one frame for each of two buckets over 130
    steps each (no recompiles as positions, the cache's write position and the tokens change), the eager
    tokens exactly. The counting backend runs the captured graph as it is (what matters here is that
    Dynamo takes the whole step once; inductor is the GPU session's part). gemma2 (40 steps): its sliding
    mask, logit soft-capping and eager attention inside the one frame too."""
    model, tokenizer = (
        loaded if family == "qwen2" else (load(family), AutoTokenizer.from_pretrained(tiny_model(family)))
    )
    new = 131 if family == "qwen2" else 40  # gemma2: five times past its window of 8
    for rows, settings in ((2, SETTINGS[:2]), (4, SETTINGS)):
        ids = prompts(tokenizer, len(settings))
        length = length_bucket(max(len(p) for p in ids) + new, quantum=64)
        eager = generate(built(model, settings, rows=rows, length=length), model, ids, settings, new)
        step = built(model, settings, rows=rows, length=length)
        counter = CompileCounter()
        step.run = torch.compile(step._forward_and_sample, fullgraph=True, backend=counter)
        compiled = generate(step, model, ids, settings, new)
        assert counter.frame_count == 1, f"bucket of {rows} rows: {counter.frame_count} frames"
        assert compiled[0] == eager[0]
        assert flat(compiled[1]) == pytest.approx(flat(eager[1]), abs=1e-5)  # decomposed ops round apart
        # a second batch through the same compiled step: still the one frame
        generate(step, model, ids, settings, 8)
        assert counter.frame_count == 1


def test_compiles_with_the_engines_cpu_decode_attention(qwen2_path: str) -> None:
    """The attention the engine gives a model on the CPU (``_cpu_attention``, from 8 rows) is inside the
    one frame too, with the eager tokens."""
    model = AutoModelForCausalLM.from_pretrained(qwen2_path).eval()
    assert use_cpu_decode_attention(model)
    ids = prompts(AutoTokenizer.from_pretrained(qwen2_path))
    eager = generate(built(model, SETTINGS, rows=8, length=64), model, ids, SETTINGS, 40)
    step = built(model, SETTINGS, rows=8, length=64)
    counter = CompileCounter()
    step.run = torch.compile(step._forward_and_sample, fullgraph=True, backend=counter)
    assert generate(step, model, ids, SETTINGS, 40)[0] == eager[0]
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------------- graph


class AddressCheckingGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: :meth:`capture` records every static buffer's address,
    shape and dtype; :meth:`replay` checks them before and after running the step's function (a real graph
    replays its kernels over the captured addresses whatever the Python objects now point to)."""

    def __init__(self, step: StaticDecodeStep) -> None:
        self.step = step
        self.captured: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self.replays = 0

    def addresses(self) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
        return {k: (t.data_ptr(), tuple(t.shape), t.dtype) for k, t in self.step.buffers().items()}

    def capture(self) -> None:
        self.captured = self.addresses()

    def replay(self) -> None:
        assert self.addresses() == self.captured, "a static buffer moved before a replay"
        self.step._forward_and_sample()
        assert self.addresses() == self.captured, "a static buffer moved during a step"
        self.replays += 1


def test_static_buffers_never_move_across_batches(loaded: tuple[Any, Any]) -> None:
    """Captured once at construction, the graph replays over two whole batches (begin() refills every
    buffer in place), with the tokens of an eager step."""
    model, tokenizer = loaded
    settings = SETTINGS
    ids = prompts(tokenizer)
    step = built(model, settings, rows=8, length=64)
    graph = AddressCheckingGraph(step)
    graph.capture()
    step.run = graph.replay
    first = generate(step, model, ids, settings, 20)
    second = generate(step, model, ids[:2], settings[:2], 12)
    assert graph.replays == 19 + 11
    assert len(step.buffers()) == 10 + 3 * len(step.cache.layers)
    assert first[0] == generate(built(model, settings, rows=8, length=64), model, ids, settings, 20)[0]
    assert [row[:12] for row in first[0][:2]] == second[0]


def test_rows_carry_on_across_a_hand_over(loaded: tuple[Any, Any]) -> None:
    """Four rows run 10 steps in a bucket whose slots then run out; rows 1 and 3 carry on in a bucket of 2
    rows and a longer length (its buffers under the address-checking graph), then row 3 alone compacted in
    place: each row's tokens are those of the batch run whole in one bucket."""
    model, tokenizer = loaded
    settings, ids = SETTINGS, prompts(tokenizer)
    whole = generate(built(model, settings, rows=4, length=64), model, ids, settings, 30)
    kv, mask, logits = prefill(model, ids)
    first = built(model, settings, rows=4, length=mask.shape[1] + 10)
    tokens = [first.begin(settings, kv=kv, prompt_mask=mask, logits=logits).tokens.tolist()]
    for _ in range(10):
        first.step()
        tokens.append(first.tokens.tolist())
    assert first.slots_left == 0
    second = built(model, settings[1::2], rows=2, length=64)
    graph = AddressCheckingGraph(second)
    graph.capture()
    second.run = graph.replay
    first.hand_over([1, 3], second)
    for _ in range(10):
        second.step()
        tokens.append([-1, second.tokens[0].item(), -1, second.tokens[1].item()])
    second.hand_over([1], second)  # row 3 alone, compacted into the front row in place
    for _ in range(9):
        second.step()
        tokens.append([-1, -1, -1, second.tokens[0].item()])
    assert graph.replays == 19
    columns = [list(row) for row in zip(*tokens, strict=True)]
    assert columns[0][:11] == whole[0][0][:11] and columns[2][:11] == whole[0][2][:11]
    assert columns[1][:21] == whole[0][1][:21]
    assert columns[3] == whole[0][3]


# ---------------------------------------------------------------------------------------------- syncs


def test_a_step_reads_nothing_from_the_device(loaded: tuple[Any, Any]) -> None:
    """Counted as ``tests/test_engine_syncs.py`` counts them: 48 steps make no host read and build at most
    the uniforms' blocks of seeded draws (16, 32: two) on the device; the caller's one read of the tokens a
    step is the only sync of the loop."""
    model, tokenizer = loaded
    settings = SETTINGS
    kv, mask, logits = prefill(model, prompts(tokenizer))
    step = built(model, settings, rows=4, length=128)
    step.begin(settings, kv=kv, prompt_mask=mask, logits=logits)  # draws the first step's uniforms
    with CountedCalls() as counted:
        for _ in range(48):
            step.step()
    assert counted.calls["host_read"] == 0
    assert counted.calls["to_device"] <= 2
    with CountedCalls() as counted:
        for _ in range(8):
            step.step()
            step.tokens.tolist()
    assert counted.calls["host_read"] == 8


# ---------------------------------------------------------------------------------------------- errors


def test_refuses_what_it_cannot_serve(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    kv, mask, logits = prefill(model, prompts(tokenizer, 2))
    greedy = StaticDecodeStep(model, rows=2, length=32, variant="greedy", record=False)
    with pytest.raises(ConfigurationError, match=r"step.*no batch begun"):
        greedy.step()
    with pytest.raises(ConfigurationError, match="need the 'top_p' sampler variant"):
        greedy.begin(SETTINGS[1:3], kv=kv, prompt_mask=mask, logits=logits)
    with pytest.raises(ConfigurationError, match="variant must be one of greedy, sample, top_p"):
        StaticDecodeStep(model, rows=2, length=32, variant="nucleus", record=False)
    full = StaticDecodeStep(model, rows=2, length=mask.shape[1] + 2, variant="top_p", record=False)
    full.begin(SETTINGS[1:3], kv=kv, prompt_mask=mask, logits=logits)
    full.step()
    full.step()
    assert full.slots_left == 0
    with pytest.raises(ConfigurationError, match=r"length bucket of .* slots is full"):
        full.step()
    with pytest.raises(ConfigurationError, match=r"keep=\[1, 0\]\): keep must be ascending indices"):
        full.hand_over([1, 0], full)
    with pytest.raises(
        ConfigurationError, match=r"hand_over\(\): the \d+ slots already written leave no slot"
    ):
        full.hand_over([0, 1], full)  # the same full bucket: nowhere to go
    with pytest.raises(ConfigurationError, match=r"hand_over\(\): these settings need the 'sample' sampler"):
        full.hand_over([0], greedy)
