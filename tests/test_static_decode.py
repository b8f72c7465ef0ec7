"""The engine's decode through static-shape steps (``engine/_static_decode.py``) against its eager loop,
on the CPU, through ``LocalEngine.generate_batch``: what a CUDA run replays as graphs.

Two engines over one tiny float32 model, the static decoder switched on in one (as
``INTERLENS_STATIC_DECODE=1`` does; here set on the runner, with a small length bucket and the address-
checking stand-in for a CUDA graph) and off in the other: the same tokens, finish reasons and recorded log-
probabilities for plain batches of mixed settings, shared prefixes, identical prompts, kept KV across turns,
rows ending at different steps (a hand-over at each row bucket edge), stop strings, end-of-turn ids and a row
whose logits go non-finite. No static buffer moves across a whole multi-turn rollout, and a step reads the
device once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_engine_syncs import per_step
from test_static_step import AddressCheckingGraph
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import GenerationError
from interlens.engine._decode_graphs import GraphRunner
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.engine._static_decode import ENV_SWITCH, StaticDecoder
from interlens.scheduler import ExecutionMode
from interlens.testing import REAL_MODEL_INSTALL, real_model, tiny_model


@pytest.fixture(scope="module")
def loaded(qwen2_path: str) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(qwen2_path).eval(), AutoTokenizer.from_pretrained(qwen2_path)


def engines(loaded: tuple[Any, Any], **settings: Any) -> tuple[LocalEngine, LocalEngine, StaticDecoder]:
    """(eager, static, its decoder) over the one model: graphs stood in for by the address-checking graph."""
    model, tokenizer = loaded
    eager = LocalEngine(model, tokenizer, device="cpu", **settings)
    static = LocalEngine(model, tokenizer, device="cpu", **settings)
    eager._runner.static_decode = None
    decoder = StaticDecoder(
        static._runner, quantum=32, graphs=GraphRunner(device="cpu", graph_type=AddressCheckingGraph)
    )
    static._runner.static_decode = decoder
    return eager, static, decoder


def ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text).input_ids)


#: a greedy row, a seeded tempered row, a seeded nucleus row, a seeded tempered nucleus row, an unseeded one
MIX = (
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 11},
    {"temperature": 1.0, "top_p": 0.7, "seed": -5},
    {"temperature": 1.3, "top_p": 0.9, "seed": 2},
    {"temperature": 0.0, "top_p": 0.5},
)


def requests(
    prompts: Sequence[tuple[int, ...]], *, new: Sequence[int], record: bool = True, **extra: Any
) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_ids=p,
            sampling=SamplingSettings(max_new_tokens=n, **MIX[i % len(MIX)], **extra),
            record_logprobs=record,
        )
        for i, (p, n) in enumerate(zip(prompts, new, strict=True))
    ]


def same(a: Sequence[GenerationResult | Exception], b: Sequence[GenerationResult | Exception]) -> None:
    """Row by row: equal tokens, finish reasons and prefill accounting; log-probabilities to float32
    rounding (the static step attends over its whole length bucket, the eager one over a narrowed window)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, Exception) or isinstance(y, Exception):
            assert type(x) is type(y) and str(x) == str(y)
            continue
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert (x.shared_prefix_tokens, x.kv_reused_tokens) == (y.shared_prefix_tokens, y.kv_reused_tokens)
        if x.model_logprobs is not None:
            assert x.model_logprobs == pytest.approx(y.model_logprobs, abs=1e-4)
            assert x.sampling_logprobs == pytest.approx(y.sampling_logprobs, abs=1e-4)


def test_plain_batches_of_mixed_settings_give_the_eager_loops_tokens(loaded: tuple[Any, Any]) -> None:
    """Ten rows of every kind of setting, prompts of different lengths, token caps from 3 to 30: rows end at
    different steps, so the batch is handed over at the row bucket edges 16 -> 8 -> 4 -> 2 -> 1, each time
    after the leavers were read; every step ran as a (stand-in) graph."""
    eager, static, decoder = engines(loaded)
    tokenizer = loaded[1]
    prompts = [ids(tokenizer, f"row {i}: " + "tabs " * (i % 4)) for i in range(10)]
    new = [3, 30, 5, 8, 12, 4, 16, 6, 9, 28]
    expected = eager.generate_batch(requests(prompts, new=new))
    got = static.generate_batch(requests(prompts, new=new))
    same(got, expected)
    assert [r.n_tokens for r in got if isinstance(r, GenerationResult)] == new
    assert decoder.stats["hand-overs"] == 4 and decoder.stats["steps: graph"] == 29  # none ignored
    assert not any(key.startswith("steps: eager") for key in decoder.stats)


def test_end_of_turn_stop_strings_and_unrecorded_rows(loaded: tuple[Any, Any]) -> None:
    """An end-of-turn id and a stop string taken from the eager run's own output end rows early, the same
    way in both; a batch without recording runs the unrecorded steps."""
    eager, static, decoder = engines(loaded)
    tokenizer = loaded[1]
    prompts = [ids(tokenizer, f"say {w}") for w in ("one", "two", "three", "four")]
    plain = eager.generate_batch(requests(prompts, new=[20] * 4, record=False))
    first = plain[1]
    assert isinstance(first, GenerationResult)
    for engine in (eager, static):
        engine._runner.eos_ids = frozenset({first.token_ids[6]})
    text = plain[2].text  # type: ignore[union-attr]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for record in (False, True):
        expected = eager.generate_batch(requests(prompts, new=[20] * 4, record=record, stop=(stop,)))
        launched = decoder.stats["steps: graph"]
        got = static.generate_batch(requests(prompts, new=[20] * 4, record=record, stop=(stop,)))
        same(got, expected)
        reasons = [r.finish_reason for r in expected if isinstance(r, GenerationResult)]
        assert reasons[1] == "eos" and reasons[2] == "stop", reasons
        # pipelined: a step runs ahead while the host checks the one before; the batch's last rows ending
        # at an end-of-turn id or a stop string leave that one step ignored, rows at their cap none
        longest = max(r.n_tokens for r in got if isinstance(r, GenerationResult))
        ignored = 0 if "length" in reasons and longest == 20 else 1
        assert decoder.stats["steps: graph"] - launched == longest - 1 + ignored


def test_shared_prefixes_and_identical_prompts(loaded: tuple[Any, Any]) -> None:
    """Rows sharing a long prefix (prefilled once, with holes before each suffix) next to others, and
    identical prompts (prefilled once, expanded): the layouts the prefill leaves are decoded alike."""
    eager, static, _ = engines(loaded)
    tokenizer = loaded[1]
    head = ids(tokenizer, "A long shared system block. " * 6)
    prompts = [(*head, *ids(tokenizer, "x " * i)) for i in range(1, 5)] + [ids(tokenizer, "alone")]
    expected = eager.generate_batch(requests(prompts, new=[10, 14, 6, 12, 9]))
    assert any(r.shared_prefix_tokens > 0 for r in expected if isinstance(r, GenerationResult))
    same(static.generate_batch(requests(prompts, new=[10, 14, 6, 12, 9])), expected)
    twins = [ids(tokenizer, "the same prompt")] * 4
    expected = eager.generate_batch(requests(twins, new=[8, 11, 5, 8]))
    assert any(r.shared_prefix_tokens > 0 for r in expected if isinstance(r, GenerationResult))
    same(static.generate_batch(requests(twins, new=[8, 11, 5, 8])), expected)


def test_kept_kv_across_turns_and_no_static_buffer_moves(loaded: tuple[Any, Any]) -> None:
    """A three-turn rollout of five streams (one row without a stream): the kept caches the static loop's
    collector reads (before each hand-over) give the next turns the eager engine's reuse and tokens. The
    pool, reserved up front, is never reallocated, and every replay of every captured step found its
    buffers where they were at capture (the stand-in graph checks each one)."""
    eager, static, decoder = engines(loaded)
    decoder.pool.reserve(8, 256)
    generation = decoder.pool.generation
    tokenizer = loaded[1]
    keys = ["s0", "s1", "s2", None, "s4"]
    prompts = [ids(tokenizer, f"stream {i} opens " + "with words " * i) for i in range(5)]
    for turn in range(3):
        batch = [
            GenerationRequest(prompt_ids=p, sampling=r.sampling, reuse_key=k, record_logprobs=True)
            for p, r, k in zip(
                prompts, requests(prompts, new=[6 + 3 * i for i in range(5)]), keys, strict=True
            )
        ]
        expected = eager.generate_batch(batch)
        got = static.generate_batch(batch)
        same(got, expected)
        if turn:
            assert sum(r.kv_reused_tokens for r in got if isinstance(r, GenerationResult)) > 0
        words = ids(tokenizer, " and then")
        prompts = [(*p, *r.token_ids[:-1], *words) for p, r in zip(prompts, got, strict=True)]  # type: ignore[union-attr]
    assert set(static._kept) == set(eager._kept) == {"s0", "s1", "s2", "s4"}
    for key in static._kept:
        assert static._kept[key].ids == eager._kept[key].ids
    assert decoder.pool.generation == generation
    replays = [decoder.graphs.graph(key).replays for key in decoder.loop.steps]
    # each graph's first replay is its check against the eager step, at capture
    assert decoder.stats["steps: graph"] == sum(replays) - len(replays) > 0
    assert decoder.graphs.stats["captures"] == len(replays) >= 2  # the 8-row step and smaller ones
    assert decoder.graphs.failed is None


def test_a_row_whose_logits_go_non_finite_fails_alone(loaded: tuple[Any, Any], qwen2_path: str) -> None:
    """A token's embedding set to NaN: the row that generates it gets NaN logits on the next step and fails
    with the eager loop's error; the other rows carry on to the same tokens. Restored, the next batch over
    the same pool (where the failed row's KV went NaN: masked slots weigh zero, and zero x NaN is NaN) gets
    the eager loop's tokens: the pool is zeroed after a batch with a non-finite row."""
    model = AutoModelForCausalLM.from_pretrained(qwen2_path).eval()
    tokenizer = loaded[1]
    eager, static, _ = engines((model, tokenizer))
    prompts = [ids(tokenizer, f"row {i} speaks") for i in range(4)]
    before = eager.generate_batch(requests(prompts, new=[12] * 4))
    poisoned = before[2].token_ids[4]  # type: ignore[union-attr]
    others = [r.token_ids for r in before if isinstance(r, GenerationResult)]
    assert sum(poisoned in t[:-1] for t in others) >= 1
    weight = model.get_input_embeddings().weight
    saved = weight[poisoned].clone()
    with torch.no_grad():
        weight[poisoned] = float("nan")
    expected = eager.generate_batch(requests(prompts, new=[12] * 4))
    assert isinstance(expected[2], GenerationError)
    same(static.generate_batch(requests(prompts, new=[12] * 4)), expected)
    with torch.no_grad():
        weight[poisoned] = saved
    again = requests(prompts[::-1], new=[12] * 4)
    same(static.generate_batch(again), eager.generate_batch(again))


def test_a_hooked_model_decodes_eagerly_and_says_so(loaded: tuple[Any, Any]) -> None:
    """A forward hook on the model (capture and steering put them there) would not run inside a replayed
    graph: the batch goes to the eager loop, counted in the decoder's stats."""
    eager, static, decoder = engines(loaded)
    tokenizer = loaded[1]
    prompts = [ids(tokenizer, "hooked"), ids(tokenizer, "rows")]
    expected = eager.generate_batch(requests(prompts, new=[6, 6]))
    handle = static.model.model.layers[0].register_forward_hook(lambda *args: None)
    try:
        same(static.generate_batch(requests(prompts, new=[6, 6])), expected)
    finally:
        handle.remove()
    assert decoder.stats["eager batches: forward hooks"] == 1 and decoder.stats["batches"] == 0
    same(static.generate_batch(requests(prompts, new=[6, 6])), expected)
    assert decoder.stats["batches"] == 1


def test_release_memory_drops_the_pool_and_the_next_batch_rebuilds_it(loaded: tuple[Any, Any]) -> None:
    eager, static, decoder = engines(loaded)
    prompts = [ids(loaded[1], "one"), ids(loaded[1], "two two")]
    static.generate_batch(requests(prompts, new=[5, 5]))
    assert decoder.pool.nbytes() > 0 and decoder.graphs.stats["captures"] == 1
    static.release_memory()
    assert decoder.pool.nbytes() == 0 and not decoder.loop.steps
    same(
        static.generate_batch(requests(prompts, new=[5, 5])),
        eager.generate_batch(requests(prompts, new=[5, 5])),
    )
    assert decoder.graphs.stats["captures"] == 2


def test_a_static_step_reads_the_device_once(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tests/test_engine_syncs.py``'s count with the switch on (the engine builds its static decoder):
    one host read a step (the chosen tokens), the seeded uniforms' block copies at most."""
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert LocalEngine(*loaded, device="cpu")._runner.static_decode is not None
    steps = per_step(loaded, ExecutionMode.BATCHED)
    assert steps["host_read"] == 1.0
    assert steps["to_device"] <= 1 / 8
    monkeypatch.setenv(ENV_SWITCH, "")
    assert LocalEngine(*loaded, device="cpu")._runner.static_decode is None


def test_graphs_past_the_cap_are_dropped_and_captured_again(loaded: tuple[Any, Any]) -> None:
    """With room for one graph, batches of 2, 4 and again 2 rows: each new key's capture evicts the last
    one, whose step then runs eagerly until it is captured again; the tokens never change."""
    eager, static, decoder = engines(loaded)
    decoder.graphs.cap = 1
    decoder.pool.reserve(4, 32)  # no reallocation (which drops every graph) between the batches
    prompts = [ids(loaded[1], f"capped {i}") for i in range(4)]
    for n in (2, 4, 2):
        batch = prompts[:n]
        same(
            static.generate_batch(requests(batch, new=[6] * n)),
            eager.generate_batch(requests(batch, new=[6] * n)),
        )
    assert decoder.graphs.stats["captures"] == 3 and decoder.graphs.stats["evictions"] == 2
    (key,) = decoder.graphs._graphs
    assert key[0] == 2
    four = next(step for k, step in decoder.loop.steps.items() if k[0] == 4)
    assert four.run == four._forward_and_sample  # evicted: no longer replays its dropped graph
    assert decoder.stats["steps: graph"] == 3 * 5


def test_grouped_query_decode_attention_gives_sdpas_tokens(qwen2_path: str) -> None:
    """The attention the decoder installs on CUDA (``GROUPED_DECODE_ATTENTION``: grouped-query products
    over the pool's views, no ``repeat_kv``), forced here on the CPU at 2 and 5 rows (below the CPU
    variant's row floor): the tokens of transformers' ``sdpa`` through the same static steps."""
    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    results = {}
    for grouped in (False, True):
        model = AutoModelForCausalLM.from_pretrained(qwen2_path).eval()
        assert model.config._attn_implementation == "sdpa"
        engine = LocalEngine(model, tokenizer, device="cpu", decode_attention=False)
        decoder = StaticDecoder(engine._runner, quantum=32, grouped_attention=grouped)
        engine._runner.static_decode = decoder
        assert decoder.attention == ("interlens_grouped_decode" if grouped else "sdpa")
        assert model.config._attn_implementation == decoder.attention
        results[grouped] = [
            engine.generate_batch(
                requests([ids(tokenizer, f"group {i} " * (i + 1)) for i in range(n)], new=[12] * n)
            )
            for n in (2, 5)
        ]
    for plain, grouped in zip(results[False], results[True], strict=True):
        same(grouped, plain)


class MiscapturedGraph(AddressCheckingGraph):
    """A graph whose replay computes something else than the step it captured (a kernel that captured
    wrongly): every chosen token one higher."""

    def replay(self) -> None:
        super().replay()
        self.step.tokens.add_(1)


def test_a_graph_whose_replay_differs_from_the_eager_step_is_never_used(loaded: tuple[Any, Any]) -> None:
    """Checked once at capture: a replay that does not give the eager step's outputs gives up graphs for the
    engine, says why, and the batch's tokens are the eager loop's."""
    eager, static, decoder = engines(loaded)
    decoder.graphs = GraphRunner(device="cpu", graph_type=MiscapturedGraph)
    prompts = [ids(loaded[1], f"row {i} speaks") for i in range(3)]
    same(
        static.generate_batch(requests(prompts, new=[9, 5, 7])),
        eager.generate_batch(requests(prompts, new=[9, 5, 7])),
    )
    assert decoder.graphs.stats["replay_mismatches"] == 1 and decoder.graphs.stats["captures"] == 0
    assert decoder.graphs.failed == "a captured step's replay gave other tokens than the eager step"
    eager_steps = sum(n for key, n in decoder.stats.items() if key.startswith("steps: eager: a captured"))
    assert decoder.stats["steps: graph"] == 0 and eager_steps > 0


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sliding_window_models_decode_through_static_steps(family: str) -> None:
    """gemma2 (eager attention with logit soft-capping; sliding and full layers alternate) and gemma3 (sdpa
    with query pre-attention scaling, here the grouped-query decode attention CUDA gets) over a window of 8
    slots, prompts longer than it and up to 30 tokens: every layer a full-length layer of the pool, a
    sliding layer's window in the model's own mask. The eager loop's tokens (ring-buffer sliding layers) for
    mixed settings with hand-overs, rows sharing a long prefix (prefilled whole, as the eager path does:
    the shared layout's holes would count in the window; here in two length groups, each at the right end
    of the prompt region), identical prompts, and a second turn on reuse streams; no step eager, no static
    buffer moved across the rollout."""
    path = tiny_model(family)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def load() -> Any:  # queries scaled by 8 ** -0.5, not by the head size's (16)
        return AutoModelForCausalLM.from_pretrained(path, sliding_window=8, query_pre_attn_scalar=8).eval()

    eager = LocalEngine(load(), tokenizer, device="cpu")
    static = LocalEngine(load(), tokenizer, device="cpu", decode_attention=family == "gemma2")
    eager._runner.static_decode = None
    for engine in (eager, static):
        engine._runner.eos_ids = frozenset()  # every row runs to its cap: past the window
    decoder = StaticDecoder(
        static._runner,
        quantum=32,
        graphs=GraphRunner(device="cpu", graph_type=AddressCheckingGraph),
        grouped_attention=family == "gemma3",
    )
    static._runner.static_decode = decoder
    assert decoder.pool.window == 8 and "sliding_attention" in static.model.config.layer_types
    assert decoder.attention == ("interlens_grouped_decode" if family == "gemma3" else "eager")
    decoder.pool.reserve(16, 128)
    generation = decoder.pool.generation
    head = ids(tokenizer, "A long shared system block. " * 6)
    batches = [
        [ids(tokenizer, f"row {i}: " + "tabs and spaces " * (i % 4 + 1)) for i in range(6)],
        [(*head, *ids(tokenizer, "x " * i)) for i in range(1, 5)]
        + [ids(tokenizer, f"alone {i}") for i in range(4)],
        [ids(tokenizer, "the same prompt, long enough")] * 4,
    ]
    for prompts, new in zip(
        batches, ([3, 20, 5, 8, 12, 4], [6, 9, 4, 7, 5, 8, 3, 6], [6, 9, 4, 6]), strict=True
    ):
        expected = eager.generate_batch(requests(prompts, new=new))
        same(static.generate_batch(requests(prompts, new=new)), expected)
        assert [r.n_tokens for r in expected if isinstance(r, GenerationResult)] == new
    prompts, then = batches[0][:3], ids(tokenizer, " then")
    for _ in range(2):
        batch = [
            GenerationRequest(prompt_ids=p, sampling=r.sampling, reuse_key=f"s{i}", record_logprobs=True)
            for i, (p, r) in enumerate(zip(prompts, requests(prompts, new=[7, 12, 5]), strict=True))
        ]
        expected = eager.generate_batch(batch)
        got = static.generate_batch(batch)
        same(got, expected)
        done = [r for r in got if isinstance(r, GenerationResult)]
        prompts = [(*p, *r.token_ids[:-1], *then) for p, r in zip(prompts, done, strict=True)]
    assert decoder.stats["batches"] == decoder.stats["prefills: in the pool"] == 5
    assert decoder.stats["hand-overs"] >= 3 and decoder.pool.generation == generation
    assert not any(key.startswith(("steps: eager", "eager batches")) for key in decoder.stats)
    replays = [decoder.graphs.graph(key).replays for key in decoder.loop.steps]
    assert decoder.stats["steps: graph"] == sum(replays) - len(replays) > 0
    assert decoder.graphs.failed is None


REAL = real_model()


@pytest.mark.skipif(REAL is None, reason=f"the real model is not installed: {REAL_MODEL_INSTALL}")
def test_the_real_model_decodes_through_static_steps_as_through_the_eager_loop() -> None:
    """SmolLM2-135M-Instruct (real weights, float32): four rows, greedy and seeded nucleus ones, with token
    caps that hand the batch over at the row bucket edges 4 -> 2 -> 1, each on its stream, over two turns
    (the second lays kept KV out in the pool): the eager loop's tokens and log-probabilities. A few seconds
    on two free cores (minutes where other processes oversubscribe them: torch's threads then wait on each
    other)."""
    assert REAL is not None
    model = AutoModelForCausalLM.from_pretrained(REAL, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(REAL)
    eager, static, decoder = engines((model, tokenizer))
    eager._reused.always_reuse = static._reused.always_reuse = True
    settings = [
        SamplingSettings(max_new_tokens=8, temperature=0.0),
        SamplingSettings(max_new_tokens=3, temperature=0.8, top_p=0.9, seed=3),
        SamplingSettings(max_new_tokens=5, temperature=0.0),
        SamplingSettings(max_new_tokens=2, temperature=1.0, top_p=0.7, seed=-8),
    ]
    prompts = [
        ids(tokenizer, text)
        for text in (
            "Once upon a time, in a land far away,",
            "The capital of France is",
            "def add(a, b):",
            "Three colours:",
        )
    ]
    for turn in range(2):
        batch = [
            GenerationRequest(prompt_ids=p, sampling=s, reuse_key=f"s{i}", record_logprobs=True)
            for i, (p, s) in enumerate(zip(prompts, settings, strict=True))
        ]
        expected = eager.generate_batch(batch)
        got = static.generate_batch(batch)
        same(got, expected)
        assert [r.n_tokens for r in got if isinstance(r, GenerationResult)] == [8, 3, 5, 2]
        if turn:
            assert all(r.kv_reused_tokens > 0 for r in got if isinstance(r, GenerationResult))
        then = ids(tokenizer, " Then")
        prompts = [(*p, *r.token_ids[:-1], *then) for p, r in zip(prompts, got, strict=True)]  # type: ignore[union-attr]
    assert decoder.stats["hand-overs"] == 4 and decoder.stats["prefills: in the pool"] == 2
