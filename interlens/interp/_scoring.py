"""Log-probabilities of a continuation: the basis of most behavioural measurements on local models.

``conv.logprobs("alice", " I agree.")`` scores the text as alice's next message after her current view:
the view is rendered with the model's chat template (generation prompt included), the text is tokenized on
its own and appended, and ONE teacher-forced forward pass gives ``log P(token_i | prompt, tokens_<i)`` for
every token of the text (float32 log-softmax of the logits). Nothing is sampled, so a score is exact in both
execution modes; under ``conv.capture()`` the pass is recorded like a turn (``kind="score"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._capture import Captured

__all__ = ["Logprobs", "ScoredText"]


@dataclass(frozen=True)
class ScoredText:
    """What the chat engine returns for one scored continuation (``_chat_engine.ChatScoreRequest``)."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    captured: Captured | None


@dataclass(frozen=True)
class Logprobs:
    """Per-token log-probabilities of ``text`` as ``speaker``'s next message.

    ``total`` is the log-probability of the whole text (the sum; also ``float(lp)``), ``mean`` the per-token
    average; ``tokens`` and ``token_ids`` are the text's tokens as the model's tokenizer split it.
    """

    speaker: str
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]

    @property
    def total(self) -> float:
        return math.fsum(self.logprobs)

    @property
    def mean(self) -> float:
        return self.total / len(self.logprobs) if self.logprobs else 0.0

    def __float__(self) -> float:
        """``float(lp)`` is the total: the log-probability of the whole text, what a comparison wants."""
        return self.total

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (what an analyzer may return)."""
        return {
            "speaker": self.speaker,
            "text": self.text,
            "tokens": list(self.tokens),
            "logprobs": list(self.logprobs),
            "total": self.total,
        }

    def __len__(self) -> int:
        return len(self.logprobs)

    def __repr__(self) -> str:
        return f"Logprobs({self.speaker!r}, {self.text!r}, total={self.total:.4f}, n_tokens={len(self)})"
