"""The immutable recipe record behind a :class:`~interlens.Conversation`, and its validation.

Every modifier of a conversation builds a new :class:`Recipe` (copy-on-write) and validates it here, so a
bad participant list, template, turn count, analyzer, name or data source fails at the call that set it.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._core import (
    ConfigurationError,
    ConfigurationTypeError,
    OnceRows,
    StopCondition,
    Template,
    check_template,
    check_text,
)
from ..participants import Participant

if TYPE_CHECKING:
    from ._conversation import Conversation

__all__ = ["FIELDS", "Recipe", "participants_tuple", "stop_tuple", "validate"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    participants: tuple[Participant, ...]
    shared_context: Template = None
    shared_system_prompt: Template = None
    turns: int | None = None
    data: Any = None
    analyzer: Callable[[Conversation], Any] | str | None = None
    name: str | None = None
    stop: tuple[StopCondition, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.data, Iterator):  # copies made later share the wrapper, hence its read mark
            object.__setattr__(self, "data", OnceRows.of(self.data))


FIELDS = tuple(f.name for f in dataclasses.fields(Recipe))


def participants_tuple(participants: Any) -> tuple[Participant, ...]:
    """``participants=`` as a tuple: one Participant or an iterable of them (each checked by _validate)."""
    if isinstance(participants, Participant):
        return (participants,)
    if isinstance(participants, str | bytes | Mapping) or not isinstance(participants, Iterable):
        raise ConfigurationTypeError(
            "Conversation(participants=...) needs a list of Participant objects, e.g. "
            f"Conversation([ScriptedParticipant('a', ['hi']), model]), got {type(participants).__name__} "
            f"{reprlib.repr(participants)}"
        )
    return tuple(participants)


def stop_tuple(stop: Any) -> tuple[StopCondition, ...]:
    if isinstance(stop, StopCondition):
        return (stop,)
    if isinstance(stop, str | bytes | Mapping) or not isinstance(stop, Iterable):
        raise ConfigurationTypeError(
            "Conversation(stop=...) needs a list of StopCondition objects, e.g. stop=[StopStrings('DONE')], "
            f"got {type(stop).__name__}"
        )
    return tuple(stop)


def validate(recipe: Recipe) -> None:
    if not recipe.participants:
        raise ConfigurationError("a Conversation needs at least one participant")
    for p in recipe.participants:
        if not isinstance(p, Participant):
            raise ConfigurationTypeError(
                f"Conversation(participants=...) takes Participant objects (ScriptedParticipant, "
                f"AutoModelParticipant.from_pretrained(...), APIParticipant), got {type(p).__name__}: "
                f"{reprlib.repr(p)}"
            )
    names = [p.name for p in recipe.participants]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"participant names must be unique, got {names}")
    check_template(recipe.shared_context, field="shared_context")
    check_template(recipe.shared_system_prompt, field="shared_system_prompt")
    if recipe.turns is not None and (
        not isinstance(recipe.turns, int) or isinstance(recipe.turns, bool) or recipe.turns < 0
    ):
        raise ConfigurationError(f".turns(n) needs a non-negative int or None, got {recipe.turns!r}")
    for cond in recipe.stop:
        if not isinstance(cond, StopCondition):
            raise ConfigurationError(f"run_until() needs StopCondition objects, got {cond!r}")
    if recipe.analyzer is not None and not (callable(recipe.analyzer) or isinstance(recipe.analyzer, str)):
        raise ConfigurationError(
            f".analyzer() needs a callable(conv) or a registered name, got {recipe.analyzer!r}"
        )
    if recipe.name is not None and (
        not isinstance(recipe.name, str) or not recipe.name or "/" in recipe.name
    ):
        raise ConfigurationError(f".name() needs a non-empty str without '/', got {recipe.name!r}")
    check_text(recipe.name, what=".name()")
    if recipe.data is not None and (
        isinstance(recipe.data, str | bytes | Mapping)
        or not (isinstance(recipe.data, Iterable) or callable(recipe.data))
    ):
        raise ConfigurationError(
            f".data() needs an iterable of rows (a datasets.Dataset, an IterableDataset, a list of dicts or "
            "a "
            f"generator) or a zero-argument callable that returns one, got {type(recipe.data).__name__}"
        )
