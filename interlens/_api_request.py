"""Provider requests and results as plain data: what crosses from a job to the API gateway and back.

A request is built from the speaker's :class:`View` in the job (wherever it runs) and carries no secret, so
it pickles across a worker pipe; the gateway in the parent turns it into the provider's JSON body. Results
come back as :class:`APIResult`, equally plain.

Anthropic insists on alternating user/assistant messages that start with the user and are never empty;
OpenAI and OpenRouter accept any order. The view is folded to what the provider accepts, the same way the
local chat-template path folds it (``_chat_template.fold_messages``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._participant import View

__all__ = ["CONTINUE_TURN", "OPENING_TURN", "APIRequest", "APIResult", "ProviderResponseError", "fold_view"]

OPENING_TURN = "Begin."
"""The user message put first when a view has none (Anthropic needs one; an empty chat is refused)."""

CONTINUE_TURN = "Continue."
"""The user message after a trailing own turn on Anthropic, which would otherwise *continue* that turn."""

Messages = tuple[tuple[str, str], ...]  # (role, content)


def fold_view(view: View, provider: str) -> Messages:
    """The view's messages as (role, content) pairs the provider accepts (the system block goes apart)."""
    messages = [(m.role, m.content) for m in view.messages]
    if provider != "anthropic":
        return tuple(messages) or (("user", OPENING_TURN),)
    merged: list[tuple[str, str]] = []
    for role, content in messages:
        if not content.strip():  # Anthropic refuses empty text blocks; an empty turn says nothing anyway
            continue
        if merged and merged[-1][0] == role:
            merged[-1] = (role, f"{merged[-1][1]}\n\n{content}")
        else:
            merged.append((role, content))
    if not merged or merged[0][0] == "assistant":
        merged.insert(0, ("user", OPENING_TURN))
    if merged[-1][0] == "assistant":
        merged.append(("user", CONTINUE_TURN))
    return tuple(merged)


@dataclass(frozen=True, slots=True)
class APIRequest:
    """One turn for a hosted model: everything but the key and the endpoint (those live in the parent)."""

    provider: str
    model: str
    system: str | None
    messages: Messages
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    timeout: float = 120.0
    turn: int | None = None  # the conversation's turn index (None: an ephemeral sample); the batch map key

    def body(self) -> dict[str, Any]:
        """The provider's JSON request body (chat completions, or Anthropic messages)."""
        messages = [{"role": role, "content": content} for role, content in self.messages]
        if self.provider == "anthropic":
            body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "messages": messages}
            if self.system:
                body["system"] = self.system
            if self.stop:
                body["stop_sequences"] = list(self.stop)
        else:
            if self.system:
                messages.insert(0, {"role": "system", "content": self.system})
            body = {"model": self.model, "messages": messages}
            # OpenAI deprecated max_tokens for chat (reasoning models refuse it); OpenRouter still uses it.
            body["max_tokens" if self.provider == "openrouter" else "max_completion_tokens"] = self.max_tokens
            if self.stop:
                body["stop"] = list(self.stop)
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        return body


@dataclass(frozen=True, slots=True)
class APIResult:
    """A provider's answer to one request, normalized across providers."""

    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    output_tokens: int | None
    model: str | None = None
    request_id: str | None = None
    batch_id: str | None = None


class ProviderResponseError(Exception):
    """A response that is an error although its HTTP status is not (OpenRouter's 200-with-error), or one that
    cannot be read. ``retryable``/``rate_limited`` follow the status code it carries."""

    def __init__(self, message: str, retryable: bool = False, rate_limited: bool = False) -> None:
        super().__init__(message, retryable, rate_limited)  # all in args: pickles across a worker pipe

    @property
    def retryable(self) -> bool:
        return bool(self.args[1])

    @property
    def rate_limited(self) -> bool:
        return bool(self.args[2])

    def __str__(self) -> str:
        return str(self.args[0])
