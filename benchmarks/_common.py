"""What several benchmarks share: the two-speaker debate they time, and how a figure's spread is printed.

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
