"""What several benchmarks share: the two-speaker debate they time, how a figure's spread is printed, and the
machine each figure comes from (CPU model and the flags that decide its kernels; the dtype it runs fast).

Imported by the scripts as ``from _common import ...`` (a script's own directory is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
from collections.abc import Callable, Iterator
from typing import Any

from interlens import AutoModelParticipant, Conversation


def debate(
    path: str, *, turns: int, new_tokens: int, dtype: str | None, system_tokens: int = 0, **settings: Any
) -> Conversation:
    """Two participants on the model at ``path`` arguing tabs vs spaces, T = 0.9; ``settings`` go to both.

    ``system_tokens``: each speaker's system prompt grows to about that many tokens (debate rules written
    out), as real debate prompts are: a few hundred tokens of instructions every turn re-reads."""
    rules = _rules(path, system_tokens) if system_tokens else ""

    def speaker(name: str, side: str) -> Any:
        return AutoModelParticipant.from_pretrained(
            path,
            name=name,
            temperature=0.9,
            max_new_tokens=new_tokens,
            dtype=dtype,
            system_prompt=f"Argue for {side}.{rules}",
            **settings,
        )

    return Conversation(
        participants=[speaker("a", "tabs"), speaker("b", "spaces")], shared_context="Debate: tabs vs spaces."
    ).turns(turns)


_RULE = (
    " Rule {i}: answer the other speaker's last point before you make a new one, keep each answer short,"
    " cite one concrete example from a real code base, and never repeat an argument already made."
)


def _rules(path: str, tokens: int) -> str:
    """About ``tokens`` tokens (by the model's own tokenizer) of numbered debate rules."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = ""
    i = 1
    while len(tokenizer(text, add_special_tokens=False).input_ids) < tokens:
        text += _RULE.format(i=i)
        i += 1
    return text


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """``--model``: ``real`` (SmolLM2-135M-Instruct, real weights), ``bench`` (the toy 25.6M random-weight
    Qwen2, for figures that need a tiny model), or a model directory."""
    parser.add_argument(
        "--model",
        default="real",
        help="'real' (SmolLM2-135M-Instruct; the default), 'bench' (toy random-weight Qwen2), or a directory",
    )


def model_path(parser: argparse.ArgumentParser, model: str) -> tuple[str, str]:
    """The directory for ``--model`` and a label saying what it is."""
    if model == "real":
        from interlens.testing import REAL_MODEL_INSTALL, real_model

        found = real_model()
        if found is None:
            parser.error(f"--model real needs the real model: {REAL_MODEL_INSTALL}")
        return str(found), "SmolLM2-135M-Instruct (real weights)"
    if model == "bench":
        from interlens.testing import tiny_model

        return tiny_model("qwen2", size="bench"), "the toy qwen2 'bench' (25.6M, random weights)"
    return model, model


def bare_step_ms(model: Any, rows: int, context: int, *, steps: int = 6, repeats: int = 3) -> float:
    """Milliseconds of one bare decode step of ``model``: ``rows`` rows, one token each, over ``context``
    cached tokens in a static cache, logits of the whole vocabulary included (median over ``repeats`` runs
    of ``steps`` steps after an untimed prefill). The limit a decode loop can reach at that shape."""
    import time

    import torch
    from transformers import StaticCache

    device = next(model.parameters()).device
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = StaticCache(config=model.config, max_cache_len=context + steps)
            ids = torch.randint(100, 1000, (rows, context), device=device)
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            token = torch.randint(100, 1000, (rows, 1), device=device)
            start = time.perf_counter()
            for s in range(steps):
                position = torch.full((rows, 1), context + s, dtype=torch.long, device=device)
                out = model(input_ids=token, position_ids=position, cache=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - start) * 1000 / steps)
    return statistics.median(times)


@contextlib.contextmanager
def stock_attention(model: Any, implementation: str = "sdpa") -> Iterator[None]:
    """``model`` on transformers' own attention (``implementation``) for the duration, then back. A baseline
    written by hand runs transformers' SDPA; interlens gives the model of a CPU engine its own decode-step
    attention (``interlens/engine/_cpu_attention.py``), so a baseline on the engine's model must ask for the
    stock one, or it would run interlens' code."""
    before = model.config._attn_implementation
    if before != implementation:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if before != implementation:
            model.set_attn_implementation(before)


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a fresh thread, its exception re-raised here. Torch work on the MAIN thread slows every
    later rollout of the process: after 50 matmuls of 512x512 on the main thread, the 4-turn real-model debate
    ran at 174 instead of 255 tok/s, for good (its generation runs in the rollout's worker thread; measured
    2026-12-03, torch 2.13 CPU, 2 cores: the main thread's OpenMP pool). interlens now frees the caller's
    pool before it generates (``release_openmp_pool``); a baseline that runs torch still runs here, in a
    thread that ends with it, so that no arm depends on that."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised in the caller
            failed.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def spread(values: list[float], fmt: str = ".1f") -> str:
    """``median (min–max)``."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def _cpuinfo() -> tuple[str, set[str]]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown CPU", set()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line), "?")
    lines = text.splitlines()
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return name, set(flags)


def cpu_summary() -> str:
    """The CPU's model name and the flags that decide the kernels (AVX2, AVX-512, bf16, AMX)."""
    name, flags = _cpuinfo()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(shown) or 'no AVX2'})"


def fast_dtype(requested: str) -> str:
    """``requested``, or for ``"auto"`` the dtype this machine runs fast: bfloat16 on a GPU or a CPU with bf16
    hardware (AVX512-BF16, AMX), float32 elsewhere (without it bf16 matrix products are emulated, ~80x
    slower on an AVX2-only CPU: every bf16 figure there would measure the emulation)."""
    if requested != "auto":
        return requested
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & _cpuinfo()[1] else "float32"


#: Chat questions for the engine-level benchmarks (``question_batch``): real prompts of several lengths.
QUESTIONS = [
    "Tabs or spaces? Give your strongest argument.",
    "Should a code review block on style?",
    "Is a monorepo worth it for a team of five?",
    "When is a global variable acceptable?",
    "Explain why tests that cannot fail are a defect.",
    "Is Python's GIL still a problem?",
    "What makes an error message good?",
    "Should APIs take keyword-only arguments?",
]


def add_batch_options(parser: argparse.ArgumentParser, *, max_new: int) -> None:
    """``--model``, ``--rows``, ``--max-new``, ``--repeats`` and ``--dtype`` of an engine-level benchmark."""
    add_model_option(parser)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=max_new)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")


def question_batch(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, same: bool = False
) -> tuple[Any, list[tuple[int, ...]]]:
    """``--model`` in ``--dtype`` (the one this machine runs fast by default) as a ``LocalEngine`` without KV
    reuse, and ``--rows`` chat prompts cycling through ``QUESTIONS`` (all the first where ``same``: no row
    padded); prints the command, the model, dtype and CPU."""
    import shlex
    import sys

    print("command:", shlex.join(["python", *sys.argv]))
    path, label = model_path(parser, args.model)
    dtype = fast_dtype(args.dtype)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens.engine._generation import LocalEngine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = LocalEngine(model, tokenizer, device="cpu", kv_reuse_capacity=0)
    prompts = []
    for i in range(args.rows):
        chat = [{"role": "user", "content": QUESTIONS[0 if same else i % len(QUESTIONS)]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        prompts.append(tuple(ids))
    print(f"{label}, {dtype}, {args.rows} rows, max_new_tokens {args.max_new}; CPU: {cpu_summary()}")
    return engine, prompts
