"""Request validation of the fake provider: what the real APIs refuse with a 400, refused here the same way.

interlens builds its request bodies itself and posts them through the SDKs' generic ``post``, so no SDK type
checks them: this server is what tells a test that a body would be refused by the provider. It checks the
top-level parameters (unknown ones, types, ranges) and the messages, per wire format:

- OpenAI chat completions: unknown parameters are refused ("Unrecognized request argument supplied").
  OpenRouter takes any extra parameter (its own routing options, other vendors' sampling knobs) and ignores
  what a model does not support, so only the parameters it shares with OpenAI are checked there.
- Anthropic messages, per ``anthropic-version``: every parameter not in the API is an "Extra input". Version
  ``2026-10-21`` (sent by the 2.x SDKs) removed ``temperature``/``top_p``/``top_k``: sending one, even at its
  default, is a 400; ``2023-06-01`` (the 1.x SDKs) still takes them, ``temperature`` in [0, 1].

Messages are worded like the providers' own, so a test can tell what it would see in production.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["ANTHROPIC_VERSIONS", "validate_chat", "validate_message"]

_OPENAI_PARAMS: Final = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "moderation",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)
_OPENAI_ROLES: Final = ("system", "developer", "user", "assistant", "tool", "function")

_ANTHROPIC_PARAMS: Final = frozenset(
    {
        "cache_control",
        "container",
        "context_management",
        "diagnostics",
        "inference_geo",
        "max_tokens",
        "mcp_servers",
        "messages",
        "metadata",
        "model",
        "output_config",
        "service_tier",
        "speed",
        "stop_sequences",
        "stream",
        "system",
        "thinking",
        "tool_choice",
        "tools",
    }
)
_ANTHROPIC_SAMPLING: Final = frozenset({"temperature", "top_p", "top_k"})
#: The ``anthropic-version`` values the API knows, and whether each still takes the sampling parameters.
ANTHROPIC_VERSIONS: Final = {"2023-06-01": True, "2026-10-21": False}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------- OpenAI


def _openai_number(body: dict[str, Any], name: str, low: float, high: float) -> str | None:
    value = body.get(name)
    if value is None or name not in body:
        return None
    if not _is_number(value):
        return f"Invalid type for '{name}': expected a decimal, but got {type(value).__name__} instead."
    if value < low:
        return f"Invalid '{name}': decimal below minimum value. Expected a value >= {low}, but got {value}."
    if value > high:
        return f"Invalid '{name}': decimal above maximum value. Expected a value <= {high}, but got {value}."
    return None


def _openai_int(body: dict[str, Any], name: str, low: int) -> str | None:
    if name not in body or body[name] is None:
        return None
    value = body[name]
    if not _is_int(value):
        return f"Invalid type for '{name}': expected an integer, but got {type(value).__name__} instead."
    if value < low:
        return f"Invalid '{name}': integer below minimum value. Expected a value >= {low}, but got {value}."
    return None


def _openai_message(i: int, msg: Any) -> str | None:
    if not isinstance(msg, dict):
        return f"Invalid type for 'messages[{i}]': expected an object, but got {type(msg).__name__} instead."
    role = msg.get("role")
    if role not in _OPENAI_ROLES:
        supported = ", ".join(f"'{r}'" for r in _OPENAI_ROLES)
        return f"Invalid value: {role!r}. Supported values are: {supported}. (param: messages[{i}].role)"
    content = msg.get("content")
    if content is None:
        if role == "assistant" and (msg.get("tool_calls") or msg.get("function_call")):
            return None
        return f"Missing required parameter: 'messages[{i}].content'."
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not all(isinstance(p, dict) and "type" in p for p in content):
        return (
            f"Invalid type for 'messages[{i}].content': expected one of a string or an array of content "
            "parts (objects with a 'type')."
        )
    return None


def validate_chat(body: Any, *, strict: bool = True) -> str | None:
    """Why a chat-completions body would be refused, or None. ``strict``: unknown parameters are refused
    (OpenAI); without it only the parameters OpenAI defines are checked (OpenRouter takes any other)."""
    if not isinstance(body, dict):
        return "We could not parse the JSON body of your request: expected a JSON object."
    if strict:
        unknown = sorted(set(body) - _OPENAI_PARAMS)
        if unknown:
            return f"Unrecognized request argument supplied: {unknown[0]}"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "you must provide a model parameter (a non-empty string)"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "Missing required parameter: 'messages'."
    if not messages:
        return "Invalid 'messages': empty array. Expected an array with minimum length 1."
    for i, msg in enumerate(messages):
        problem = _openai_message(i, msg)
        if problem is not None:
            return problem
    checks = (
        _openai_number(body, "temperature", 0, 2),
        _openai_number(body, "top_p", 0, 1),
        _openai_number(body, "frequency_penalty", -2, 2),
        _openai_number(body, "presence_penalty", -2, 2),
        _openai_int(body, "max_completion_tokens", 1),
        _openai_int(body, "max_tokens", 1),
        _openai_int(body, "n", 1),
        _openai_int(body, "seed", -(2**63)),
    )
    for problem in checks:
        if problem is not None:
            return problem
    if "logprobs" in body and not isinstance(body["logprobs"], bool | None):
        return "Invalid type for 'logprobs': expected a boolean, but got a value of another type instead."
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            return f"Invalid 'top_logprobs': expected an integer between 0 and 20, got {top!r}."
        if body.get("logprobs") is not True:
            return (
                "Invalid value for 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is set."
            )
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            return "Invalid type for 'stop': expected one of a string or an array of strings."
        if len(stop) > 4:
            return (
                "Invalid 'stop': array too long. Expected an array with maximum length 4, but got an array "
                f"with length {len(stop)} instead."
            )
    if body.get("stream"):
        return "stream=true is not supported by FakeProviderServer; call without streaming"
    return None


# ---------------------------------------------------------------------------------------------- Anthropic


def _anthropic_text(where: str, text: Any) -> str | None:
    if not isinstance(text, str):
        return f"{where}: Input should be a valid string"
    if not text:
        return f"{where}: text content blocks must be non-empty"
    if not text.strip():
        return f"{where}: text content blocks must contain non-whitespace text"
    return None


_CACHE_TTLS: Final = ("5m", "1h")
_MAX_BREAKPOINTS: Final = 4


def _cache_control(where: str, block: dict[str, Any]) -> str | None:
    """A block's ``cache_control``: ``{"type": "ephemeral"}``, optionally with a ``ttl`` of 5m or 1h."""
    marker = block.get("cache_control")
    if marker is None:
        return None
    if not isinstance(marker, dict) or marker.get("type") != "ephemeral":
        return f"{where}.cache_control.type: Input should be 'ephemeral'"
    extra = sorted(set(marker) - {"type", "ttl"})
    if extra:
        return f"{where}.cache_control.{extra[0]}: Extra inputs are not permitted"
    if "ttl" in marker and marker["ttl"] not in _CACHE_TTLS:
        return f"{where}.cache_control.ttl: Input should be '5m' or '1h'"
    return None


def _breakpoints(body: dict[str, Any]) -> int:
    blocks = [b for b in body["system"]] if isinstance(body.get("system"), list) else []
    for msg in body["messages"]:
        if isinstance(msg.get("content"), list):
            blocks.extend(msg["content"])
    return sum(1 for b in blocks if isinstance(b, dict) and "cache_control" in b)


def _anthropic_content(i: int, content: Any, *, final_assistant: bool) -> str | None:
    if isinstance(content, str):
        if not content and final_assistant:
            return None
        if not content.strip():
            return (
                f"messages.{i}: all messages must have non-empty content except for the optional final "
                "assistant message"
            )
        return None
    if not isinstance(content, list):
        return f"messages.{i}.content: Input should be a valid string or a list of content blocks"
    if not content and not final_assistant:
        return (
            f"messages.{i}: all messages must have non-empty content except for the optional final "
            "assistant message"
        )
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            return f"messages.{i}.content.{j}: Input should be an object with a 'type'"
        if block["type"] == "text":
            problem = _anthropic_text(f"messages.{i}.content.{j}.text", block.get("text"))
            if problem is not None:
                return problem
        problem = _cache_control(f"messages.{i}.content.{j}", block)
        if problem is not None:
            return problem
    return None


def _anthropic_system(system: Any) -> str | None:
    if isinstance(system, str):
        return None
    if not isinstance(system, list):
        return "system: Input should be a valid string or a list of text blocks"
    for j, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            return f"system.{j}.type: Input should be 'text'"
        problem = _anthropic_text(f"system.{j}.text", block.get("text")) or _cache_control(
            f"system.{j}", block
        )
        if problem is not None:
            return problem
    return None


def _anthropic_sampling(body: dict[str, Any]) -> str | None:
    for name, high in (("temperature", 1.0), ("top_p", 1.0)):
        if name in body:
            value = body[name]
            if not _is_number(value):
                return f"{name}: Input should be a valid number"
            if not 0 <= value <= high:
                return f"{name}: range: 0..{high:g}"
    if "top_k" in body and (not _is_int(body["top_k"]) or body["top_k"] < 0):
        return "top_k: Input should be a valid integer greater than or equal to 0"
    return None


def validate_message(body: Any, *, version: str | None = "2026-10-21") -> str | None:
    """Why Anthropic would refuse a messages body sent with ``anthropic-version: version``, or None."""
    if version is None:
        return "anthropic-version: header is required"
    if version not in ANTHROPIC_VERSIONS:
        known = ", ".join(ANTHROPIC_VERSIONS)
        return f"anthropic-version: {version!r} is not a valid version (known: {known})"
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    allowed = _ANTHROPIC_PARAMS | (_ANTHROPIC_SAMPLING if ANTHROPIC_VERSIONS[version] else frozenset())
    for name in body:
        if name not in allowed:
            return f"{name}: Extra inputs are not permitted"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: Field required (a non-empty string)"
    max_tokens, low = body.get("max_tokens"), 1 if ANTHROPIC_VERSIONS[version] else 0  # 0: pre-warm a cache
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < low:
        return f"max_tokens: Field required (an integer >= {low})"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: Field required (a non-empty list of {role, content} objects)"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        if "content" not in msg:
            return f"messages.{i}.content: Field required"
        final_assistant = i == len(messages) - 1 and msg["role"] == "assistant"
        problem = _anthropic_content(i, msg["content"], final_assistant=final_assistant)
        if problem is not None:
            return problem
    if "system" in body:
        problem = _anthropic_system(body["system"])
        if problem is not None:
            return problem
    marked = _breakpoints(body)
    if marked > _MAX_BREAKPOINTS:
        return f"A maximum of {_MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {marked}."
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            return "stop_sequences: Input should be a valid list of strings"
        if any(not s.strip() for s in stops):
            return "stop_sequences: each stop sequence must contain non-whitespace characters"
    problem = _anthropic_sampling(body)
    if problem is not None:
        return problem
    if body.get("stream"):
        return "stream=true is not supported by FakeProviderServer; call without streaming"
    return None
