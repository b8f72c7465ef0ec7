"""The batched generation engine and the process-wide model cache, on real tiny models of every family.

References are the model itself: HF ``model.generate`` for greedy decoding, and each row run alone for
batch invariance. Nothing of interlens is mocked; the tiny models are saved and loaded through
``from_pretrained`` like any user's model.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens._core._exceptions import ConfigurationError, DeviceError, ModelLoadError
from interlens.engine._generation import (
    GenerationRequest,
    GenerationResult,
    LocalEngine,
    SamplingSettings,
    _prefill_groups,
)
from interlens.engine._model_cache import clear_engine_cache, load_engine
from interlens.engine._prefill import MIN_SHARED_PREFIX
from interlens.scheduler import BatchCancelled, ExecutionMode
from interlens.testing import TINY_FAMILIES, tiny_model

_TOPICS = (
    "hi",
    "Debate: tabs versus spaces. Give your strongest argument and one weakness of it.",
    "Summarise the rules of chess in two sentences, then explain castling to a child who knows nothing.",
    "What is 2 + 2?",
)


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def engine(request: pytest.FixtureRequest) -> LocalEngine:
    path = tiny_model(request.param)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LocalEngine(model, tokenizer, device="cpu")


def _prompt(engine: LocalEngine, text: str) -> tuple[int, ...]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(ids)


def _ok(results: list[GenerationResult | Exception]) -> list[GenerationResult]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return [r for r in results if isinstance(r, GenerationResult)]


def _alone(engine: LocalEngine, request: GenerationRequest) -> GenerationResult:
    return _ok(engine.generate_batch([request]))[0]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_counts(result: GenerationResult, request: GenerationRequest) -> None:
    assert result.n_tokens == len(result.token_ids) >= 1
    assert result.prompt_tokens == len(request.prompt_ids)
    if result.finish_reason == "length":
        assert result.n_tokens == request.sampling.max_new_tokens
    else:
        assert result.n_tokens <= request.sampling.max_new_tokens


# ---------------------------------------------------------------------------------------------- greedy


def test_single_row_matches_hf_generate(engine: LocalEngine) -> None:
    prompt = _prompt(engine, _TOPICS[1])
    request = GenerationRequest(
        prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=24, temperature=0)
    )
    result = _alone(engine, request)

    out = engine.model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=24,
        pad_token_id=engine._runner.pad_id,
    )
    expected = out[0, len(prompt) :].tolist()
    eos = set(engine._runner.eos_ids)
    if any(t in eos for t in expected):  # generate pads after EOS; the engine stops there
        expected = expected[: next(i for i, t in enumerate(expected) if t in eos) + 1]
    assert result.token_ids == expected
    _check_counts(result, request)
    assert result.batch_size == 1 and not result.shared_prefill and result.kv_reused_tokens == 0
    assert result.text == engine.tokenizer.decode(expected, skip_special_tokens=True)


def test_batched_rows_equal_rows_run_alone(engine: LocalEngine) -> None:
    """Mixed prompt lengths (left padding), per-row max_new_tokens, greedy and seeded rows mixed."""
    requests = [
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[0]), sampling=SamplingSettings(max_new_tokens=5, temperature=0)
        ),
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[1]),
            sampling=SamplingSettings(max_new_tokens=20, temperature=0.9, seed=7),
        ),
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[2]),
            sampling=SamplingSettings(max_new_tokens=12, temperature=0),
        ),
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[3]),
            sampling=SamplingSettings(max_new_tokens=16, temperature=1.3, seed=11),
        ),
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[1]),
            sampling=SamplingSettings(max_new_tokens=9, temperature=0.8, top_p=0.7, seed=3),
        ),
    ]
    assert len({len(r.prompt_ids) for r in requests}) >= 3
    batched = _ok(engine.generate_batch(requests))
    for request, result in zip(requests, batched, strict=True):
        alone = _alone(engine, request)
        assert result.token_ids == alone.token_ids
        assert result.finish_reason == alone.finish_reason
        assert result.text == alone.text
        assert result.batch_size == len(requests)
        _check_counts(result, request)


def test_many_rows_of_very_different_lengths_equal_rows_run_alone(engine: LocalEngine) -> None:
    """Enough rows of spread-out lengths that the prefill is split into length groups (where supported)."""
    texts = [" ".join(["spaces"] * n) for n in (1, 40, 3, 25, 8, 60, 2, 15, 33, 5)]
    requests = [
        GenerationRequest(
            prompt_ids=_prompt(engine, t),
            sampling=SamplingSettings(max_new_tokens=10, temperature=0.9 * (i % 2), seed=i),
        )
        for i, t in enumerate(texts)
    ]
    assert len(_prefill_groups([len(r.prompt_ids) for r in requests])) > 1
    batched = _ok(engine.generate_batch(requests))
    assert [r.token_ids for r in batched] == [_alone(engine, q).token_ids for q in requests]


def test_long_prompts_past_the_sliding_window_match_hf_generate(engine: LocalEngine) -> None:
    """Prompts longer than the tiny Gemma models' 64-token sliding window, left-padded in one batch."""
    prompts = [_prompt(engine, " ".join(["tabs or spaces?"] * n)) for n in (12, 30, 5)]
    assert max(len(p) for p in prompts) > 64 + 40
    requests = [
        GenerationRequest(prompt_ids=p, sampling=SamplingSettings(max_new_tokens=30, temperature=0))
        for p in prompts
    ]
    results = _ok(engine.generate_batch(requests))
    eos = set(engine._runner.eos_ids)
    for prompt, result in zip(prompts, results, strict=True):
        out = engine.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=30,
            pad_token_id=engine._runner.pad_id,
        )
        expected = out[0, len(prompt) :].tolist()
        if any(t in eos for t in expected):
            expected = expected[: next(i for i, t in enumerate(expected) if t in eos) + 1]
        assert result.token_ids == expected


def test_deterministic_rows_co_step_and_equal_each_row_alone(engine: LocalEngine) -> None:
    """Deterministic rows co-step where the self-test passed for this model, dtype and CPU, and run alone
    where not; either way each row's tokens are its tokens alone (tests/test_batch_invariance.py checks the
    co-stepping itself in the dtype that passes here)."""
    det = ExecutionMode.DETERMINISTIC
    requests = [
        GenerationRequest(
            prompt_ids=_prompt(engine, t),
            sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=i),
        )
        for i, t in enumerate(_TOPICS)
    ]
    results = _ok(engine.generate_batch(requests, mode=det))
    invariant = engine.batch_invariant  # the self-test's verdict (False where the layout does not apply)
    size = len(requests) if invariant else 1
    assert [(r.batch_size, r.batch_invariant) for r in results] == [(size, invariant)] * len(requests)
    alone = [_ok(engine.generate_batch([q], mode=det))[0] for q in requests]
    assert [r.batch_size for r in alone] == [1] * len(requests)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]


# ---------------------------------------------------------------------------------------------- sampling


def test_temperature_and_top_p_are_honoured_per_row(engine: LocalEngine) -> None:
    prompt = _prompt(engine, _TOPICS[2])
    greedy = _alone(
        engine,
        GenerationRequest(prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=16, temperature=0)),
    )
    rows = [
        GenerationRequest(
            prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=16, temperature=1e-4, seed=1)
        ),  # ~greedy
        GenerationRequest(
            prompt_ids=prompt,
            sampling=SamplingSettings(max_new_tokens=16, temperature=1.0, top_p=1e-6, seed=2),
        ),  # top-1
        GenerationRequest(
            prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=16, temperature=5.0, seed=3)
        ),  # ~uniform
        GenerationRequest(prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=16, temperature=0)),
    ]
    cold, nucleus, hot, plain = _ok(engine.generate_batch(rows))
    assert cold.token_ids == greedy.token_ids
    assert nucleus.token_ids == greedy.token_ids
    assert plain.token_ids == greedy.token_ids
    assert hot.token_ids != greedy.token_ids
    assert hot.shared_prefill  # four rows, one prompt: prefilled once


def test_seeds_make_sampling_reproducible_and_unseeded_rows_use_the_global_rng(engine: LocalEngine) -> None:
    prompt = _prompt(engine, _TOPICS[1])
    seeded = [
        GenerationRequest(
            prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=12, temperature=1.0, seed=s)
        )
        for s in (5, 5, 6)
    ]
    a, b, c = _ok(engine.generate_batch(seeded))
    assert a.token_ids == b.token_ids != c.token_ids

    unseeded = [
        GenerationRequest(prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=12, temperature=1.0))
    ] * 2
    torch.manual_seed(0)
    first = [r.token_ids for r in _ok(engine.generate_batch(unseeded))]
    torch.manual_seed(0)
    again = [r.token_ids for r in _ok(engine.generate_batch(unseeded))]
    assert first == again  # drawn from the global RNG, which was reseeded
    assert first[0] != first[1]  # two rows, two draws


# ---------------------------------------------------------------------------------------------- stopping


def test_stop_string_ends_the_row_and_is_cut_from_the_text(engine: LocalEngine) -> None:
    prompt = _prompt(engine, _TOPICS[1])
    row = GenerationRequest(
        prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=40, temperature=1.0, seed=3)
    )
    full = _alone(engine, row)
    text = full.text
    # A stop string taken from the middle of what the (seeded) row writes, cut at its first occurrence.
    start = len(text) // 3
    stop = text[start : start + 2]
    assert len(stop) == 2, f"text too short to pick a stop string from: {text!r}"
    cut = text.find(stop)

    requests = [
        GenerationRequest(
            prompt_ids=prompt,
            sampling=SamplingSettings(max_new_tokens=40, temperature=1.0, stop=("\x00never", stop), seed=3),
        ),
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[3]),
            sampling=SamplingSettings(max_new_tokens=10, temperature=0),
        ),
    ]
    stopped, other = _ok(engine.generate_batch(requests))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    assert stopped.token_ids == full.token_ids[: stopped.n_tokens]
    assert stopped.n_tokens < full.n_tokens
    decode = engine.tokenizer.decode
    assert stop in decode(stopped.token_ids, skip_special_tokens=True)
    assert stop not in decode(stopped.token_ids[:-1], skip_special_tokens=True)  # stopped at the first chance
    assert other.token_ids == _alone(engine, requests[1]).token_ids  # its batch mate is unaffected


def test_eos_ends_a_row_and_is_kept_in_token_ids(engine: LocalEngine) -> None:
    # Random weights emit an end-of-turn token now and then; 48 seeded rows x 48 tokens find some.
    prompt = _prompt(engine, _TOPICS[0])
    requests = [
        GenerationRequest(
            prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=48, temperature=1.0, seed=s)
        )
        for s in range(48)
    ]
    results = _ok(engine.generate_batch(requests))
    ended = [(q, r) for q, r in zip(requests, results, strict=True) if r.finish_reason == "eos"]
    assert ended, "no row produced an end-of-turn token; choose more seeds"
    assert any(r.finish_reason == "length" for r in results)
    for request, result in ended:
        assert result.token_ids[-1] in engine._runner.eos_ids
        assert not any(t in engine._runner.eos_ids for t in result.token_ids[:-1])
        _check_counts(result, request)
        assert result.text == engine.tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)
    request, result = ended[0]
    assert _alone(engine, request).token_ids == result.token_ids  # finished rows were dropped cleanly


# ------------------------------------------------------------------------------------------ shared prefill


def test_shared_prefill_gives_the_plain_path_tokens(engine: LocalEngine) -> None:
    same = _prompt(engine, _TOPICS[2])
    requests = [
        GenerationRequest(prompt_ids=same, sampling=SamplingSettings(max_new_tokens=10, temperature=0)),
        GenerationRequest(
            prompt_ids=same, sampling=SamplingSettings(max_new_tokens=14, temperature=0.9, seed=1)
        ),
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[0]), sampling=SamplingSettings(max_new_tokens=8, temperature=0)
        ),
        GenerationRequest(
            prompt_ids=same, sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=2)
        ),
        GenerationRequest(
            prompt_ids=_prompt(engine, _TOPICS[3]),
            sampling=SamplingSettings(max_new_tokens=8, temperature=0.7, seed=4),
        ),
    ]
    shared = _ok(engine.generate_batch(requests))
    # the identical prompts share all but their last token; the two others share their common prefix (a
    # default system prompt) when it is long enough to be worth prefilling once
    others = _common_prefix(requests[2].prompt_ids, requests[4].prompt_ids)
    others = min(others, len(requests[2].prompt_ids) - 1, len(requests[4].prompt_ids) - 1)
    others = others if others >= MIN_SHARED_PREFIX else 0
    expected = [len(same) - 1, len(same) - 1, others, len(same) - 1, others]
    assert [r.shared_prefix_tokens for r in shared] == expected
    assert [r.shared_prefill for r in shared] == [n > 0 for n in expected]
    engine.shared_prefill = False
    try:
        plain = _ok(engine.generate_batch(requests))
    finally:
        engine.shared_prefill = True
    assert not any(r.shared_prefill for r in plain)
    assert [r.token_ids for r in shared] == [r.token_ids for r in plain]
    for request, result in zip(requests, shared, strict=True):
        _check_counts(result, request)


def test_dynamic_batch_cache_gives_the_same_tokens(engine: LocalEngine) -> None:
    requests = [
        GenerationRequest(
            prompt_ids=_prompt(engine, t), sampling=SamplingSettings(max_new_tokens=n, temperature=0)
        )
        for t, n in zip(_TOPICS, (12, 3, 9, 12), strict=True)
    ]
    static = _ok(engine.generate_batch(requests))
    engine._plain.batch_cache = "dynamic"
    try:
        dynamic = _ok(engine.generate_batch(requests))
    finally:
        engine._plain.batch_cache = "static"
    assert [r.token_ids for r in static] == [r.token_ids for r in dynamic]


# ---------------------------------------------------------------------------------------------- KV reuse


def test_kv_reuse_prefills_only_the_new_suffix(engine: LocalEngine) -> None:
    tokenizer = engine.tokenizer
    key = ("job-1", "speaker")
    messages = [{"role": "user", "content": _TOPICS[3]}]
    first_prompt = _prompt(engine, _TOPICS[3])
    first = _alone(
        engine,
        GenerationRequest(
            prompt_ids=first_prompt, sampling=SamplingSettings(max_new_tokens=8, temperature=0), reuse_key=key
        ),
    )
    assert first.kv_reused_tokens == 0

    # The next turn re-renders the conversation: the old prompt, the reply as text, a new user message.
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3 + 3?"}]
    second_prompt = tuple(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    kept = list(first_prompt) + first.token_ids[:-1]
    common = _common_prefix(kept, second_prompt)
    second = _alone(
        engine,
        GenerationRequest(
            prompt_ids=second_prompt,
            sampling=SamplingSettings(max_new_tokens=10, temperature=0),
            reuse_key=key,
        ),
    )
    fresh = _alone(
        engine,
        GenerationRequest(
            prompt_ids=second_prompt, sampling=SamplingSettings(max_new_tokens=10, temperature=0)
        ),
    )
    assert second.kv_reused_tokens == min(common, len(second_prompt) - 1) >= len(first_prompt) - 1 > 0
    assert second.token_ids == fresh.token_ids

    # A prompt that strictly extends everything kept: all of it is reused.
    third_prompt = (*second_prompt, *second.token_ids, *tokenizer("more", add_special_tokens=False).input_ids)
    third = _alone(
        engine,
        GenerationRequest(
            prompt_ids=third_prompt, sampling=SamplingSettings(max_new_tokens=6, temperature=0), reuse_key=key
        ),
    )
    assert third.kv_reused_tokens == len(second_prompt) + second.n_tokens - 1
    assert (
        third.token_ids
        == _alone(
            engine,
            GenerationRequest(
                prompt_ids=third_prompt, sampling=SamplingSettings(max_new_tokens=6, temperature=0)
            ),
        ).token_ids
    )

    # A prompt sharing nothing with the stream starts fresh; release() frees the stream.
    other = tuple(tokenizer("Completely different.", add_special_tokens=False).input_ids)
    assert other[0] != third_prompt[0]
    unrelated = _alone(
        engine,
        GenerationRequest(
            prompt_ids=other, sampling=SamplingSettings(max_new_tokens=4, temperature=0), reuse_key=key
        ),
    )
    assert unrelated.kv_reused_tokens == 0
    assert key in engine._kept
    engine.release(key)
    assert key not in engine._kept


def test_kv_reuse_is_bounded_and_survives_a_sliding_window() -> None:
    path = tiny_model("gemma2")  # sliding window of 64 tokens in its tiny size
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu", kv_reuse_capacity=2)
    long_prompt = _prompt(engine, " ".join(["tabs or spaces"] * 20))
    assert len(long_prompt) > 64
    first = _alone(
        engine,
        GenerationRequest(
            prompt_ids=long_prompt, sampling=SamplingSettings(max_new_tokens=5, temperature=0), reuse_key="s"
        ),
    )
    # Rolling back past the window is impossible: the engine must start fresh rather than fail or drift.
    shorter = long_prompt[:-3]
    rolled = _alone(
        engine,
        GenerationRequest(
            prompt_ids=shorter, sampling=SamplingSettings(max_new_tokens=5, temperature=0), reuse_key="s"
        ),
    )
    fresh = _alone(
        engine,
        GenerationRequest(prompt_ids=shorter, sampling=SamplingSettings(max_new_tokens=5, temperature=0)),
    )
    assert rolled.kv_reused_tokens == 0 and rolled.token_ids == fresh.token_ids
    extended = (*shorter, *rolled.token_ids, 5)
    grown = _alone(
        engine,
        GenerationRequest(
            prompt_ids=extended, sampling=SamplingSettings(max_new_tokens=5, temperature=0), reuse_key="s"
        ),
    )
    assert grown.kv_reused_tokens == len(shorter) + rolled.n_tokens - 1
    assert (
        grown.token_ids
        == _alone(
            engine,
            GenerationRequest(
                prompt_ids=extended, sampling=SamplingSettings(max_new_tokens=5, temperature=0)
            ),
        ).token_ids
    )
    assert first.n_tokens >= 1
    for key in ("a", "b", "c"):
        _alone(
            engine,
            GenerationRequest(
                prompt_ids=long_prompt,
                sampling=SamplingSettings(max_new_tokens=2, temperature=0),
                reuse_key=key,
            ),
        )
    assert list(engine._kept) == ["b", "c"]  # least recently used streams are evicted


# ---------------------------------------------------------------------------------------------- failures


def test_cancellation_stops_within_one_decode_step(engine: LocalEngine) -> None:
    cancelled = threading.Event()
    calls: list[bool] = []

    def count(module: object, args: object, output: object) -> None:
        calls.append(cancelled.is_set())
        if len(calls) == 4:  # the prefill and three decode steps have run
            cancelled.set()

    request = GenerationRequest(
        prompt_ids=_prompt(engine, _TOPICS[1]), sampling=SamplingSettings(max_new_tokens=50, temperature=0)
    )
    handle = engine.model.register_forward_hook(count)
    try:
        with pytest.raises(BatchCancelled):
            engine.generate_batch([request, request], cancelled=cancelled)
        assert calls.count(True) == 0  # no forward pass ran after the event was set
        calls.clear()
        cancelled.clear()
        with pytest.raises(BatchCancelled):
            engine.generate_batch(
                [
                    GenerationRequest(
                        prompt_ids=request.prompt_ids,
                        sampling=SamplingSettings(max_new_tokens=50),
                        reuse_key="k",
                    )
                ],
                cancelled=cancelled,
            )
        assert "k" not in engine._kept  # a cancelled stream keeps no half-updated cache
    finally:
        handle.remove()
    after = _alone(
        engine,
        GenerationRequest(
            prompt_ids=request.prompt_ids, sampling=SamplingSettings(max_new_tokens=3, temperature=0)
        ),
    )
    assert 1 <= after.n_tokens <= 3  # the engine is usable again: the lock was released


def test_a_bad_row_fails_alone(engine: LocalEngine) -> None:
    good = GenerationRequest(
        prompt_ids=_prompt(engine, _TOPICS[0]), sampling=SamplingSettings(max_new_tokens=4, temperature=0)
    )
    bad = GenerationRequest(prompt_ids=(1, 2, 10**6), sampling=SamplingSettings(max_new_tokens=4))
    results = engine.generate_batch([good, bad, good])
    assert isinstance(results[1], ConfigurationError)
    assert "outside this model's vocabulary" in str(results[1])
    assert isinstance(results[0], GenerationResult) and isinstance(results[2], GenerationResult)
    assert results[0].token_ids == results[2].token_ids == _alone(engine, good).token_ids
    assert results[0].batch_size == 2
    assert engine.generate_batch([]) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": (), "max_new_tokens": 4}, "prompt is empty"),
        ({"prompt_ids": (1, -2), "max_new_tokens": 4}, "non-negative int"),
        ({"prompt_ids": (1,), "max_new_tokens": 0}, "max_new_tokens=0"),
        ({"prompt_ids": (1,), "max_new_tokens": 4, "top_p": 0.0}, "top_p=0.0"),
        ({"prompt_ids": (1,), "max_new_tokens": 4, "temperature": float("nan")}, "finite"),
        ({"prompt_ids": (1,), "max_new_tokens": 4, "stop": "###"}, "stop=('###',)"),
        ({"prompt_ids": (1,), "max_new_tokens": 4, "stop": ("",)}, "non-empty"),
        ({"prompt_ids": (1,), "max_new_tokens": 4, "reuse_key": ["x"]}, "hashable"),
    ],
)
def test_requests_are_validated_on_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match="GenerationRequest") as info:
        kwargs, names = dict(kwargs), ("max_new_tokens", "temperature", "top_p", "stop", "seed")
        settings = {k: kwargs.pop(k) for k in names if k in kwargs}
        GenerationRequest(**kwargs, sampling=SamplingSettings(**settings))  # type: ignore[arg-type]
    assert message in str(info.value)


def test_lists_are_accepted_and_stored_as_tuples() -> None:
    request = GenerationRequest(prompt_ids=[3, 4], sampling=SamplingSettings(max_new_tokens=2, stop=["x"]))  # type: ignore[arg-type]
    assert request.prompt_ids == (3, 4) and request.sampling.stop == ("x",)


class _WatchedLock:
    """Wraps the engine's lock and tells the test when a second caller has reached it (and may block)."""

    def __init__(self, lock: threading.Lock, second_caller: threading.Event) -> None:
        self._lock = lock
        self._second_caller = second_caller
        self._callers = 0

    def __enter__(self) -> _WatchedLock:
        self._callers += 1
        if self._callers >= 2:
            self._second_caller.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_concurrent_callers_are_serialised(engine: LocalEngine) -> None:
    """Caller A holds the model (paused in its first forward pass) until caller B has either reached the
    engine's lock or, if nothing serialises them, run a forward pass of its own beside A's."""
    requests = [
        GenerationRequest(
            prompt_ids=_prompt(engine, t),
            sampling=SamplingSettings(max_new_tokens=8, temperature=0.9, seed=i),
        )
        for i, t in enumerate(_TOPICS[:2])
    ]
    expected = [_alone(engine, r).token_ids for r in requests]
    b_arrived = threading.Event()  # B waits at the lock, or B is inside the model beside A
    a_inside = threading.Event()
    counts = {"active": 0, "peak": 0}
    guard = threading.Lock()
    got: dict[int, list[int] | BaseException] = {}

    def enter(module: object, args: object) -> None:
        with guard:
            counts["active"] += 1
            counts["peak"] = max(counts["peak"], counts["active"])
            if counts["active"] > 1:
                b_arrived.set()
        if threading.current_thread().name == "caller-0" and not a_inside.is_set():
            a_inside.set()
            if not b_arrived.wait(timeout=60):
                raise AssertionError("caller B never reached the engine")

    def leave(module: object, args: object, output: object) -> None:
        with guard:
            counts["active"] -= 1

    def call(i: int) -> None:
        try:
            got[i] = _ok(engine.generate_batch([requests[i]]))[0].token_ids
        except BaseException as exc:
            got[i] = exc

    lock = engine._lock
    engine._lock = _WatchedLock(lock, b_arrived)  # type: ignore[assignment]
    hooks = [engine.model.register_forward_pre_hook(enter), engine.model.register_forward_hook(leave)]
    try:
        first = threading.Thread(target=call, args=(0,), name="caller-0")
        second = threading.Thread(target=call, args=(1,), name="caller-1")
        first.start()
        assert a_inside.wait(timeout=60)
        second.start()
        first.join(timeout=60)
        second.join(timeout=60)
    finally:
        for hook in hooks:
            hook.remove()
        engine._lock = lock
    assert counts["peak"] == 1  # never two forward passes on the model at once
    assert [got[0], got[1]] == expected


# ---------------------------------------------------------------------------------------------- model cache


def test_load_engine_shares_one_model_per_recipe() -> None:
    clear_engine_cache()
    path = tiny_model("llama")
    barrier = threading.Barrier(3)
    seen: list[LocalEngine] = []

    def load() -> None:
        barrier.wait(timeout=30)
        seen.append(load_engine(path))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(seen) == 3 and all(e is seen[0] for e in seen)
    engine = seen[0]
    assert load_engine(path + "/") is engine  # same directory, same recipe
    assert not engine.model.training and engine.device == "cpu"
    assert engine.model.dtype == torch.float32
    half = load_engine(path, dtype="bfloat16")
    assert half is not engine and half.model.dtype == torch.bfloat16
    result = _alone(
        half,
        GenerationRequest(prompt_ids=(1, 2, 3), sampling=SamplingSettings(max_new_tokens=3, temperature=0)),
    )
    assert result.n_tokens == 3
    clear_engine_cache()
    assert load_engine(path) is not engine


def test_load_engine_errors_are_clear(tmp_path: object) -> None:
    with pytest.raises(ModelLoadError, match="no model directory at '/definitely/not/here'"):
        load_engine("/definitely/not/here")
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_engine("interlens-tests/never-downloaded-model")  # local-only lookup: fails fast, offline
    with pytest.raises(ModelLoadError, match="could not load"):
        load_engine(str(tmp_path))  # a directory without a model in it
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_engine(tiny_model("qwen2"), dtype="fp8")
    with pytest.raises(DeviceError, match="does not exist here"):
        load_engine(tiny_model("qwen2"), device="cuda:7")
    with pytest.raises(DeviceError, match="not a device string"):
        load_engine(tiny_model("qwen2"), device="gpu-please")


@pytest.mark.floors
def test_importing_the_engine_modules_stays_cheap() -> None:
    code = (
        "import sys, interlens.engine._generation, interlens.engine._model_cache, interlens.testing\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_a_turn_that_would_run_past_the_models_context_ends_there(qwen2_path: str) -> None:
    """A prompt that fits leaves ``context - len(prompt)`` positions: a turn allowed more ends there, exactly
    as a turn allowed that many would (same tokens, "length"), instead of decoding past the positions."""
    model = AutoModelForCausalLM.from_pretrained(qwen2_path).eval()
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(qwen2_path), device="cpu")
    context = model.config.max_position_embeddings
    prompt = [5, 6, 7, 8] * ((context - 3) // 4) + [5] * ((context - 3) % 4)  # 3 positions left
    asked, fitting = engine.generate_batch(
        [
            GenerationRequest(prompt, sampling=SamplingSettings(max_new_tokens=20, temperature=0.0)),
            GenerationRequest(prompt, sampling=SamplingSettings(max_new_tokens=3, temperature=0.0)),
        ]
    )
    assert isinstance(asked, GenerationResult) and isinstance(fitting, GenerationResult)
    assert asked.token_ids == fitting.token_ids and asked.finish_reason == fitting.finish_reason
    assert len(prompt) + asked.n_tokens <= context
    if asked.finish_reason == "length":
        assert asked.n_tokens == 3
