"""Participants: who speaks. The base class, the speaker's view, and the scripted participant.

A participant turns a :class:`View` (what one speaker sees) into a :class:`Message`. It is async first
(``agenerate``); the conversation's sync methods wrap it. Participants are immutable recipe parts: the
conversation shares them between copy-on-write copies, so loaded weights are shared by reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .._core import (
    ConfigurationError,
    GenerationError,
    GenerationOptions,
    InterpModeError,
    Message,
    Template,
    View,
    call_blocking,
    callable_path,
    check_template,
    count_tokens,
    describe_callable,
    describe_template,
    first_tokens,
    import_callable,
)

if TYPE_CHECKING:
    pass

__all__ = ["Participant", "ScriptedParticipant", "participant_from_json", "register_participant_kind"]


class Participant:
    """Base class: a named speaker with an optional (templatable) system prompt."""

    kind: ClassVar[str] = "participant"
    needs_device: ClassVar[bool] = False  # True for local models: a rollout job runs next to its weights

    def __init__(self, *, name: str, system_prompt: Template = None) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(f"a participant needs a non-empty name=, got {name!r}")
        if name == "moderator":
            raise ConfigurationError("'moderator' is reserved for the shared context; pick another name")
        check_template(system_prompt, field=f"{name}.system_prompt")
        self.name = name
        self.system_prompt = system_prompt

    async def agenerate(self, view: View, options: GenerationOptions | None = None) -> Message:
        """Produce this speaker's next turn for ``view``."""
        raise NotImplementedError

    def generate(self, view: View, options: GenerationOptions | None = None) -> Message:
        """Sync twin of :meth:`agenerate`, for scripts and notebooks (works inside a running loop)."""
        from interlens.scheduler import run_sync

        return run_sync(self.agenerate, view, options)

    def recorded_seed(self, seed: int) -> int | None:
        """What this speaker's turn records in ``metadata["seed"]`` when its stream seed is ``seed`` (None:
        its turns draw no seeded random numbers). A resumed job compares a local speaker's with each of its
        committed turns, so that turns drawn under another seed rule are generated again
        (``Conversation.replay``)."""
        return None

    def token_record_problem(self) -> str | None:
        """Why this participant's turns cannot keep their tokens and log-probabilities (``record_tokens``),
        or None when they can (it then has a ``record_tokens`` setting). ``run(record_tokens=True)`` turns
        the setting on where it can and puts this reason in the others' turns (``tokens_missing``)."""
        return f"{type(self).__name__} {self.name!r} has no model tokens to record"

    async def end_conversation(self, stream_id: str) -> None:
        """The conversation ``stream_id`` is over: let go of anything kept for it between turns (a rollout job
        calls this when it ends, in the process where it ran). Nothing is kept here."""

    def replace(self, **changes: Any) -> Participant:
        """A copy with some settings changed (used to resolve templates per data row)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        for key, value in changes.items():
            if key not in clone.__dict__:
                raise ConfigurationError(f"{type(self).__name__} has no setting {key!r}")
            setattr(clone, key, value)
        return clone

    def to_json(self) -> dict[str, Any]:
        """A JSON description; ``participant_from_json`` rebuilds a lazy participant from it."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What identifies this participant in a recipe fingerprint."""
        return self.to_json()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class ScriptedParticipant(Participant):
    """Replies from a list (cycled through) or from a ``callable(view) -> str``.

    For tests, moderators and dry runs of a recipe. ``n_tokens`` is honest: the reply's word-and-punctuation
    count, and a turn capped by a :class:`~interlens.TokenBudget` is cut to the cap.
    """

    kind = "scripted"

    def __init__(
        self,
        name: str,
        replies: list[str] | tuple[str, ...] | Callable[[View], str],
        *,
        system_prompt: Template = None,
    ) -> None:
        super().__init__(name=name, system_prompt=system_prompt)
        if isinstance(replies, str) or not (callable(replies) or isinstance(replies, list | tuple)):
            raise ConfigurationError(
                f"ScriptedParticipant({name!r}) needs replies as a list of str or a callable(view) -> str, "
                f"got {type(replies).__name__}"
            )
        if not callable(replies):
            if not replies or not all(isinstance(r, str) for r in replies):
                raise ConfigurationError(
                    f"ScriptedParticipant({name!r}) needs a non-empty list of str replies"
                )
            replies = tuple(replies)
        self.replies = replies

    async def agenerate(self, view: View, options: GenerationOptions | None = None) -> Message:
        options = options or GenerationOptions()
        if options.steering:
            raise InterpModeError(
                f"ScriptedParticipant({self.name!r}) has no model to steer; steer a local participant "
                "(AutoModelParticipant.from_pretrained(...)) instead"
            )
        if callable(self.replies):  # user code that may block: in a thread, so it cannot stall the loop
            text = await call_blocking(self.replies, view)
            if not isinstance(text, str):
                raise GenerationError(
                    f"{self.name}: the replies callable returned {type(text).__name__}, not str"
                )
        else:
            text = self.replies[view.own_turns % len(self.replies)]
        finish = "stop"
        if options.max_new_tokens is not None and count_tokens(text) > options.max_new_tokens:
            text = first_tokens(text, options.max_new_tokens)
            finish = "length"
        return Message(self.name, text, {"n_tokens": count_tokens(text), "finish_reason": finish})

    def to_json(self) -> dict[str, Any]:
        replies: Any = list(self.replies) if not callable(self.replies) else None
        if callable(self.replies):
            try:
                replies = {"$callable": callable_path(self.replies, what="replies")}
            except ConfigurationError:  # a closure: the dialogue still saves, the replies cannot
                replies = {"$unsaved": describe_callable(self.replies)}
        return {
            "kind": self.kind,
            "name": self.name,
            "system_prompt": _template_json(self.system_prompt),
            "replies": replies,
        }

    def describe(self) -> dict[str, Any]:
        replies = describe_callable(self.replies) if callable(self.replies) else list(self.replies)
        return {
            "kind": self.kind,
            "name": self.name,
            "system_prompt": describe_template(self.system_prompt),
            "replies": replies,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScriptedParticipant:
        from .._core import template_from_json

        replies = data["replies"]
        if isinstance(replies, dict) and "$callable" in replies:
            replies = import_callable(replies["$callable"])
        elif isinstance(replies, dict):
            replies = _unsaved_replies(data["name"], replies.get("$unsaved", "?"))
        return cls(data["name"], replies, system_prompt=template_from_json(data.get("system_prompt")))


def _unsaved_replies(name: str, description: str) -> Callable[[View], str]:
    def replies(view: View) -> str:
        raise GenerationError(
            f"ScriptedParticipant({name!r}) was saved with a closure for replies ({description}), which JSON "
            "cannot hold; give it replies again with conv.set(participants=[...])"
        )

    return replies


def _template_json(value: Template) -> Any:
    from .._core import template_to_json

    return template_to_json(value)


_PARTICIPANT_KINDS: dict[str, Callable[[Mapping[str, Any]], Participant]] = {
    ScriptedParticipant.kind: ScriptedParticipant.from_json,
}


def register_participant_kind(kind: str, loader: Callable[[Mapping[str, Any]], Participant]) -> None:
    _PARTICIPANT_KINDS[kind] = loader


def participant_from_json(data: Mapping[str, Any]) -> Participant:
    loader = _PARTICIPANT_KINDS.get(data.get("kind", ""))
    if loader is None:
        raise ConfigurationError(f"unknown participant kind {data.get('kind')!r} in saved recipe")
    return loader(data)
