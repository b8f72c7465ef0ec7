"""Cross-turn KV reuse inside co-stepped batches, on real tiny models (float32: reuse is exact there).

The reference is the same engine code with reuse off (``kv_reuse_capacity=0``): a full re-prefill of the same
prompts. Rows are seeded, so each row's tokens depend only on its own logits, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import AutoModelParticipant, Conversation
from interlens._core._exceptions import ConfigurationError
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

_TOPICS = (
    "hi",
    "Debate: tabs versus spaces. Give your strongest argument and one weakness of it.",
    "Summarise the rules of chess in two sentences, then explain castling to a child who knows nothing.",
    "What is 2 + 2?",
)


def _engine(family: str, **settings: int | None) -> LocalEngine:
    path = tiny_model(family)
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # float32
    return LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu", **settings)  # type: ignore[arg-type]


def _prompt(engine: LocalEngine, text: str) -> tuple[int, ...]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(ids)


def _ok(results: Sequence[GenerationResult | Exception]) -> list[GenerationResult]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return [r for r in results if isinstance(r, GenerationResult)]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _requests(prompts: Sequence[tuple[int, ...]], *, temperature: float, keys: Sequence[str | None]):
    return [
        GenerationRequest(
            prompt_ids=p,
            sampling=SamplingSettings(max_new_tokens=6 + i, temperature=temperature, seed=100 + i),
            reuse_key=key,
        )
        for i, (p, key) in enumerate(zip(prompts, keys, strict=True))
    ]


def _next_prompts(engine: LocalEngine, prompts, results) -> list[tuple[int, ...]]:
    """Each row's next turn: its prompt, part of what it generated (so the kept ids and the new prompt part
    ways at different places per row), then a new message of a different length per row."""
    words = engine.tokenizer(" and then what about the other side", add_special_tokens=False).input_ids
    out = []
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        kept_generated = r.token_ids[: max(0, r.n_tokens - 1 - i % 3)]
        out.append((*p, *kept_generated, *words[: 2 + 2 * i]))
    return out


@pytest.mark.parametrize(
    ("family", "split"), [("qwen2", True), ("qwen2", False), ("llama", True), ("gemma2", True)]
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_co_stepped_batch_reusing_kept_caches_equals_a_full_re_prefill(
    family: str, split: bool, temperature: float
):
    """``split``: the row without a stream (longer than the others' suffixes) is prefilled apart and laid in
    (the default), or joins the layout with a hole where a kept prefix would be."""
    reusing, full = _engine(family), _engine(family, kv_reuse_capacity=0)
    reusing._reused.split_fresh_rows = split
    # Joined, the long fresh row widens every suffix so the layout saves little and the engine would
    # prefill in full (``reuse_pays``): forced here, to keep the joined layout's exactness tested.
    reusing._reused.always_reuse = not split
    keys = ["s0", "s1", "s2", None, "s4"]  # a row with no stream co-steps with them
    prompts = [_prompt(reusing, _TOPICS[i % 4] + " " * i) for i in range(5)]
    first = _ok(reusing.generate_batch(_requests(prompts, temperature=temperature, keys=keys)))
    assert [r.kv_reused_tokens for r in first] == [0] * 5
    full_first = _ok(full.generate_batch(_requests(prompts, temperature=temperature, keys=keys)))
    assert [r.token_ids for r in full_first] == [r.token_ids for r in first]
    assert set(reusing._kept) == ({"s0", "s1", "s2", "s4"} if family != "gemma2" else set())
    for entry in reusing._kept.values():  # exactly its fed tokens' KV: prompt + generated[:-1]
        assert all(k.shape[1] == v.shape[1] == len(entry.ids) for k, v in entry.kv)

    # Turn 2: the streams' prompts grew by different amounts; s4's new prompt is another question.
    second_prompts = _next_prompts(reusing, prompts, first)
    second_prompts[4] = _prompt(reusing, "Something else entirely, with its own words.")
    second = _ok(reusing.generate_batch(_requests(second_prompts, temperature=temperature, keys=keys)))
    reference = _ok(full.generate_batch(_requests(second_prompts, temperature=temperature, keys=keys)))
    assert [r.token_ids for r in second] == [r.token_ids for r in reference]
    assert all(r.batch_size == 5 for r in second)
    if family == "gemma2":  # sliding-window layers: batches prefill in full
        assert [r.kv_reused_tokens for r in second] == [0] * 5
        return
    expected = [
        min(_common((*p, *r.token_ids[:-1]), q), len(q) - 1) if key is not None else 0
        for p, r, q, key in zip(prompts, first, second_prompts, keys, strict=True)
    ]
    assert [r.kv_reused_tokens for r in second] == expected
    assert len(set(expected[:3])) == 3 and min(expected[:3]) > 0 and expected[3] == 0
    assert expected[4] < len(prompts[4])  # s4 reuses at most the template's head it shares

    # Turn 3: kept lengths differ again, now every row with a stream reuses (the laid-out path keeps too).
    third_prompts = _next_prompts(reusing, second_prompts, second)
    third = _ok(reusing.generate_batch(_requests(third_prompts, temperature=temperature, keys=keys)))
    reference = _ok(full.generate_batch(_requests(third_prompts, temperature=temperature, keys=keys)))
    assert [r.token_ids for r in third] == [r.token_ids for r in reference]
    expected = [
        min(_common((*p, *r.token_ids[:-1]), q), len(q) - 1) if key is not None else 0
        for p, r, q, key in zip(second_prompts, second, third_prompts, keys, strict=True)
    ]
    assert [r.kv_reused_tokens for r in third] == expected and all(
        n > 0 for i, n in enumerate(expected) if i != 3
    )


def test_a_tiny_budget_evicts_and_stays_correct():
    roomy, tiny, full = (
        _engine("qwen2"),
        _engine("qwen2", kv_reuse_budget=1),
        _engine("qwen2", kv_reuse_capacity=0),
    )
    keys = ["a", "b", "c"]
    prompts = [_prompt(roomy, t) for t in _TOPICS[1:]]
    results = {}
    for name, engine in (("roomy", roomy), ("tiny", tiny), ("full", full)):
        first = _ok(engine.generate_batch(_requests(prompts, temperature=0.9, keys=keys)))
        second = _ok(
            engine.generate_batch(
                _requests(_next_prompts(engine, prompts, first), temperature=0.9, keys=keys)
            )
        )
        results[name] = (first, second)
    assert tiny._kept == {} and tiny.kept_bytes() == 0  # nothing fits in one byte
    assert [r.kv_reused_tokens for r in results["tiny"][1]] == [0, 0, 0]
    assert all(r.kv_reused_tokens > 0 for r in results["roomy"][1])
    assert [r.token_ids for r in results["tiny"][1]] == [r.token_ids for r in results["full"][1]]
    assert [r.token_ids for r in results["roomy"][1]] == [r.token_ids for r in results["full"][1]]

    # A budget that holds two of the three streams keeps the two most recently used, within its bytes.
    sizes = {key: entry.nbytes for key, entry in roomy._kept.items()}
    assert roomy.kept_bytes() == sum(sizes.values())
    two = _engine("qwen2", kv_reuse_budget=sizes["b"] + sizes["c"] + 1)
    _ok(two.generate_batch(_requests(prompts, temperature=0.9, keys=keys)))
    assert 0 < two.kept_bytes() <= sizes["b"] + sizes["c"] + 1 and len(two._kept) <= 2
    two.release_memory()  # before an out-of-memory retry: kept caches go first
    assert two.kept_bytes() == 0 and two._kept == {}


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("kv_reuse_budget", -1),
        ("kv_reuse_budget", 1.5),
        ("kv_reuse_budget", True),
        ("kv_reuse_capacity", -2),
        ("kv_reuse_capacity", None),
    ],
)
def test_bad_reuse_limits_are_refused_by_name(setting: str, value: object):
    path = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ConfigurationError, match=rf"LocalEngine\({setting}=.*must be an int >= 0; pass"):
        LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu", **{setting: value})  # type: ignore[arg-type]


def test_deterministic_mode_never_reuses():
    engine = _engine("qwen2")
    keys = ["a", "b"]
    prompts = [_prompt(engine, t) for t in _TOPICS[1:3]]
    first = _ok(engine.generate_batch(_requests(prompts, temperature=0.9, keys=keys)))
    assert set(engine._kept) == {"a", "b"}
    later = _next_prompts(engine, prompts, first)
    det = _ok(
        engine.generate_batch(_requests(later, temperature=0.9, keys=keys), mode=ExecutionMode.DETERMINISTIC)
    )
    assert [r.kv_reused_tokens for r in det] == [0, 0]
    batched = _ok(engine.generate_batch(_requests(later, temperature=0.9, keys=keys)))
    assert all(r.kv_reused_tokens > 0 for r in batched)  # the streams were still there to reuse
    assert [r.token_ids for r in batched] == [r.token_ids for r in det]


def _debate(path: str, *, kv_reuse: bool) -> Conversation:
    def speaker(name: str) -> AutoModelParticipant:
        return AutoModelParticipant.from_pretrained(
            path, name=name, temperature=0.9, max_new_tokens=8, kv_reuse=kv_reuse
        )

    return Conversation(
        participants=[speaker("a"), speaker("b")], shared_context="Debate: tabs vs spaces."
    ).turns(4)


def test_a_batched_rollout_reuses_kv_on_later_turns_and_stays_exact(qwen2_path, tmp_path, monkeypatch):
    """Reuse > 0 on each speaker's later turns of a real rollout; and replaying the very batches it ran,
    with the layouts it made, in float64, reuse gives the full re-prefill's tokens. (In float32 a reused
    prefix's different matmul shapes round a few ulps apart, which can flip a seeded draw now and then:
    the same size of deviation as extra padding gives, see ``../shared/notes/kv_reuse.md``.)"""
    import torch

    from interlens.engine._model_cache import cached_engines, clear_engine_cache

    clear_engine_cache()
    batches: list[list[GenerationRequest]] = []
    generate = LocalEngine.generate_batch

    def recording(self: LocalEngine, requests, **kwargs):  # type: ignore[no-untyped-def]
        batches.append(list(requests))
        return generate(self, requests, **kwargs)

    monkeypatch.setattr(LocalEngine, "generate_batch", recording)
    report = _debate(qwen2_path, kv_reuse=True).rollout(
        n=8, devices=["cpu"], out_dir=tmp_path / "run", seed=3
    )
    monkeypatch.undo()
    assert report.failed == [] and len(report.results) == 8
    for res in report.results.values():
        turns = res.transcript[1:]
        assert [m.author for m in turns] == ["a", "b", "a", "b"]
        assert [m.metadata["batch_size"] for m in turns] == [8] * 4
        assert [m.metadata["kv_reused_tokens"] for m in turns[:2]] == [0, 0]  # each speaker's first turn
        assert all(0 < m.metadata["kv_reused_tokens"] < m.metadata["prompt_tokens"] for m in turns[2:])
    assert all(engine._kept == {} for engine in cached_engines())  # finished jobs released their caches
    clear_engine_cache()

    assert [len(b) for b in batches] == [8] * 4
    model = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(qwen2_path)
    reusing = LocalEngine(model, tokenizer, device="cpu")
    full = LocalEngine(model, tokenizer, device="cpu", kv_reuse_capacity=0)
    for number, batch in enumerate(batches):
        mine, reference = _ok(reusing.generate_batch(batch)), _ok(full.generate_batch(batch))
        assert [r.token_ids for r in mine] == [r.token_ids for r in reference]
        assert all((r.kv_reused_tokens > 0) == (number >= 2) for r in mine)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_caches_kept_from_a_shared_prefix_batch_are_each_rows_own_prompt(temperature: float):
    """Turn 1 of a recipe's rollouts: rows share a long prefix, which the batch prefills once and lays out as
    ``[pad][prefix][hole][suffix]``. What each stream keeps must be its prompt's KV, not the hole's: its next
    turn, reusing it, gives the full re-prefill's tokens."""
    reusing, full = _engine("qwen2"), _engine("qwen2", kv_reuse_capacity=0)
    context = "Rules of the debate: be brief, cite one fact, answer the other side's last point. " * 3
    keys = ["s0", "s1", "s2", "s3"]
    prompts = [_prompt(reusing, context + _TOPICS[i]) for i in range(4)]
    first = _ok(reusing.generate_batch(_requests(prompts, temperature=temperature, keys=keys)))
    assert all(r.shared_prefix_tokens >= 32 for r in first)  # the shared-prefix layout, holes and all
    assert len({len(p) for p in prompts}) > 1  # different suffix lengths: the holes differ per row
    full_first = _ok(full.generate_batch(_requests(prompts, temperature=temperature, keys=keys)))
    assert [r.token_ids for r in first] == [r.token_ids for r in full_first]

    second_prompts = _next_prompts(reusing, prompts, first)
    second = _ok(reusing.generate_batch(_requests(second_prompts, temperature=temperature, keys=keys)))
    reference = _ok(full.generate_batch(_requests(second_prompts, temperature=temperature, keys=keys)))
    assert all(r.kv_reused_tokens > len(p) // 2 for r, p in zip(second, prompts, strict=True))
    assert [r.token_ids for r in second] == [r.token_ids for r in reference]


def test_the_plain_paths_prefill_is_counted_as_it_runs_a_shared_prefix_once_and_length_groups() -> None:
    plain = _engine("qwen2")._plain
    head = tuple(range(10, 50))  # 40 tokens: a shared prefix past MIN_SHARED_PREFIX (32)
    assert plain.prefill_tokens([(*head, 1, 2, 3)] * 4) == 42 + 4  # identical: once, then a last token each
    assert plain.prefill_tokens([(*head, 1), (*head, 2, 3, 4)]) == 40 + 2 * 3  # prefix once, suffixes padded
    short, long = tuple(range(100, 120)), tuple(range(200, 300))
    lengths = [short] * 4 + [long] * 4  # no shared prefix; two length groups save half the padding
    assert plain.prefill_tokens([(i, *p) for i, p in enumerate(lengths)]) == 4 * 21 + 4 * 101
    plain.shared_prefill = False
    assert plain.prefill_tokens([(*head, 1, 2, 3)] * 4) == 4 * 43


@pytest.mark.parametrize("kept_tokens", [6, 110])
def test_a_batch_lays_kept_prefixes_out_only_where_that_prefills_less_and_keeps_caches_either_way(
    kept_tokens: int,
) -> None:
    """8 streams kept ``kept_tokens`` of their next 120-token prompt: 6 saves 5 % of the prefill (the layout
    is not worth its copies and holes: prefilled in full), 110 saves 90 % (laid out). Either way the tokens
    are a full prefill's, and each stream's new KV is kept for its next turn."""
    reusing, full = _engine("qwen2"), _engine("qwen2", kv_reuse_capacity=0)
    words = reusing.tokenizer(" ".join(f"w{i}" for i in range(400)), add_special_tokens=False).input_ids
    heads = [tuple(words[9 * i : 9 * i + 120]) for i in range(8)]  # no two rows share 32 leading tokens
    keys = [f"s{i}" for i in range(8)]
    _ok(reusing.generate_batch(_requests([h[:kept_tokens] for h in heads], temperature=0.9, keys=keys)))
    second = _ok(reusing.generate_batch(_requests(heads, temperature=0.9, keys=keys)))
    reference = _ok(full.generate_batch(_requests(heads, temperature=0.9, keys=keys)))
    assert [r.token_ids for r in second] == [r.token_ids for r in reference]
    reused = [r.kv_reused_tokens for r in second]
    assert reused == ([0] * 8 if kept_tokens == 6 else [kept_tokens] * 8)
    assert set(reusing._kept) == set(keys)
    third = [(*h, *r.token_ids[:-1], *words[:5]) for h, r in zip(heads, second, strict=True)]
    later = _ok(reusing.generate_batch(_requests(third, temperature=0.9, keys=keys)))
    assert all(r.kv_reused_tokens >= 120 for r in later)  # the turn prefilled in full kept its KV too


def test_a_forced_layout_of_a_small_kept_prefix_gives_the_same_tokens() -> None:
    reusing, full = _engine("qwen2"), _engine("qwen2", kv_reuse_capacity=0)
    reusing._reused.always_reuse = True
    words = reusing.tokenizer(" ".join(f"w{i}" for i in range(400)), add_special_tokens=False).input_ids
    heads = [tuple(words[9 * i : 9 * i + 120]) for i in range(8)]
    keys = [f"s{i}" for i in range(8)]
    _ok(reusing.generate_batch(_requests([h[:6] for h in heads], temperature=0.9, keys=keys)))
    second = _ok(reusing.generate_batch(_requests(heads, temperature=0.9, keys=keys)))
    reference = _ok(full.generate_batch(_requests(heads, temperature=0.9, keys=keys)))
    assert [r.kv_reused_tokens for r in second] == [6] * 8
    assert [r.token_ids for r in second] == [r.token_ids for r in reference]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_suffixes_of_very_different_lengths_prefill_in_length_groups_and_give_a_full_prefills_tokens(
    temperature: float,
) -> None:
    """12 streams kept 60 tokens; their next prompts add 2 to 90 tokens, in no order. The suffixes prefill
    in length groups (each its own forward, at its own width, into the batch cache's rows), the rows come
    back in the requests' order, and every token is a full prefill's."""
    reusing, full = _engine("qwen2"), _engine("qwen2", kv_reuse_capacity=0)
    words = reusing.tokenizer(" ".join(f"w{i}" for i in range(900)), add_special_tokens=False).input_ids
    heads = [tuple(words[13 * i : 13 * i + 60]) for i in range(12)]
    added = [90, 2, 45, 7, 88, 3, 30, 60, 5, 75, 12, 50]
    keys = [f"s{i}" for i in range(12)]
    _ok(reusing.generate_batch(_requests(heads, temperature=temperature, keys=keys)))
    prompts = [(*h, *words[500 + i : 500 + i + n]) for i, (h, n) in enumerate(zip(heads, added, strict=True))]
    for p, h in zip(
        prompts, heads, strict=True
    ):  # the kept KV holds the head; generated tokens are not reused
        assert p[:60] == h
    widths: list[int] = []
    handle = reusing.model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        second = _ok(reusing.generate_batch(_requests(prompts, temperature=temperature, keys=keys)))
    finally:
        handle.remove()
    reference = _ok(full.generate_batch(_requests(prompts, temperature=temperature, keys=keys)))
    assert [r.kv_reused_tokens for r in second] == [60] * 12
    assert [r.token_ids for r in second] == [r.token_ids for r in reference]
    prefills = [w for w in widths if w > 1]
    assert len(prefills) > 1 and max(prefills) == 90 and min(prefills) < 30  # groups, each at its width
    assert sum(prefills) < 12 * 90
