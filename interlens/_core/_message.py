"""Messages and transcripts: the plain data a conversation is made of.

Both are JSON all the way down (``to_json`` / ``from_json``) because they are what the ledger stores and what
``save`` writes: opening a run directory must never execute code.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from ._exceptions import ConfigurationError, ConfigurationTypeError
from ._token_record import TOKENS_KEY, TOKENS_TABLE, TokenRecord, compact_turns, expand_turns

__all__ = ["MODERATOR", "Message", "Transcript"]

MODERATOR = "moderator"
"""Author of the shared context message that seeds every transcript."""


@dataclass
class Message:
    """One turn: who said it, what they said, and how it was produced.

    ``metadata`` carries generation facts such as ``n_tokens`` (tokens generated for this turn, the unit of
    :class:`~interlens.TokenBudget`), ``finish_reason``, ``batched``, ``shared_prefill`` and
    ``shared_prefix_tokens`` (the keys are listed in docs/rollouts.md).
    """

    author: str
    content: str
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Where a message read from a ledger finds its token record (schema 5 keeps records in their own table
    #: and only a marker in ``metadata["tokens"]``): called on the first :attr:`tokens`, it returns the
    #: record's JSON. Set by whoever read the message (a ``RunResult``); not part of the message's value.
    token_source: Callable[[], Mapping[str, Any] | None] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.author, str) or not self.author:
            raise ConfigurationTypeError(
                f"Message(author, content): author must be the speaker's name (a non-empty str), got "
                f"{self.author!r} ({type(self.author).__name__})"
            )
        if not isinstance(self.content, str):
            raise ConfigurationTypeError(
                f"Message({self.author!r}, content): content must be a str, got {self.content!r} "
                f"({type(self.content).__name__}); convert it first, e.g. Message({self.author!r}, "
                f"str(value))"
            )
        if not isinstance(self.metadata, dict):
            if not isinstance(self.metadata, Mapping):
                raise ConfigurationTypeError(
                    f"Message({self.author!r}, ...): metadata must be a dict, got "
                    f"{type(self.metadata).__name__}"
                )
            self.metadata = dict(self.metadata)

    @property
    def n_tokens(self) -> int:
        """Tokens generated for this turn (0 for turns nobody generated, such as the shared context)."""
        return int(self.metadata.get("n_tokens", 0))

    @property
    def tokens(self) -> TokenRecord | None:
        """This turn's tokens and their log-probabilities, where its speaker recorded them (a participant
        with ``record_tokens=True``: a local model's ids, or a hosted model's token texts as its provider
        reported them); None otherwise (``metadata["tokens_missing"]`` says why where they were asked
        for). Decoded from the metadata on each access: keep the result rather than asking again in a
        loop."""
        data = self.metadata.get(TOKENS_KEY)
        if isinstance(data, Mapping) and data.get("stored") == TOKENS_TABLE:
            if self.token_source is None:
                raise ConfigurationError(
                    f"turn by {self.author!r}: its token record is stored in the ledger's {TOKENS_TABLE} "
                    "table, not in this message: read the message through its run (RunReport.results[job]"
                    ".transcript, interlens export --tokens), which reads the record when asked"
                )
            data = self.token_source()
        return None if data is None else TokenRecord.from_json(data)

    def to_json(self) -> dict[str, Any]:
        return {"author": self.author, "content": self.content, "metadata": dict(self.metadata)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Message:
        if not isinstance(data, Mapping) or "author" not in data or "content" not in data:
            raise ConfigurationError(
                f"a message in JSON is an object with 'author' and 'content' (and optional 'metadata'), got "
                f"{str(data)[:200]}"
            )
        return cls(author=data["author"], content=data["content"], metadata=dict(data.get("metadata") or {}))

    def __str__(self) -> str:
        return f"{self.author}: {self.content}"


class Transcript:
    """The ordered messages of one conversation. Behaves like a list; prints as a readable dialogue."""

    __slots__ = ("_messages",)

    def __init__(self, messages: Iterable[Message] = ()) -> None:
        self._messages: list[Message] = list(messages)

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> Transcript: ...
    def __getitem__(self, index: int | slice) -> Message | Transcript:
        if isinstance(index, slice):
            return Transcript(self._messages[index])
        return self._messages[index]

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._messages)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Transcript):
            return self._messages == other._messages
        if isinstance(other, list):
            return self._messages == other
        return NotImplemented

    def append(self, message: Message) -> None:
        self._messages.append(message)

    def copy(self) -> Transcript:
        """A copy whose messages can be appended to without touching this transcript."""
        return Transcript(_copied(m) for m in self._messages)

    @property
    def tokens_generated(self) -> int:
        """Sum of ``metadata["n_tokens"]`` over the turns: counted, never re-tokenized."""
        return sum(m.n_tokens for m in self._messages)

    def to_json(self) -> list[dict[str, Any]]:
        """The messages' JSON in order; a token record's prompt ids as a difference from its speaker's
        previous turn (as the ledger stores them: :func:`from_json` makes them whole again)."""
        return compact_turns(m.to_json() for m in self._messages)

    @classmethod
    def from_json(cls, data: Iterable[Mapping[str, Any]]) -> Transcript:
        """From messages' JSON in order; token records stored as the ledger keeps them (prompt ids as a
        difference from the speaker's previous turn) come back whole."""
        return cls(Message.from_json(m) for m in expand_turns(data))

    def __repr__(self) -> str:
        return f"Transcript({len(self)} messages)"

    def __str__(self) -> str:
        return self.format()

    def format(self, *, width: int = 100) -> str:
        """The dialogue as text: one block per message, the author's name as a header."""
        blocks = []
        for m in self._messages:
            body = "\n".join(
                textwrap.fill(line, width=width, subsequent_indent="  ") if line else ""
                for line in m.content.splitlines() or [""]
            )
            blocks.append(f"[{m.author}]\n{body}")
        return "\n\n".join(blocks)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython
        printer.text(self.format())


def _copied(message: Message) -> Message:
    """A copy of ``message`` that still finds its token record."""
    copy = Message(message.author, message.content, dict(message.metadata))
    copy.token_source = message.token_source
    return copy
