"""What several benchmarks share: the two-speaker debate they time, how a figure's spread is printed, and the
machine each figure comes from (CPU model and the flags that decide its kernels; the dtype it runs fast).

Imported by the scripts as ``from _common import ...`` (a script's own directory is on ``sys.path``).
"""

from __future__ import annotations

import statistics
from typing import Any

from interlens import AutoModelParticipant, Conversation


def debate(path: str, *, turns: int, new_tokens: int, dtype: str | None, **settings: Any) -> Conversation:
    """Two participants on the model at ``path`` arguing tabs vs spaces, T = 0.9; ``settings`` go to both."""

    def speaker(name: str, side: str) -> Any:
        return AutoModelParticipant.from_pretrained(
            path,
            name=name,
            temperature=0.9,
            max_new_tokens=new_tokens,
            dtype=dtype,
            system_prompt=f"Argue for {side}.",
            **settings,
        )

    return Conversation(
        participants=[speaker("a", "tabs"), speaker("b", "spaces")], shared_context="Debate: tabs vs spaces."
    ).turns(turns)


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
