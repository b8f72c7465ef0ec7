"""Deterministic rows' static slot steps (``engine/_slot_step.py``, ``engine/_slot_decode.py``) on the CPU:
what a CUDA run replays as graphs.

Two engines over one tiny model in the dtype that co-steps on this CPU: the slot layout's eager steps in one,
its static steps in the other (the address-checking stand-in for a CUDA graph, as
``tests/test_static_decode.py`` uses). Deterministic rows of every kind of setting get the eager slot path's
tokens and log-probabilities and each row's tokens alone, across hand-overs between row buckets and a second
turn whose prompts load kept prefill blocks, with no static buffer moving and every prefill written straight
into the pool (no cache layer allocates KV of its own); the self-test probes the static steps; a pool sized
from a budget splits a batch; a step reads the device once; ``torch.compile(fullgraph=True)`` takes each
bucket's step as one frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_engine_syncs import per_step
from test_kv_pool import count_allocations
from test_static_step import AddressCheckingGraph
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import ConfigurationError, GenerationError
from interlens.engine._decode_graphs import GraphRunner
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.engine._slot_decode import SlotDecoder
from interlens.engine._slot_step import SlotDecodeStep
from interlens.engine._static_decode import ENV_SWITCH
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

DET = ExecutionMode.DETERMINISTIC

#: greedy, seeded tempered, seeded nucleus, seeded tempered nucleus
MIX = (
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 11},
    {"temperature": 1.0, "top_p": 0.7, "seed": -5},
    {"temperature": 1.3, "top_p": 0.9, "seed": 2},
)


@pytest.fixture(scope="module")
def loaded(co_step_dtype: str) -> tuple[Any, Any]:
    path = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, co_step_dtype)).eval()
    return model, AutoTokenizer.from_pretrained(path)


def engines(loaded: tuple[Any, Any], graph: Any = AddressCheckingGraph) -> tuple[LocalEngine, LocalEngine]:
    """(eager slot steps, static slot steps under ``graph``) over the one model."""
    eager, static = LocalEngine(*loaded, device="cpu"), LocalEngine(*loaded, device="cpu")
    eager._slots.decoder = None
    static._slots.decoder = SlotDecoder(static._runner, graphs=GraphRunner(device="cpu", graph_type=graph))
    return eager, static


def decoder_of(engine: LocalEngine) -> SlotDecoder:
    decoder = engine._slots.decoder
    assert isinstance(decoder, SlotDecoder)
    return decoder


def requests(prompts: Sequence[tuple[int, ...]], new: Sequence[int]) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_ids=p,
            sampling=SamplingSettings(max_new_tokens=n, **MIX[i % len(MIX)]),  # type: ignore[arg-type]
            record_logprobs=True,
        )
        for i, (p, n) in enumerate(zip(prompts, new, strict=True))
    ]


def ok(results: Sequence[Any]) -> list[GenerationResult]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return list(results)


def test_static_slot_steps_give_the_eager_slot_paths_tokens_and_each_rows_alone(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten deterministic rows under one system block (prefilled once in a row of its own, then loaded for
    every row), two of them with one prompt (caps 3 to 30: hand-overs 12 -> 8 -> 4 rows), then a second
    turn whose prompts extend the first's (its prefill loads the kept blocks): the eager slot path's tokens
    and log-probabilities bit for bit, each row's tokens alone; every step a stand-in graph replay over
    buffers that never moved, on one pool never reallocated. Every prefill, the self-test's included,
    wrote straight into the pool: no cache layer allocated storage of its own (the eager path's did)."""
    allocations = count_allocations(monkeypatch)
    eager, static = engines(loaded)
    decoder = decoder_of(static)
    assert static.batch_invariant  # the self-test first: its probes grow the pool (to 12 x 192 slots)
    assert sum(allocations.values()) == 0
    decoder.pool.reserve(12, 256)
    generation = decoder.pool.generation
    tokenizer = loaded[1]
    system = tuple(tokenizer("You are one of ten debaters; argue briefly and well. " * 4).input_ids)
    assert len(system) > 32  # a full prefill block shared by every row
    prompts = [
        (*system, *tokenizer(f"row {i}: " + "tabs and spaces " * (i % 5)).input_ids) for i in range(10)
    ]
    prompts[7] = prompts[0]  # rows 0 and 7 share one prompt: prefilled once, expanded in the pool
    new = [3, 30, 5, 8, 12, 4, 16, 6, 9, 28]
    for turn in range(2):
        before = sum(allocations.values())
        expected = ok(eager.generate_batch(requests(prompts, new), mode=DET))
        assert sum(allocations.values()) > before  # the eager slot path's own cache (the count works)
        before = sum(allocations.values())
        got = ok(static.generate_batch(requests(prompts, new), mode=DET))
        assert sum(allocations.values()) == before, turn
        assert [r.batch_size for r in got] == [10] * 10
        for x, y in zip(got, expected, strict=True):
            assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
            assert (x.model_logprobs, x.sampling_logprobs) == (y.model_logprobs, y.sampling_logprobs)
        for i in (0, 2, 9):  # greedy, seeded nucleus, seeded tempered
            alone = ok(static.generate_batch(requests(prompts, new)[i : i + 1], mode=DET))[0]
            assert alone.token_ids == got[i].token_ids, (turn, i)
        prompts = [
            (*p, *r.token_ids, *tokenizer(" then").input_ids) for p, r in zip(prompts, got, strict=True)
        ]
    assert static._slots.prefixes.hits > 0  # the second turn's prefill loaded kept blocks
    assert decoder.stats["hand-overs"] >= 4 and decoder.stats["batches"] == 2 + 6
    assert decoder.stats["prefills: in the pool"] == 8 and decoder.stats["prefills: copied in"] == 0
    assert not any(key.startswith("steps: eager") for key in decoder.stats)
    replays = [decoder.graphs.graph(key).replays for key in decoder.loop.steps]
    assert decoder.stats["steps: graph"] == sum(replays) - len(replays) > 0  # less each check at capture
    assert decoder.graphs.failed is None and decoder.pool.generation == generation


def test_the_self_test_probes_the_static_steps_and_keys_its_verdict_by_them(loaded: tuple[Any, Any]) -> None:
    """With the decoder on, the self-test runs the static steps over the decoder's pool (before any batch
    decoded), passes, and its verdict is kept apart from the eager steps' one.

    Then a pool sized from a budget of 256 slots (4 rows x one 64-slot length): six short deterministic
    rows co-step as 4 + 2, and a row whose prompt needs more slots than the whole pool runs alone on the
    eager slot steps in a cache of its own (counted once): the eager slot path's tokens and log-probabilities
    for the seven rows in one batch (a row's tokens whatever its company), the pool allocated once, at the
    budget's size."""
    eager, static = engines(loaded)
    decoder = decoder_of(static)
    assert decoder.pool.nbytes() == 0
    assert static.batch_invariant is True and eager.batch_invariant is True
    assert decoder.pool.nbytes() > 0 and decoder.stats["batches"] == 0
    fields = ("invariant", "fixed_linear_rows")
    eager_key, eager_verdict = eager._verdicts.lookup(eager._self_test_probe(rows=None), fields)
    static_key, static_verdict = static._verdicts.lookup(static._self_test_probe(rows=None), fields)
    assert eager_key is not None and static_key is not None and eager_key.path != static_key.path
    assert static_key.parts["probe"]["static_steps"] is True
    assert "static_steps" not in eager_key.parts["probe"]
    assert eager_verdict is not None and static_verdict is not None and static_verdict["invariant"] is True

    decoder.release()  # the self-test's probes grew the pool past any budget
    decoder.pool.budget = lambda: 256
    generation = decoder.pool.generation
    tokenizer = loaded[1]
    prompts = [tuple(tokenizer(f"row {i} speaks").input_ids) for i in range(6)]
    prompts.append(tuple(tokenizer("long " * 70).input_ids))
    new = [6, 9, 4, 7, 5, 8, 6]
    expected = ok(eager.generate_batch(requests(prompts, new), mode=DET))
    got = ok(static.generate_batch(requests(prompts, new), mode=DET))
    for x, y in zip(got, expected, strict=True):
        assert (x.token_ids, x.model_logprobs) == (y.token_ids, y.model_logprobs)
    assert [r.batch_size for r in got] == [4, 4, 4, 4, 2, 2, 1]
    assert decoder.pool.slots == 256 and decoder.pool.generation == generation + 1
    assert decoder.stats["batches"] == 2 and decoder.stats["eager batches: pool full"] == 1
    assert decoder.stats["prefills: in the pool"] == 2


def test_a_static_slot_step_reads_the_device_once(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tests/test_engine_syncs.py``'s count for deterministic rows with the switch on (the engine builds its
    slot decoder): one host read a step (the chosen tokens), the seeded uniforms' block copies at most."""
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert LocalEngine(*loaded, device="cpu")._slots.decoder is not None
    steps = per_step(loaded, DET)
    assert steps["host_read"] == 1.0
    assert steps["to_device"] <= 1 / 8
    monkeypatch.setenv(ENV_SWITCH, "")
    assert LocalEngine(*loaded, device="cpu")._slots.decoder is None


class CompiledGraph:
    """Stands in for a CUDA graph with ``torch.compile(fullgraph=True)`` of the step's function (a counting
    backend: Dynamo must take the whole step as one frame; inductor is the GPU session's part)."""

    counter = CompileCounter()

    def __init__(self, step: SlotDecodeStep) -> None:
        self.step = step
        self.compiled: Any = None

    def capture(self) -> None:
        self.compiled = torch.compile(self.step._forward_and_sample, fullgraph=True, backend=self.counter)

    def replay(self) -> None:
        self.compiled()


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_the_slot_step_compiles_to_one_frame_per_bucket_with_the_eager_tokens(
    family: str, loaded: tuple[Any, Any]
) -> None:
    """Five rows with fixed-order norms (as on CUDA; the chunked linears off, as there): 48 steps over two
    row buckets (8 rows, then 4 once a row ended), each bucket's step one frame whatever the positions,
    every step compiled (no eager step, no recompile), the eager slot path's tokens and log-probabilities.
    gemma2 (a window of 8 slots, 24 steps): its per-layer-type masks, built in the step, inside the one
    frame."""
    if family != "qwen2":
        path = tiny_model(family)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=loaded[0].dtype, sliding_window=8).eval()
        loaded = (model, AutoTokenizer.from_pretrained(path))
    eager, static = engines(loaded, graph=CompiledGraph)
    for engine in (eager, static):
        engine._slots.fixed_norms = True
    tokenizer = loaded[1]
    prompts = [tuple(tokenizer(f"compiled row {i}").input_ids) for i in range(5)]
    long = (
        48 if family == "qwen2" else 24
    )  # gemma2: three times past its window, a frame per bucket all the same
    new = [12, long, long, long, long]
    expected = ok(eager.generate_batch(requests(prompts, new), mode=DET))
    before = CompiledGraph.counter.frame_count
    got = ok(static.generate_batch(requests(prompts, new), mode=DET))
    assert eager._slots.fixed_linear_rows is False and static._slots.fixed_linear_rows is False
    decoder = decoder_of(static)
    assert decoder.graphs.stats["captures"] == 2 and decoder.stats["hand-overs"] == 1
    assert CompiledGraph.counter.frame_count - before == 2
    assert decoder.stats["steps: graph"] >= long - 1 and not any(
        k.startswith("steps: eager") for k in decoder.stats
    )
    for x, y in zip(got, expected, strict=True):
        assert x.token_ids == y.token_ids
        assert x.model_logprobs == pytest.approx(y.model_logprobs, abs=1e-5)


def test_a_row_whose_logits_go_non_finite_fails_alone_and_leaves_nothing_in_the_pool(
    loaded: tuple[Any, Any], qwen2_path: str
) -> None:
    """A token's embedding set to NaN: the row that generates it fails with the eager slot path's error, the
    others carry on to the same tokens; restored, the next batch over the same pool rows (where the failed
    row's KV went NaN) gets the eager path's tokens again: ``begin`` zeroes the slots past a prefill."""
    model = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=loaded[0].dtype).eval()
    eager, static = engines((model, loaded[1]))
    prompts = [tuple(loaded[1](f"row {i} speaks").input_ids) for i in range(4)]
    before = ok(eager.generate_batch(requests(prompts, [12] * 4), mode=DET))
    poisoned = before[2].token_ids[4]
    weight = model.get_input_embeddings().weight
    saved = weight[poisoned].clone()
    with torch.no_grad():
        weight[poisoned] = float("nan")
    expected = eager.generate_batch(requests(prompts, [12] * 4), mode=DET)
    assert isinstance(expected[2], GenerationError)
    got = static.generate_batch(requests(prompts, [12] * 4), mode=DET)
    assert isinstance(got[2], GenerationError) and str(got[2]) == str(expected[2])
    assert [r.token_ids for r in ok(got[:2] + got[3:])] == [
        r.token_ids for r in ok(expected[:2] + expected[3:])
    ]
    with torch.no_grad():
        weight[poisoned] = saved
    again = ok(static.generate_batch(requests(prompts[::-1], [12] * 4), mode=DET))
    assert [r.token_ids for r in again] == [
        r.token_ids for r in ok(eager.generate_batch(requests(prompts[::-1], [12] * 4), mode=DET))
    ]


def test_sliding_window_models_co_step_on_static_slot_steps(co_step_dtype: str) -> None:
    """gemma3 (sdpa, query pre-attention scaling; gemma2 in the compile test above) over a window of 8
    slots: every layer full-length in the pool, a sliding layer's window counted back from each row's own
    position in a mask the step builds. The self-test probes the static steps and passes; six rows of every
    setting, prompts and caps past the window, get the eager slot path's tokens and log-probabilities bit
    for bit and each row's tokens alone; every step a stand-in graph's replay."""
    path = tiny_model("gemma3")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, co_step_dtype), sliding_window=8
    ).eval()
    eager, static = engines((model, AutoTokenizer.from_pretrained(path)))
    decoder = decoder_of(static)
    assert decoder.pool.window == 8 and static._slots.static_steps()
    assert static.batch_invariant and eager.batch_invariant
    for engine in (eager, static):
        engine._runner.eos_ids = frozenset()  # every row runs to its cap: past the window
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tuple(tokenizer(f"row {i}: " + "tabs and spaces " * (i % 3 + 1)).input_ids) for i in range(6)]
    new = [3, 20, 5, 12, 9, 16]
    expected = ok(eager.generate_batch(requests(prompts, new), mode=DET))
    got = ok(static.generate_batch(requests(prompts, new), mode=DET))
    assert [r.batch_size for r in got] == [6] * 6 and [r.n_tokens for r in got] == new
    for x, y in zip(got, expected, strict=True):
        assert (x.token_ids, x.model_logprobs, x.sampling_logprobs) == (
            y.token_ids,
            y.model_logprobs,
            y.sampling_logprobs,
        )
    for i in (1, 3):  # seeded tempered, seeded tempered nucleus
        alone = ok(static.generate_batch(requests(prompts, new)[i : i + 1], mode=DET))[0]
        assert alone.token_ids == got[i].token_ids, i
    assert decoder.stats["hand-overs"] >= 1 and decoder.stats["batches"] == 3
    assert not any(key.startswith(("steps: eager", "eager batches")) for key in decoder.stats)
    assert decoder.graphs.failed is None


def test_refuses_what_it_cannot_serve(loaded: tuple[Any, Any]) -> None:
    model = loaded[0]
    _, static = engines(loaded)
    decoder = decoder_of(static)
    with pytest.raises(ConfigurationError, match=r"SlotDecoder\(quantum=96\).*multiple of SLOT_BLOCK \(64\)"):
        SlotDecoder(static._runner, quantum=96)
    with pytest.raises(ConfigurationError, match="variant must be one of greedy, sample, top_p"):
        SlotDecodeStep(model, rows=4, length=64, variant="nucleus", record=False, pool=decoder.pool)
    step = decoder.probe_step(4, 64)
    with pytest.raises(ConfigurationError, match=r"step\(\): no batch begun"):
        step.step()
    sampled = SamplingSettings(max_new_tokens=4, temperature=0.7, seed=1)
    with pytest.raises(ConfigurationError, match="need the 'sample' sampler variant"):
        step.begin([sampled], prefill=None, index=[0], prompts=[(1, 2)])
    with pytest.raises(ConfigurationError, match=r"5 settings, 5 prefill rows and 5 prompts in a step of 4"):
        step.begin([SamplingSettings(max_new_tokens=4)] * 5, prefill=None, index=[0] * 5, prompts=[(1,)] * 5)
    greedy = SamplingSettings(max_new_tokens=4, temperature=0)
    step.begin([greedy, greedy], prefill=None, index=[0, 0], prompts=[(5,), (6,)])
    step.step()
    assert step.tokens.shape == (4,)
    with pytest.raises(ConfigurationError, match=r"keep=\[1, 0\]\): keep must be ascending indices"):
        step.hand_over([1, 0], step)
    with pytest.raises(ConfigurationError, match=r"cannot go to a step of 4 rows, 128 slots"):
        step.hand_over([0], decoder.probe_step(4, 128))


def test_a_batch_left_to_the_eager_slot_steps_is_counted_once(loaded: tuple[Any, Any]) -> None:
    """With a forward hook on the model, the layout's checks (the self-test and the engine make several a
    batch) count nothing; placing the batch counts it once, and without the hook it is placed in the pool."""
    _, static = engines(loaded)
    decoder, layout = decoder_of(static), static._slots
    handle = static.model.model.layers[0].register_forward_hook(lambda *args: None)
    try:
        assert not any(layout.static_steps() for _ in range(3))
        assert decoder.place(layout, 3, 20) is None
    finally:
        handle.remove()
    assert {k: v for k, v in decoder.stats.items() if k.startswith("eager")} == {
        "eager batches: forward hooks": 1
    }
    assert decoder.place(layout, 3, 70) == 128 and decoder.pool.fits(4, 128)
