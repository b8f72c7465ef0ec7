"""Participants: who speaks. The base class, the speaker's view, and the scripted participant.

A participant turns a :class:`View` (what one speaker sees) into a :class:`Message`. It is async first
(``agenerate``); the conversation's sync methods wrap it. Participants are immutable recipe parts: the
conversation shares them between copy-on-write copies, so loaded weights are shared by reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ._exceptions import ConfigurationError, GenerationError, InterpModeError
from ._message import Message
from ._templating import Template, callable_path, check_template, import_callable

if TYPE_CHECKING:
    from ._capture import CaptureTarget
    from ._steering import SteeringSpec

__all__ = ["GenerationOptions", "Participant", "ScriptedParticipant", "View", "count_tokens"]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """A tokenizer-free token count (words and punctuation) for participants without a tokenizer."""
    return len(_TOKEN_RE.findall(text))


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
        if callable(self.replies):
            text = self.replies(view)
            if not isinstance(text, str):
                raise GenerationError(
                    f"{self.name}: the replies callable returned {type(text).__name__}, not str"
                )
        else:
            text = self.replies[view.own_turns % len(self.replies)]
        finish = "stop"
        if options.max_new_tokens is not None and count_tokens(text) > options.max_new_tokens:
            tokens = list(_TOKEN_RE.finditer(text))
            text = text[: tokens[options.max_new_tokens - 1].end()] if options.max_new_tokens > 0 else ""
            finish = "length"
        return Message(self.name, text, {"n_tokens": count_tokens(text), "finish_reason": finish})

    def to_json(self) -> dict[str, Any]:
        replies: Any = list(self.replies) if not callable(self.replies) else None
        if callable(self.replies):
            try:
                replies = {"$callable": callable_path(self.replies, what="replies")}
            except ConfigurationError:  # a closure: the dialogue still saves, the replies cannot
                replies = {"$unsaved": _describe_callable(self.replies)}
        return {
            "kind": self.kind,
            "name": self.name,
            "system_prompt": _template_json(self.system_prompt),
            "replies": replies,
        }

    def describe(self) -> dict[str, Any]:
        replies = _describe_callable(self.replies) if callable(self.replies) else list(self.replies)
        return {
            "kind": self.kind,
            "name": self.name,
            "system_prompt": _describe_template(self.system_prompt),
            "replies": replies,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScriptedParticipant:
        from ._templating import template_from_json

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
    from ._templating import template_to_json

    return template_to_json(value)


def _describe_callable(fn: Any) -> str:
    """Name + a hash of the code: stable across runs, changes when the function body changes.

    Never a repr: a callable object's default repr holds its memory address, which would make every rerun's
    recipe fingerprint differ. An instance with ``__call__`` is named by its class and that method's code;
    a ``functools.partial`` by its function and arguments.
    """
    import functools
    import hashlib

    if isinstance(fn, functools.partial):
        return f"partial({_describe_callable(fn.func)}, args={fn.args!r}, keywords={fn.keywords!r})"
    owner: Any = fn
    code = getattr(fn, "__code__", None)
    if code is None and not hasattr(fn, "__qualname__"):  # a callable instance: its class says what it does
        owner = type(fn)
        code = getattr(owner.__call__, "__code__", None)
    digest = hashlib.sha256(_code_bytes(code)).hexdigest()[:16] if code else ""
    name = getattr(owner, "__qualname__", type(fn).__qualname__)
    return f"{getattr(owner, '__module__', '?')}:{name}#{digest}"


def _code_bytes(code: Any) -> bytes:
    """A code object's bytecode and constants, nested code (comprehensions, inner functions) included by
    content: the repr of a code object holds its memory address, which differs on every run."""
    parts = [code.co_code]
    for const in code.co_consts:
        parts.append(_code_bytes(const) if hasattr(const, "co_code") else repr(const).encode())
    return b"\x00".join(parts)


def _describe_template(value: Template) -> Any:
    """Like template JSON, but lambdas are named by their code instead of refused."""
    from ._templating import DatasetField

    if value is None or isinstance(value, str):
        return value
    if isinstance(value, DatasetField):
        return {"$field": value.column}
    if isinstance(value, tuple):
        return {"$concat": [_describe_template(v) for v in value]}
    if callable(value):
        return {"$callable": _describe_callable(value)}
    return repr(value)


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
