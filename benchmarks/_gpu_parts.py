"""The engine-level parts of ``gpu_check.py`` (issues 15, 26): each loads its own model on one device and
returns its figures. Imported by the script as ``from _gpu_parts import ...`` (a script's own directory is on
``sys.path``); read ``gpu_check.py``'s docstring and docs/gpu.md for what each part shows.
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

__all__ = [
    "REHEARSAL_SHAPE",
    "SHAPES",
    "decode_bench",
    "deterministic_check",
    "generate_check",
    "invariance_diagnosis",
    "kv_reuse_check",
    "random_model",
    "syncs_check",
    "versions",
]


def kv_reuse_check(path: str, device: str) -> list[bool]:
    """Engine level, float32: a shared-prefix batch, then each row's next turn on its kept cache; both turns
    compared with the same engine code with reuse off."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reusing = LocalEngine(model, tokenizer, device=device)
    full = LocalEngine(model, tokenizer, device=device, kv_reuse_capacity=0)
    rules = "Rules: be brief, cite one fact, answer the other side's last point. " * 4
    topics = ["Tabs.", "Spaces, always and everywhere.", "Neither: use a formatter.", "Both, by file type."]

    def prompt(text: str) -> tuple[int, ...]:
        chat = [{"role": "user", "content": text}]
        return tuple(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))

    def turn(prompts: list[tuple[int, ...]]) -> tuple[list[Any], bool]:
        requests = [
            GenerationRequest(
                prompt_ids=p,
                sampling=SamplingSettings(max_new_tokens=12, temperature=0.9, seed=7 + i),
                reuse_key=f"s{i}",
            )
            for i, p in enumerate(prompts)
        ]
        mine, theirs = reusing.generate_batch(requests), full.generate_batch(requests)
        failed = [r for r in mine + theirs if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        return mine, [r.token_ids for r in mine] == [r.token_ids for r in theirs]

    prompts = [prompt(rules + t) for t in topics]
    first, same = turn(prompts)
    print(f"  turn 1: shared_prefix_tokens {[r.shared_prefix_tokens for r in first]}; equal: {same}")
    more = tuple(tokenizer(" And the other side says no.", add_special_tokens=False).input_ids)
    second, again = turn([(*p, *r.token_ids, *more) for p, r in zip(prompts, first, strict=True)])
    print(f"  turn 2: kv_reused_tokens {[r.kv_reused_tokens for r in second]}; equal: {again}")
    return [same, again]


def deterministic_check(path: str, device: str, rows: int = 64) -> dict[str, Any]:
    """Engine level: the self-test's verdict on this device, then ``rows`` deterministic rows together vs
    each alone (64: past the self-test's 12 rows, so the batch is probed at its size first)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings
    from interlens.scheduler import ExecutionMode

    tokenizer = AutoTokenizer.from_pretrained(path)
    topics = ["Tabs.", "Spaces, always.", "Neither: a formatter.", "Both.", "Why argue?", "Tabs. " * 30]
    figures: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        engine = LocalEngine(model, tokenizer, device=device)
        t0 = time.perf_counter()
        verdict = engine.batch_invariant
        took = time.perf_counter() - t0
        requests = [
            GenerationRequest(
                prompt_ids=tuple(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
                    )
                ),
                sampling=SamplingSettings(max_new_tokens=8 + 4 * (i % 6), temperature=0.9, seed=3 + i),
            )
            for i, t in enumerate(f"{topics[i % len(topics)]} ({i})" for i in range(rows))
        ]
        det = ExecutionMode.DETERMINISTIC
        together = engine.generate_batch(requests, mode=det)
        alone = [engine.generate_batch([r], mode=det)[0] for r in requests]
        same = [
            getattr(a, "token_ids", a) == getattr(b, "token_ids", b)
            for a, b in zip(together, alone, strict=True)
        ]
        sizes = sorted({getattr(r, "batch_size", 0) for r in together})
        print(
            f"  {str(dtype).removeprefix('torch.')}: batch_invariant={verdict} (self-test {took:.2f} s); "
            f"batch sizes {sizes}; rows equal to alone: {sum(same)}/{len(same)}"
        )
        figures[str(dtype).removeprefix("torch.")] = {
            "batch_invariant": verdict,
            "batch_sizes": sizes,
            "equal_to_alone": sum(same),
            "rows": len(same),
        }
        del engine, model
    return figures


def invariance_diagnosis(path: str, device: str) -> dict[str, Any]:
    """Which kernel breaks batch invariance in float32 here: the engine's self-test (its verdict only) with
    every linear layer in fixed-row chunks, under each attention kernel SDPA offers for float32 on this
    device. A kernel under which the verdict turns True is the one the stock choice trips on."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._batch_invariance import batch_invariant
    from interlens.engine._generation import LocalEngine

    figures: dict[str, Any] = {}
    if device.startswith("cuda"):
        matmul = torch.backends.cuda.matmul
        figures["tf32"] = {"matmul": matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    engine = LocalEngine(model, AutoTokenizer.from_pretrained(path), device=device)
    slots = engine._slots
    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if device.startswith("cuda"):
        backends["cudnn"] = SDPBackend.CUDNN_ATTENTION
    for chunked in (False, True):
        slots.fixed_linear_rows = chunked
        for name, backend in {"default": None, **backends}.items():
            key = f"{'chunked' if chunked else 'stock'} linears, {name} attention"
            try:
                with torch.inference_mode(), sdpa_kernel([backend]) if backend else nullcontext():
                    figures[key] = batch_invariant(slots)
            except Exception as exc:  # a kernel this device or dtype cannot run
                figures[key] = f"{type(exc).__name__}: {str(exc)[:120]}"
            print(f"  float32, {key}: {figures[key]}", flush=True)
    return figures


#: The decode benchmark's model shapes (Qwen2.5-0.5B and -3B, random weights built from a config on the
#: device: nothing to fetch), its vocabulary included: the LM head is a large share of a small model's step.
SHAPES: dict[str, dict[str, int]] = {
    "0.5B": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "vocab_size": 151936,
    },
    "3B": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "vocab_size": 151936,
    },
}
#: The CPU rehearsal's shape: another layer count and width than the tiny model's own, so the rehearsal
#: builds a config the way the GPU run does (a shape's layer count must reach every per-layer list).
REHEARSAL_SHAPE = {
    "3 layers": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "vocab_size": 512,
    }
}


class _IdsOnly:
    """The tokenizer of a random-weight model: its rows have no text worth decoding, and no end-of-turn id
    (every row runs its whole length, in both paths)."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def random_model(path: str, device: str, shape: dict[str, int]) -> Any:
    """A model of ``shape`` (one of :data:`SHAPES`) with random weights, built from the config at ``path``
    straight on ``device``: bfloat16 on CUDA, float32 elsewhere; no end-of-turn id (every row runs its whole
    length), pad id 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    heads, layers = shape["num_attention_heads"], shape["num_hidden_layers"]
    config.update({**shape, "num_key_value_heads": 2, "head_dim": shape["hidden_size"] // heads})
    config.update({"max_position_embeddings": 4096, "tie_word_embeddings": True})
    if getattr(config, "layer_types", None) is not None:  # one entry per layer: the new count's
        config.layer_types = ["full_attention"] * layers
    config.eos_token_id = None
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):  # initialised on the device: a 3B model's random init on the host is slow
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def decode_bench(
    path: str, device: str, shapes: dict[str, dict[str, int]], batches: list[int], *, new: int, prompt: int
) -> dict[str, Any]:
    """Tokens a second of the engine's batched generation against HF ``generate`` (dynamic cache), on random
    models of ``shapes`` in bfloat16: ``batches`` rows of random ``prompt``-token prompts, ``new`` tokens each
    (no end-of-turn id), T = 0.9, one warm-up of each then one timed run of each."""
    import torch

    from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings
    from interlens.scheduler import ExecutionMode

    def timed(fn: Any) -> float:
        fn()  # warm-up: kernels, the allocator, the engine's first-call checks
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    figures: dict[str, Any] = {}
    for name, shape in shapes.items():
        model = random_model(path, device, shape)
        config = model.config
        engine = LocalEngine(model, _IdsOnly(), device=device)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        rows: dict[str, Any] = {}
        for batch in batches:
            ids = torch.randint(
                1, config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(batch)
            )
            requests = [
                GenerationRequest(
                    prompt_ids=tuple(r),
                    sampling=SamplingSettings(max_new_tokens=new, temperature=0.9, seed=i),
                )
                for i, r in enumerate(ids.tolist())
            ]
            ours = timed(lambda e=engine, r=requests: e.generate_batch(r))
            on_device = ids.to(device)
            theirs = timed(
                lambda m=model, x=on_device: m.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=True,
                    temperature=0.9,
                    top_k=0,
                    max_new_tokens=new,
                    min_new_tokens=new,
                )
            )
            rows[str(batch)] = {
                "engine_tok_s": round(batch * new / ours, 1),
                "generate_tok_s": round(batch * new / theirs, 1),
                "engine_over_generate": round(theirs / ours, 2),
                "engine_ms_per_step": round(1000 * ours / new, 2),
            }
            # deterministic rows co-step only where the self-test passed: else they run one at a time,
            # which at 256 rows would take the rest of the machine's time
            if engine.batch_invariant:
                det = timed(
                    lambda e=engine, r=requests: e.generate_batch(r, mode=ExecutionMode.DETERMINISTIC)
                )
                rows[str(batch)]["deterministic_over_batched"] = round(ours / det, 2)
            else:
                rows[str(batch)]["deterministic_over_batched"] = "not batch-invariant: rows run alone"
            print(f"  {name} ({params:.0f}M), batch {batch}: {rows[str(batch)]}", flush=True)
        figures[name] = {"params_m": round(params), **rows}
        del engine, model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return figures


def versions() -> dict[str, Any]:
    """What the image has: checked first, so a missing package is the first line of the log, not a crash in
    part 4."""
    import importlib.metadata as metadata

    import torch

    found: dict[str, Any] = {"python": sys.version.split()[0], "cuda": torch.version.cuda}
    for name in ("torch", "transformers", "accelerate", "anyio", "aiosqlite", "interlens"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print("  " + ", ".join(f"{k} {v}" for k, v in found.items()))
    return found


def _chat(tokenizer: Any, text: str) -> tuple[int, ...]:
    messages = [{"role": "user", "content": text}]
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def generate_check(path: str, device: str) -> dict[str, Any]:
    """Part 0, float32 on ``device``: the engine's greedy tokens against HF ``generate`` of each prompt alone,
    for one batch of mixed lengths whose first two prompts share a long prefix, and for a batch of one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = LocalEngine(model, tokenizer, device=device)
    rules = "Rules: be brief, cite one fact, answer the other side's last point. " * 6
    prompts = [_chat(tokenizer, t) for t in (rules + "Tabs.", rules + "Spaces.", "Why argue?", "No. " * 15)]
    eos = set(engine._runner.eos_ids)

    def reference(prompt: tuple[int, ...]) -> list[int]:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
        tokens = out[0, len(prompt) :].tolist()
        ends = [i for i, t in enumerate(tokens) if t in eos]
        return tokens[: ends[0] + 1] if ends else tokens

    requests = [
        GenerationRequest(prompt_ids=p, sampling=SamplingSettings(max_new_tokens=16, temperature=0))
        for p in prompts
    ]
    batch = engine.generate_batch(requests)
    alone = engine.generate_batch(requests[2:3])[0]
    expected = [reference(p) for p in prompts]
    figures = {
        "batch_equal": [getattr(r, "token_ids", r) == e for r, e in zip(batch, expected, strict=True)],
        "alone_equal": getattr(alone, "token_ids", alone) == expected[2],
        "shared_prefix_tokens": [getattr(r, "shared_prefix_tokens", None) for r in batch],
    }
    print(f"  {figures}")
    return figures


@contextmanager
def host_syncs(device: str) -> Iterator[Counter[str]]:
    """Counts the host's waits on the device inside: on CUDA the synchronising calls torch reports
    (``set_sync_debug_mode``), on the CPU the calls that would be one there (host reads of tensor values,
    tensors built from host data) as they pass torch's function dispatch."""
    import torch
    from torch.overrides import TorchFunctionMode

    counts: Counter[str] = Counter()
    if device.startswith("cuda"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts["sync"] = sum("synchroniz" in str(w.message) for w in seen)
        return
    reads = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    class Counted(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if getattr(func, "__name__", "") in reads or func is torch.tensor:
                counts["sync"] += 1
            return func(*args, **(kwargs or {}))

    with Counted():
        yield counts


def syncs_check(path: str, device: str) -> dict[str, Any]:
    """Host syncs per decode step (batched and deterministic, 6 rows of mixed lengths): the difference
    between batches of 24 and 8 tokens over 16 steps. One is the floor (reading the chosen tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import GenerationRequest, LocalEngine, SamplingSettings
    from interlens.scheduler import ExecutionMode

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    figures: dict[str, Any] = {}
    for mode in (ExecutionMode.BATCHED, ExecutionMode.DETERMINISTIC):
        counts = []
        for new in (8, 24):
            engine = LocalEngine(model, tokenizer, device=device)
            engine._runner.eos_ids = frozenset()  # every row runs to its cap
            requests = [
                GenerationRequest(
                    prompt_ids=_chat(tokenizer, "tabs " * (1 + 3 * i)),
                    sampling=SamplingSettings(max_new_tokens=new, temperature=0.9, seed=i),
                )
                for i in range(6)
            ]
            engine.generate_batch(requests, mode=mode)  # the first call runs one-off checks
            with host_syncs(device) as counted:
                engine.generate_batch(requests, mode=mode)
            counts.append(counted["sync"])
        figures[mode.value] = (counts[1] - counts[0]) / 16
    # where the self-test fails, deterministic rows run one at a time: a read per row a step
    figures["deterministic_rows_co_step"] = engine.batch_invariant
    print(f"  host syncs per decode step: {figures} (1 = reading the chosen tokens)")
    return figures
