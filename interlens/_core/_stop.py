"""Stop conditions: when a conversation ends, and how long its next turn may be.

A :class:`StopCondition` is asked two things before every turn: ``should_stop(conv)`` and
``max_new_tokens(conv)`` (a cap for the coming turn, or ``None``). Conditions combine: the conversation stops
when any of them says so, and a turn gets the smallest cap. Everything is counted from the conversation's own
transcript (``metadata["n_tokens"]``), never re-tokenized, so budgets are per conversation and free.

:class:`TokenBudget` is also a context manager: ``with TokenBudget(per_conversation=2048):`` applies it to
every run and rollout started inside the block (through a contextvar), each conversation with its own budget.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ._blocking import TIME_LIMITS, within
from ._exceptions import ConfigurationError, GenerationError

if TYPE_CHECKING:
    from ..conversation import Conversation

T = TypeVar("T")

__all__ = [
    "MaxTurns",
    "StopCondition",
    "StopStrings",
    "TokenBudget",
    "TurnWatch",
    "ambient_conditions",
]

_AMBIENT: contextvars.ContextVar[tuple[StopCondition, ...]] = contextvars.ContextVar(
    "interlens_ambient_stop_conditions", default=()
)


def ambient_conditions() -> tuple[StopCondition, ...]:
    """Conditions set by enclosing ``with TokenBudget(...)`` blocks."""
    return _AMBIENT.get()


class StopCondition:
    """Base class. Subclasses override one or both hooks; both default to "no opinion"."""

    def should_stop(self, conv: Conversation) -> bool:
        return False

    def max_new_tokens(self, conv: Conversation) -> int | None:
        return None

    def to_json(self) -> dict[str, Any]:
        """A JSON description (for save and recipe fingerprints)."""
        return {"type": type(self).__qualname__, "repr": repr(self)}


class MaxTurns(StopCondition):
    """Stop after ``n`` generated turns (the shared context does not count)."""

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigurationError(f"MaxTurns needs a non-negative int, got {n!r}")
        self.n = n

    def should_stop(self, conv: Conversation) -> bool:
        return conv.generated_turns >= self.n

    def to_json(self) -> dict[str, Any]:
        return {"type": "MaxTurns", "n": self.n}

    def __repr__(self) -> str:
        return f"MaxTurns({self.n})"


class StopStrings(StopCondition):
    """Stop once a generated turn contains any of ``strings`` (e.g. ``"Final answer:"``)."""

    def __init__(self, *strings: str) -> None:
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ConfigurationError(f"StopStrings needs one or more non-empty strings, got {strings!r}")
        self.strings = tuple(strings)

    def should_stop(self, conv: Conversation) -> bool:
        last = conv.last_generated
        return last is not None and any(s in last.content for s in self.strings)

    def to_json(self) -> dict[str, Any]:
        return {"type": "StopStrings", "strings": list(self.strings)}

    def __repr__(self) -> str:
        return f"StopStrings({', '.join(map(repr, self.strings))})"


class TokenBudget(StopCondition):
    """Stop a conversation once ITS generated tokens reach ``per_conversation``; cap each turn.

    Each turn's ``max_new_tokens`` is capped to what is left of ``per_conversation`` and to ``per_turn``.
    Use it with ``.run_until(TokenBudget(...))`` or ambiently: ``with TokenBudget(per_conversation=2048):``.
    """

    def __init__(self, per_conversation: int | None = None, per_turn: int | None = None) -> None:
        for label, value in (("per_conversation", per_conversation), ("per_turn", per_turn)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigurationError(
                    f"TokenBudget({label}=...) must be a positive int or None, got {value!r}"
                )
        if per_conversation is None and per_turn is None:
            raise ConfigurationError("TokenBudget needs per_conversation=, per_turn= or both")
        self.per_conversation = per_conversation
        self.per_turn = per_turn
        self._tokens: list[contextvars.Token[tuple[StopCondition, ...]]] = []

    def should_stop(self, conv: Conversation) -> bool:
        return self.per_conversation is not None and conv.tokens_generated >= self.per_conversation

    def max_new_tokens(self, conv: Conversation) -> int | None:
        caps = [self.per_turn] if self.per_turn is not None else []
        if self.per_conversation is not None:
            caps.append(max(self.per_conversation - conv.tokens_generated, 0))
        return min(caps) if caps else None

    def __enter__(self) -> TokenBudget:
        self._tokens.append(_AMBIENT.set((*_AMBIENT.get(), self)))
        return self

    def __exit__(self, *exc: object) -> None:
        _AMBIENT.reset(self._tokens.pop())

    def to_json(self) -> dict[str, Any]:
        return {"type": "TokenBudget", "per_conversation": self.per_conversation, "per_turn": self.per_turn}

    def __repr__(self) -> str:
        return f"TokenBudget(per_conversation={self.per_conversation!r}, per_turn={self.per_turn!r})"


def condition_from_json(data: dict[str, Any]) -> StopCondition | None:
    """Rebuild the built-in conditions; a custom one comes back as ``None`` (the caller reports it)."""
    kind = data.get("type")
    if kind == "MaxTurns":
        return MaxTurns(data["n"])
    if kind == "StopStrings":
        return StopStrings(*data["strings"])
    if kind == "TokenBudget":
        return TokenBudget(per_conversation=data["per_conversation"], per_turn=data["per_turn"])
    return None


def turn_cap(conditions: Sequence[StopCondition], conv: Conversation) -> int | None:
    """The smallest ``max_new_tokens`` any condition imposes on the next turn."""
    caps = [c for c in (cond.max_new_tokens(conv) for cond in conditions) if c is not None]
    return min(caps) if caps else None


class TurnWatch:
    """What the turn loop watches besides its stop conditions, so that a job always ends:

    - each turn's time, against the job's ``turn_timeout`` (:data:`TIME_LIMITS`; live runs have none): a turn
      past it fails the job, named, instead of holding the run;
    - progress: when nothing bounds the turns (no ``.turns(n)``, no ``MaxTurns``) and turn after turn
      generates no token, a stop condition that waits on tokens (a ``TokenBudget``) or on text
      (``StopStrings``) will never hold. After ``limit`` such turns in a row the loop raises instead of
      writing empty turns to the ledger forever; one turn with a token resets the count.
    """

    def __init__(self, conditions: Sequence[StopCondition], *, limit: int = 16) -> None:
        self.unbounded = not any(isinstance(c, MaxTurns) for c in conditions)
        self.conditions, self.limit, self.empty = conditions, limit, 0

    async def turn(self, speaker: str, index: int, awaitable: Awaitable[T]) -> T:
        seconds = TIME_LIMITS.get().turn

        def timed_out() -> Exception:
            return GenerationError(
                f"{speaker!r} did not finish turn {index} within turn_timeout={seconds} s, so its job fails "
                "(the others go on). Raise turn_timeout= (or pass None) if turns this long are expected"
            )

        return await within(seconds, awaitable, timed_out=timed_out)

    def after_turn(self, conv: Conversation, tokens_before: int) -> None:
        if not self.unbounded:
            return
        self.empty = self.empty + 1 if conv.tokens_generated <= tokens_before else 0
        if self.empty >= self.limit:
            raise GenerationError(
                f"this conversation makes no progress: its last {self.empty} turns generated no token, and "
                f"nothing bounds its turns (.turns(None); stop conditions {list(self.conditions)}), so it "
                "would never end. Give it a turn limit (.turns(n)), or make its participants say something"
            )
