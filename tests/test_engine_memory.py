"""The engine's memory and numerics on tiny models: one small cache alive at a time, NaN rows fail alone."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import interlens
from interlens import AutoModelParticipant, Conversation
from interlens._core._exceptions import GenerationError
from interlens.engine._decode import ModelRunner
from interlens.engine._generation import (
    GenerationRequest,
    GenerationResult,
    LocalEngine,
    SamplingSettings,
    _prefill_groups,
    token_budget_estimate,
)
from interlens.testing import tiny_model


class WatchedRunner(ModelRunner):
    """A model runner that notes, at each prefill forward, how many caches of EARLIER forwards are alive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.caches: list[weakref.ref[Any]] = []
        self.alive_at_forward: list[int] = []

    def forward(self, ids: list[list[int]], mask: list[list[int]], cache: Any) -> torch.Tensor:
        self._note(cache)
        return super().forward(ids, mask, cache)

    def forward_part(self, ids: list[list[int]], mask: Any, cache: Any, offset: int) -> torch.Tensor:
        if offset == 0:  # a length group's one forward (a shared prefix's suffixes reuse its prefix's cache)
            self._note(cache)
        return super().forward_part(ids, mask, cache, offset)

    def _note(self, cache: Any) -> None:
        self.alive_at_forward.append(sum(ref() is not None for ref in self.caches))
        self.caches.append(weakref.ref(cache))


class WatchedEngine(LocalEngine):
    """A LocalEngine over a :class:`WatchedRunner`."""

    _runner_type = WatchedRunner

    @property
    def alive_at_forward(self) -> list[int]:
        assert isinstance(self._runner, WatchedRunner)
        return self._runner.alive_at_forward


@pytest.fixture(scope="module")
def qwen2_model() -> tuple[Any, Any]:
    path = tiny_model("qwen2")  # plain static layers: the grouped prefill applies
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _prompt(tokenizer: Any, text: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(ids)


def test_grouped_prefill_drops_each_group_cache_before_the_next(qwen2_model: tuple[Any, Any]) -> None:
    model, tokenizer = qwen2_model
    # length groups only: these prompts share Qwen's default system prompt, a shared prefix of its own
    engine = WatchedEngine(model, tokenizer, device="cpu", shared_prefill=False)
    texts = [" ".join(["spaces"] * n) for n in (1, 40, 3, 25, 8, 60, 2, 15, 33, 5, 50, 4)]
    requests = [
        GenerationRequest(
            prompt_ids=_prompt(tokenizer, t), sampling=SamplingSettings(max_new_tokens=6, temperature=0)
        )
        for t in texts
    ]
    groups = _prefill_groups([len(r.prompt_ids) for r in requests])
    assert len(groups) >= 3
    batched = engine.generate_batch(requests)
    assert engine.alive_at_forward == [0] * len(groups)  # each group's cache gone before the next forward
    alone = [engine.generate_batch([r])[0] for r in requests]
    assert all(isinstance(r, GenerationResult) for r in batched + alone)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]  # type: ignore[union-attr]


def test_shared_prefix_parts_drop_each_cache_before_the_next(qwen2_model: tuple[Any, Any]) -> None:
    model, tokenizer = qwen2_model
    engine = WatchedEngine(model, tokenizer, device="cpu")

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    first, second = ids("alpha " * 80)[:40], ids("beta gamma " * 80)[:50]
    prompts = [
        first + ids(" one"),
        first + ids(" two words here"),
        second + ids(" three"),
        second + ids(" four and more"),
        second + ids(" five"),
        ids("unrelated"),
        ids("another unrelated prompt"),
    ]
    requests = [
        GenerationRequest(prompt_ids=p, sampling=SamplingSettings(max_new_tokens=6, temperature=0))
        for p in prompts
    ]
    batched = engine.generate_batch(requests)
    assert all(isinstance(r, GenerationResult) for r in batched)
    assert [r.shared_prefix_tokens for r in batched] == [40, 40, 50, 50, 50, 0, 0]  # type: ignore[union-attr]
    # two prefixes (each in its part's cache) and one length group: each cache gone before the next part
    assert engine.alive_at_forward == [0, 0, 0]
    alone = [engine.generate_batch([r])[0] for r in requests]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]  # type: ignore[union-attr]


class PoisonedLogits:
    """A forward hook: rows whose prompt holds ``marker`` get NaN logits (fp16 overflow, stood in for)."""

    def __init__(self, marker: list[int]) -> None:
        self.marker = torch.tensor(marker)

    def __call__(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape[1] < len(self.marker):
            return output
        hit = (ids.unfold(1, len(self.marker), 1) == self.marker).all(-1).any(-1)
        output.logits[hit] = float("nan")
        return output


def test_a_row_with_nan_logits_fails_alone_and_the_others_are_unchanged(qwen2_model: tuple[Any, Any]) -> None:
    model, tokenizer = qwen2_model
    engine = LocalEngine(model, tokenizer, device="cpu")
    texts = ["What is 2 + 2?", "Tabs or spaces?", "Say POISONPILL twice.", "Name a colour."]
    requests = [
        # the bad row samples with a nucleus: its NaN draw must not index past the vocabulary
        GenerationRequest(
            prompt_ids=_prompt(tokenizer, t),
            sampling=SamplingSettings(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=i),
        )
        for i, t in enumerate(texts)
    ]
    clean = [engine.generate_batch([r])[0] for r in requests]
    marker = tokenizer("POISONPILL", add_special_tokens=False)["input_ids"]
    handle = model.register_forward_hook(PoisonedLogits(marker), with_kwargs=True)
    try:
        results = engine.generate_batch(requests)
        reused = engine.generate_batch(
            [
                GenerationRequest(
                    prompt_ids=requests[2].prompt_ids,
                    sampling=SamplingSettings(max_new_tokens=4),
                    reuse_key="s",
                )
            ]
        )
    finally:
        handle.remove()
    bad = results[2]
    assert isinstance(bad, GenerationError)
    message = str(bad)
    assert "non-finite logits" in message and "generated token 1" in message
    assert "dtype='bfloat16'" in message and "float32 on cpu" in message
    assert [r.token_ids for i, r in enumerate(results) if i != 2] == [  # type: ignore[union-attr]
        r.token_ids
        for i, r in enumerate(clean)
        if i != 2  # type: ignore[union-attr]
    ]
    assert isinstance(reused[0], GenerationError) and "s" not in engine._kept  # no bad cache kept
    again = engine.generate_batch([requests[0]])  # the engine is as usable as before
    assert again[0].token_ids == clean[0].token_ids  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def nan_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the tiny qwen2 model whose first MLP is NaN: a broken checkpoint, saved like any other."""
    path = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    out = tmp_path_factory.mktemp("nan_model")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return str(out)


def test_nan_model_fails_its_own_job_and_the_worker_carries_on(nan_model_path: str, llama_path: str) -> None:
    def debate(path: str, name: str) -> Conversation:
        a = AutoModelParticipant.from_pretrained(path, name="a", temperature=0.9, max_new_tokens=6)
        b = AutoModelParticipant.from_pretrained(path, name="b", temperature=0.9, max_new_tokens=6)
        return Conversation(participants=[a, b], shared_context="Tabs or spaces?").turns(3).name(name)

    # one job at a time, the broken model's first: the healthy jobs run on the same worker AFTER it failed
    conversations = [debate(nan_model_path, "broken"), debate(llama_path, "ok"), debate(llama_path, "ok2")]
    report = interlens.run(conversations, devices=["cpu"], max_concurrency=1)
    assert report.failed == ["broken"]
    err = report.results["broken"].error
    assert err.type == "GenerationError" and report.results["broken"].attempts == 1  # not worth a retry
    assert "turn 1 of participant 'a'" in err.message and nan_model_path in err.message
    assert "non-finite logits" in err.message and "dtype='bfloat16'" in err.message
    for res in (report.results["ok"], report.results["ok2"]):
        assert res.error is None and res.device == "cpu"
        assert [m.author for m in res.transcript[1:]] == ["a", "b", "a"]


def test_first_token_budget_is_estimated_from_free_memory_on_cuda_only(qwen2_model: tuple[Any, Any]) -> None:
    from transformers import LlamaConfig

    # a Llama-2-7B shape in bf16: KV 2×32×32×128 + activations 4×4096 + 3×11008 values per token
    seven_b = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_hidden_layers=32, intermediate_size=11008
    )
    per_token = (2 * 32 * 32 * 128 + 4 * 4096 + 3 * 11008) * 2
    assert (
        token_budget_estimate(seven_b, free_bytes=80 * 2**30, dtype_bytes=2)
        == int(80 * 2**30 * 0.7) // per_token
    )
    grouped = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        intermediate_size=11008,
    )
    grouped_per_token = (2 * 32 * 8 * 128 + 4 * 4096 + 3 * 11008) * 2  # a quarter of the KV heads
    assert (
        token_budget_estimate(grouped, free_bytes=2**30, dtype_bytes=2)
        == int(2**30 * 0.7) // grouped_per_token
    )
    model, tokenizer = qwen2_model
    assert LocalEngine(model, tokenizer, device="cpu").token_budget() is None  # CPU: no estimate


class StepSizesRunner(ModelRunner):
    """A model runner that notes the batch size of every decode step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sizes: list[int] = []

    def step(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.sizes.append(tokens.shape[0])
        return super().step(tokens, *args, **kwargs)


class StepSizes(LocalEngine):
    """A LocalEngine over a :class:`StepSizesRunner`."""

    _runner_type = StepSizesRunner

    @property
    def sizes(self) -> list[int]:
        assert isinstance(self._runner, StepSizesRunner)
        return self._runner.sizes


def test_finished_rows_are_dropped_in_bunches_and_change_no_token(qwen2_model: tuple[Any, Any]) -> None:
    model, tokenizer = qwen2_model
    engine = StepSizes(model, tokenizer, device="cpu")
    engine._runner.eos_ids = frozenset()  # every row runs to its own cap: one row leaves at each step
    texts = [f"Row {i}: tabs or spaces?" for i in range(15)] + ["Say POISONPILL."]
    requests = [
        GenerationRequest(
            prompt_ids=_prompt(tokenizer, t),
            sampling=SamplingSettings(max_new_tokens=2 + i, temperature=0.9, seed=i),
        )
        for i, t in enumerate(texts)
    ]
    marker = tokenizer("POISONPILL", add_special_tokens=False)["input_ids"]
    handle = model.register_forward_hook(PoisonedLogits(marker), with_kwargs=True)
    try:
        batched = engine.generate_batch(requests)
        steps = list(engine.sizes)
        alone = [engine.generate_batch([r])[0] for r in requests[:15]]
    finally:
        handle.remove()
    assert isinstance(batched[15], GenerationError)  # failed at its first token
    assert [r.token_ids for r in batched[:15]] == [r.token_ids for r in alone]  # type: ignore[union-attr]
    assert [r.n_tokens for r in batched[:15]] == list(range(2, 17))  # type: ignore[union-attr]
    # the NaN row fails on the first draw but stays in the batch (fed an ignored id) until the finished rows
    # are 1/8 of it; then a row ends per step and the batch shrinks every second step down to 8 rows,
    # every step below (one row is 1/8 of 8)
    assert steps == [16, 14, 14, 12, 12, 10, 10, 8, 7, 6, 5, 4, 3, 2, 1]


def test_a_worker_budgets_from_its_own_share_of_a_shared_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers on one 80 GB GPU, each capped at half by the scheduler: the driver's free memory is the
    whole device's, so a worker's usable memory is what is left of ITS share (the CUDA runtime faked at its
    calls: no GPU here)."""
    from interlens.engine._device_memory import usable_cuda_bytes

    gb = 2**30
    state = {"free": 40 * gb, "reserved": 35 * gb, "allocated": 30 * gb, "share": 0.5}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (state["free"], 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: state["allocated"])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: state["share"])
    assert usable_cuda_bytes("cuda:0") == 10 * gb  # 40 GB of share less 30 allocated, not 40 free + 5 cached
    state["share"] = 1.0  # alone on the GPU: the device's free memory and this process's cached blocks
    assert usable_cuda_bytes(0) == 45 * gb
    state.update(allocated=45 * gb, share=0.5)  # past its share (allocated before the cap): nothing left
    assert usable_cuda_bytes(0) == 0


def test_a_model_split_over_a_group_budgets_its_kept_caches_over_every_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each GPU of a group holds its own layers' KV, so the kept caches' default bound counts every member's
    usable memory, not the first GPU's alone (the CUDA runtime faked at its calls: no GPU here)."""
    from interlens.engine._kept_kv import BUDGET_SHARE, default_kv_budget

    gb = 2**30
    free = {0: 10 * gb, 1: 30 * gb}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free[index], 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 1.0)
    assert default_kv_budget("cuda:0") == int(10 * gb * BUDGET_SHARE)
    assert default_kv_budget("cuda:0,cuda:1") == int(40 * gb * BUDGET_SHARE)


def test_decode_steps_attend_over_the_written_slots_not_the_whole_static_cache(
    qwen2_model: tuple[Any, Any],
) -> None:
    """A batch's static cache is preallocated to prompt + max_new_tokens; rows that end early leave most of it
    empty, and attention over it was most of a step (``_narrow_cache``). The attention the model calls
    (transformers' SDPA, observed through its registry) sees keys up to the furthest written slot, rounded
    up to 64, growing with the turn: never the whole preallocation."""

    model, tokenizer = qwen2_model
    prompts = [_prompt(tokenizer, "tabs " * n) for n in (3, 9)]  # of two lengths: one row is padded
    steps, masked = _decode_step_attention(model, tokenizer, prompts)
    width = max(len(p) for p in prompts)
    assert len(steps) == 149 and steps == sorted(steps)  # grows with the turn
    assert steps[0] == -(-(width + 1) // 64) * 64  # the written slots, rounded up to 64
    assert steps[-1] == width + 150  # at most the whole cache, once the turn has filled it
    assert all(masked)  # the padded row's pad slots and the unwritten tail are masked out


def test_an_unpadded_batch_attends_over_exactly_the_written_slots_with_no_mask(
    qwen2_model: tuple[Any, Any],
) -> None:
    """Where no row is padded, every written slot is visible to every row: on CUDA the decode steps attend
    over exactly those and pass attention no mask (so SDPA may take its flash kernel). The CPU keeps the
    rounded, masked window (faster there): the CUDA choice is switched on here, on the same code path."""
    model, tokenizer = qwen2_model
    first = _prompt(tokenizer, "tabs " * 6)
    k = len(first) - 8  # a token of the user's text: another prompt of the same length
    prompts = [first, (*first[:k], (first[k] + 1) % model.config.vocab_size, *first[k + 1 :])]
    steps, masked = _decode_step_attention(model, tokenizer, prompts, mask_free=True)
    width = len(prompts[0])
    assert steps == list(range(width + 1, width + 150))  # the KV length after each step, nothing more
    assert not any(masked)
    steps, masked = _decode_step_attention(model, tokenizer, prompts)  # the CPU's default
    assert steps[0] == -(-(width + 1) // 64) * 64 and all(masked)


def _decode_step_attention(
    model: Any, tokenizer: Any, prompts: list[tuple[int, ...]], *, mask_free: bool = False
) -> tuple[list[int], list[bool]]:
    """Greedy decode of ``prompts`` to 150 tokens each (no end of turn): per decode step, the key length
    the attention the model calls (transformers' SDPA, observed through its registry, its masks built as
    SDPA's are) saw, and whether it was given a mask; every layer must see the same. The tokens must be
    each prompt's tokens alone: the observer changes nothing."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen: list[tuple[int, bool]] = []

    def observed_sdpa(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
    ) -> Any:
        if query.shape[2] == 1:  # a decode step (one query per row)
            seen.append((key.shape[2], mask is not None))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("observed_sdpa", observed_sdpa)
    AttentionMaskInterface.register("observed_sdpa", sdpa_mask)  # else transformers builds no mask for it
    before = model.config._attn_implementation
    model.set_attn_implementation("observed_sdpa")
    try:
        engine = LocalEngine(model, tokenizer, device="cpu")
        engine._runner.eos_ids = frozenset()  # every row runs to its cap: the cache fills up
        assert engine._runner.mask_free_steps is False  # the CPU's default
        engine._runner.mask_free_steps = mask_free
        requests = [
            GenerationRequest(prompt_ids=p, sampling=SamplingSettings(max_new_tokens=150, temperature=0))
            for p in prompts
        ]
        results = engine.generate_batch(requests)
        steps_seen = len(seen)
        alone = [engine.generate_batch([r])[0] for r in requests]
    finally:
        model.set_attn_implementation(before)
    assert all(r.n_tokens == 150 for r in results)  # type: ignore[union-attr]
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]  # type: ignore[union-attr]
    del seen[steps_seen:]
    layers = model.config.num_hidden_layers
    steps = seen[::layers]  # one entry per layer per step: every layer sees the same
    assert seen == [s for s in steps for _ in range(layers)]
    return [n for n, _ in steps], [m for _, m in steps]
