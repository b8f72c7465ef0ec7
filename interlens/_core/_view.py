"""What one speaker sees (:class:`View`) and the per-turn knobs the conversation hands it.

These records sit in the core because the engine (chat templates), the providers (request building) and the
participants all read them; none of them owns the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..interp import CaptureTarget, SteeringSpec

__all__ = ["GenerationOptions", "View", "ViewMessage", "count_tokens", "first_tokens"]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """A tokenizer-free token count (words and punctuation) for participants without a tokenizer."""
    return len(_TOKEN_RE.findall(text))


def first_tokens(text: str, n: int) -> str:
    """``text`` cut after its first ``n`` tokens as :func:`count_tokens` counts them."""
    tokens = list(_TOKEN_RE.finditer(text))
    return text[: tokens[n - 1].end()] if n > 0 else ""


@dataclass(frozen=True)
class ViewMessage:
    role: str  # "user" | "assistant"
    content: str
    author: str


@dataclass(frozen=True)
class View:
    """What one speaker sees: its system block, then the transcript from its own point of view.

    Its own turns are ``assistant`` messages, everybody else's (the shared context included) are ``user``
    messages, prefixed with the author's name when more than two participants speak.
    """

    speaker: str
    system: str | None
    messages: tuple[ViewMessage, ...]

    def as_messages(self) -> list[dict[str, str]]:
        """OpenAI-style ``[{"role", "content"}]`` with the system block first (when there is one)."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        out.extend({"role": m.role, "content": m.content} for m in self.messages)
        return out

    @property
    def own_turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "assistant")


@dataclass(frozen=True)
class GenerationOptions:
    """Per-turn knobs the conversation hands a participant (beyond the participant's own settings)."""

    max_new_tokens: int | None = None  # cap from stop conditions (TokenBudget); None = participant's own
    seed: int | None = None  # a per-turn seed in deterministic mode (or when the participant pins one)
    stream_id: str | None = None  # identity of the conversation, for cross-turn KV reuse
    ephemeral: bool = False  # sample(): not committed, must not disturb KV reuse
    capture: CaptureTarget | None = None  # inside conv.capture(): where this turn's activations go
    steering: tuple[SteeringSpec, ...] | None = None  # this turn only, instead of the participant's own
