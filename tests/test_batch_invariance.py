"""Deterministic rows co-step on the slot layout (_slot_rows) where the engine's self-test passed.

With stock kernels the slot layout is batch-invariant for the tiny models (sliding-window ones, gemma2 and
gemma3, included) in at least one of float32 and bfloat16 on every CPU measured so far, but which one depends
on the CPU's BLAS kernels (the ``co_step_dtype`` fixture picks it). There each row's logits and every
submodule output are bitwise the same alone and in any batch, so deterministic rows co-step and stay
token-identical to running alone. What makes it so is the layout's row padding and slot blocks: without
either, the same kernels fail the self-test (a matmul of one row rounds apart from one of several; keys in
other vector lanes). A model whose layers the layout cannot drive (chunked attention: llama4) runs
deterministic rows alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interlens import AutoModelParticipant, Conversation, RunReport
from interlens.engine import _slot_rows as slot_rows
from interlens.engine._generation import GenerationRequest, GenerationResult, LocalEngine, SamplingSettings
from interlens.engine._model_cache import clear_engine_cache
from interlens.scheduler import ExecutionMode
from interlens.testing import tiny_model

DET = ExecutionMode.DETERMINISTIC
_TEXTS = (
    "hi",
    "Debate: tabs versus spaces, strongest argument first.",
    "2 + 2?",
    "Explain castling. " * 12,  # past one slot block (64 slots), alone
    "hi",  # the same prompt as row 0: prefilled once for both
)


def _engine(family: str = "qwen2", dtype: torch.dtype = torch.float32) -> LocalEngine:
    path = tiny_model(family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return LocalEngine(model, AutoTokenizer.from_pretrained(path), device="cpu")


def _requests(engine: LocalEngine, *, temperature: float = 0.9) -> list[GenerationRequest]:
    out = []
    for i, text in enumerate(_TEXTS):
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        out.append(
            GenerationRequest(
                ids, sampling=SamplingSettings(max_new_tokens=6 + 5 * i, temperature=temperature, seed=40 + i)
            )
        )
    return out


def _ok(results: list[Any]) -> list[GenerationResult]:
    assert all(isinstance(r, GenerationResult) for r in results), results
    return results


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2", "gemma3"])
def test_deterministic_rows_co_step_on_stock_kernels_token_identical_to_alone(
    family: str, co_step_dtype: str
) -> None:
    engine = _engine(family, getattr(torch, co_step_dtype))
    requests = _requests(engine)
    together = _ok(engine.generate_batch(requests, mode=DET))
    assert engine.batch_invariant is True
    assert [(r.batch_size, r.batch_invariant) for r in together] == [(5, True)] * 5
    assert [r.shared_prefill for r in together] == [True, False, False, False, True]
    assert together[0].shared_prefix_tokens == len(requests[0].prompt_ids) - 1  # all but the fed last token
    alone = [_ok(engine.generate_batch([q], mode=DET))[0] for q in requests]
    assert [(r.batch_size, r.shared_prefill) for r in alone] == [(1, False)] * 5
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({len(r.token_ids) for r in together}) > 1  # rows left the batch at different steps
    # other company, another order: still each row's own tokens
    mixed = _ok(engine.generate_batch([requests[3], requests[1]], mode=DET))
    assert [r.token_ids for r in mixed] == [alone[3].token_ids, alone[1].token_ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_either_dtype_deterministic_rows_co_step_only_where_the_self_test_passed(
    dtype: torch.dtype,
) -> None:
    """Whatever this CPU's kernels do in this dtype, a deterministic row's tokens are its tokens alone: it
    co-steps where the self-test passed, and otherwise every row runs alone (batch size 1)."""
    engine = _engine("qwen2", dtype)
    requests = _requests(engine)
    together = _ok(engine.generate_batch(requests, mode=DET))
    invariant = engine.batch_invariant
    assert [(r.batch_size, r.batch_invariant) for r in together] == [(5 if invariant else 1, invariant)] * 5
    alone = [_ok(engine.generate_batch([q], mode=DET))[0] for q in requests]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_the_slot_layout_computes_what_the_plain_path_computes(family: str) -> None:
    """float64 greedy: the slot layout (own slots, row and slot padding, per-step masks, a sliding window
    counted from each row's own position) gives each row's tokens from the plain path run alone; prompts and
    generations run past gemma2's 64-token window. A wrong mask or position would not."""
    engine = _engine(family, torch.float64)
    requests = [
        GenerationRequest(
            q.prompt_ids, sampling=SamplingSettings(max_new_tokens=30 + 20 * i, temperature=0.0)
        )
        for i, q in enumerate(_requests(engine)[:4])
    ]
    slotted = _ok(engine.generate_batch(requests, mode=DET))
    plain = [_ok(engine.generate_batch([q]))[0] for q in requests]
    assert [(r.batch_size, r.batch_invariant) for r in slotted] == [(4, True)] * 4
    assert max(len(q.prompt_ids) for q in requests) + 90 > 2 * 64
    assert [r.token_ids for r in slotted] == [r.token_ids for r in plain]
    assert [r.n_tokens for r in slotted] == [q.sampling.max_new_tokens for q in requests]


@pytest.mark.parametrize("rule", ["ROW_BLOCK", "PREFILL_BLOCK", "SLOT_BLOCK"])
def test_without_the_layouts_padding_the_stock_kernels_fail_the_self_test(
    rule: str, monkeypatch: pytest.MonkeyPatch, stock_invariant_dtype: str
) -> None:
    from interlens.engine._batch_invariance import batch_invariant

    engine = _engine(dtype=getattr(torch, stock_invariant_dtype))
    with torch.inference_mode():
        assert batch_invariant(engine._slots)  # with the padding: the stock kernels pass
        monkeypatch.setattr(slot_rows, rule, 1)
        passes = batch_invariant(engine._slots)
    if rule == "SLOT_BLOCK" and passes:
        # measured: an Intel AMX CPU's bfloat16 attention does not depend on the cache length (MKL AVX-512
        # and AVX2 float32 kernels do); the rows and prefill paddings are needed everywhere measured
        pytest.skip(
            f"this CPU's {stock_invariant_dtype} kernels are invariant to the cache length without slot "
            "blocks"
        )
    assert passes is False


def test_fixed_row_linear_chunks_give_each_row_its_own_output_whatever_its_company() -> None:
    """What the engine falls back on where the stock GEMM picks its kernel by the row count: every linear
    layer of the model in chunks of one fixed shape, so a row's output is bitwise the same alone and among
    any others; only inside the layout's context, and only when it is on."""
    engine = _engine()
    layout = engine._slots
    layer = next(m for m in engine.model.modules() if type(m) is torch.nn.Linear)  # one of the model's own
    rows = torch.randn(13, layer.in_features, generator=torch.Generator().manual_seed(0))
    layout.fixed_linear_rows = True
    with torch.inference_mode(), layout.invariant_kernels(slot_rows.DECODE_CHUNK_ROWS):
        assert "forward" in vars(layer)  # chunked, on this instance only
        together = layer(rows)
        alone = [layer(rows[i : i + 1]) for i in range(13)]
        shuffled = layer(rows.flip(0))
    assert "forward" not in vars(layer)  # its own forward again on leaving
    assert together.shape == (13, layer.out_features)
    for i in range(13):
        assert torch.equal(together[i], alone[i][0]) and torch.equal(shuffled[12 - i], alone[i][0])
    torch.testing.assert_close(together, torch.nn.functional.linear(rows, layer.weight, layer.bias))
    layout.fixed_linear_rows = False
    with layout.invariant_kernels(slot_rows.DECODE_CHUNK_ROWS):
        assert "forward" not in vars(layer)  # off: the stock kernels, untouched


def test_batch_dependent_logits_fail_the_self_test_and_deterministic_rows_run_alone() -> None:
    engine = _engine()
    # the outside world's kernel: logits that depend on how many rows share the forward pass
    engine.model.lm_head.register_forward_hook(lambda _m, _i, out: out + 0.25 * (out.shape[0] - 1))
    requests = _requests(engine)
    results = _ok(engine.generate_batch(requests, mode=DET))
    assert engine.batch_invariant is False
    assert [(r.batch_size, r.batch_invariant) for r in results] == [(1, False)] * 5
    batched = _ok(engine.generate_batch(requests))  # batched mode still co-steps, and says what was found
    assert [(r.batch_size, r.batch_invariant) for r in batched] == [(5, False)] * 5


def _many(engine: LocalEngine, n: int) -> list[GenerationRequest]:
    out = []
    for i in range(n):
        text = f"{_TEXTS[i % len(_TEXTS)]} (row {i})"
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        out.append(
            GenerationRequest(ids, sampling=SamplingSettings(max_new_tokens=6, temperature=0.9, seed=70 + i))
        )
    return out


def test_a_batch_larger_than_the_self_test_ran_is_probed_at_its_size_first(co_step_dtype: str) -> None:
    """Kernels are picked by the batch's size (cuBLAS by size class): the self-test co-steps at most 12
    rows, so 20 deterministic rows are probed at 20 before they co-step. Here the outside world's kernel
    changes one logit once a step has more than 12 rows: the probe fails and the rows co-step in chunks of
    12, each row still token-identical to running alone."""
    engine = _engine(dtype=getattr(torch, co_step_dtype))

    def size_class_kernel(_module: Any, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        if out.shape[0] > 12:
            out = out.clone()
            out[..., 7] += 5.0
        return out

    engine.model.lm_head.register_forward_hook(size_class_kernel)
    requests = _many(engine, 20)
    together = _ok(engine.generate_batch(requests, mode=DET))
    assert engine.batch_invariant is True  # the base self-test (at most 12 rows) passed
    assert [r.batch_size for r in together] == [12] * 12 + [8] * 8
    alone = [_ok(engine.generate_batch([q], mode=DET))[0] for q in requests]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert sum(t == 7 for r in together for t in r.token_ids) < 20  # the perturbed logit never reached a row


def test_a_batch_larger_than_the_self_test_ran_co_steps_whole_where_its_probe_passes(
    co_step_dtype: str,
) -> None:
    engine = _engine(dtype=getattr(torch, co_step_dtype))
    requests = _many(engine, 20)
    together = _ok(engine.generate_batch(requests, mode=DET))
    assert [r.batch_size for r in together] == [20] * 20
    assert [r.token_ids for r in together[::7]] == [
        _ok(engine.generate_batch([q], mode=DET))[0].token_ids for q in requests[::7]
    ]


def test_batched_mode_does_not_run_the_self_test() -> None:
    engine = _engine()
    results = _ok(engine.generate_batch(_requests(engine)))
    assert [r.batch_invariant for r in results] == [None] * 5
    assert engine._batch_invariant is None


@pytest.fixture(scope="module")
def multimodal_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Gemma 3 checkpoint the way the real ones come (``Gemma3ForConditionalGeneration``: its
    decoder's ``layer_types`` and ``sliding_window`` sit in ``text_config``), random weights, saved and
    loaded for real."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    path = tiny_model("gemma3")
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = AutoConfig.for_model(
        "gemma3",
        text_config=AutoConfig.from_pretrained(path).to_dict(),
        vision_config={**vision, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gemma3_mm")
    Gemma3ForConditionalGeneration(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return str(out)


def test_a_multimodal_checkpoints_decoder_takes_the_layout_with_its_own_sliding_window(
    multimodal_gemma3: str,
) -> None:
    """float64 greedy, prompts and generations past the 64-token window: co-stepped on the slot layout and
    equal to the plain path alone (read from the top-level config, the window would be missed: the self-test
    then fails, as a mask counted from the batch's furthest row is not batch-invariant)."""
    model = AutoModelForCausalLM.from_pretrained(multimodal_gemma3, dtype=torch.float64).eval()
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(multimodal_gemma3), device="cpu")
    assert getattr(engine.model.config, "layer_types", None) is None  # only text_config has them
    requests = [
        GenerationRequest(q.prompt_ids, sampling=SamplingSettings(max_new_tokens=60, temperature=0.0))
        for q in _requests(engine)[1:4]
    ]
    slotted = _ok(engine.generate_batch(requests, mode=DET))
    plain = [_ok(engine.generate_batch([q]))[0] for q in requests]
    assert [(r.batch_size, r.batch_invariant) for r in slotted] == [(3, True)] * 3
    assert [r.token_ids for r in slotted] == [r.token_ids for r in plain]


@pytest.fixture(scope="module")
def chunked_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama4 text model (chunked attention layers, random weights), saved and loaded for real."""
    from transformers import AutoConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    config = AutoConfig.for_model(
        "llama4_text",
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=len(tokenizer),
        attention_chunk_size=16,
        num_local_experts=1,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama4")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_model_with_layers_the_layout_cannot_drive_runs_deterministic_rows_alone(
    chunked_model: str,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(chunked_model).eval()
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(chunked_model), device="cpu")
    assert engine.model.config.layer_types[0] == "chunked_attention"
    assert engine._slots.supported() is False  # refused up front: the self-test never runs on it
    results = _ok(engine.generate_batch(_requests(engine), mode=DET))
    assert [(r.batch_size, r.batch_invariant) for r in results] == [(1, False)] * 5
    again = _ok(engine.generate_batch(_requests(engine), mode=DET))
    assert [r.token_ids for r in again] == [r.token_ids for r in results]


def _debate(family: str, dtype: str) -> Conversation:
    path = tiny_model(family)
    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=12, dtype=dtype)
    b = AutoModelParticipant.from_pretrained(path, name="b", max_new_tokens=12, dtype=dtype)
    return Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(4)


def _texts(report: RunReport) -> dict[str, list[str]]:
    return {job: [m.content for m in r.transcript] for job, r in report.results.items()}


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_a_deterministic_rollout_co_steps_and_equals_each_turn_run_alone(
    family: str, co_step_dtype: str
) -> None:
    clear_engine_cache()
    conv = _debate(family, co_step_dtype)
    together = conv.rollout(n=6, devices=["cpu"], seed=9, batched=False, progress=False)
    metas = [m.metadata for r in together.results.values() for m in r.transcript[1:]]
    assert max(m["batch_size"] for m in metas) > 1
    # the spec's batched marker: False, the tokens do not depend on the batch (co-stepping is in batch_size)
    assert all(m["batched"] is False and m["batch_invariant"] is True for m in metas)
    single = conv.rollout(n=6, devices=["cpu"], seed=9, batched=False, progress=False, max_batch_size=1)
    assert {m.metadata["batch_size"] for r in single.results.values() for m in r.transcript[1:]} == {1}
    assert _texts(together) == _texts(single)


def test_an_out_of_memory_split_leaves_every_other_rows_deterministic_tokens_unchanged(
    co_step_dtype: str,
) -> None:
    """A co-stepped deterministic batch that runs out of memory is split in halves down to the bad row (the
    scheduler's bisection): the other rows land in other batches, and still get the tokens they get alone."""
    from interlens import dataset_field

    clear_engine_cache()
    solver = AutoModelParticipant.from_pretrained(
        tiny_model("qwen2"), name="solver", max_new_tokens=8, temperature=0.9, dtype=co_step_dtype
    )
    engine = solver.live_engine().engine
    marker = torch.tensor(engine.tokenizer("POISONPILL", add_special_tokens=False)["input_ids"])
    sizes: list[int] = []
    before: list[torch.Tensor] = []  # the prefill feeds blocks of 32 tokens: a marker may straddle two

    def out_of_memory_on_poison(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape[1] == 1:  # a decode step
            return
        if int(kwargs["position_ids"][0, 0]) and before and before[-1].shape[0] == ids.shape[0]:
            ids = torch.cat([before[-1][:, 1 - len(marker) :], ids], dim=1)  # the previous block's tail
        before[:] = [kwargs["input_ids"]]
        if ids.shape[1] >= len(marker) and (ids.unfold(1, len(marker), 1) == marker).all(-1).any():
            sizes.append(ids.shape[0])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")

    rows = [{"q": f"What is {i} plus {2 * i}?"} for i in range(8)]
    rows[3] = {"q": "What is POISONPILL?"}
    conv = Conversation(participants=[solver], shared_context=dataset_field("q")).turns(1).data(rows)
    handle = engine.model.register_forward_pre_hook(out_of_memory_on_poison, with_kwargs=True)
    try:
        split = conv.rollout(devices=["cpu"], batched=False, seed=2, progress=False)
    finally:
        handle.remove()
    alone = conv.rollout(devices=["cpu"], batched=False, seed=2, progress=False, max_batch_size=1)
    assert split.failed == ["row_00003"] and sizes[0] == 8 and sizes[-1] == 1
    kept = [job for job in split.results if job != "row_00003"]
    assert max(split.results[job].transcript[1].metadata["batch_size"] for job in kept) > 1

    def contents(report: RunReport) -> list[list[str]]:
        return [[m.content for m in report.results[job].transcript] for job in kept]

    assert contents(split) == contents(alone)
