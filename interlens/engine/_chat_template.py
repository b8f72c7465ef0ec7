"""Render a speaker's view with the model family's own chat template.

Templates differ in what they accept: Gemma rejects a system role and insists on strict user/assistant
alternation, Qwen and Llama accept both. Rather than keep a hand-written table per family, we PROBE the
tokenizer's template once (render tiny conversations and see what raises or drops text) and fold the view to
what it accepts: the system block into the first user message, consecutive same-role messages merged, a
placeholder user turn before a leading assistant turn.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from .._core import View

__all__ = ["TemplateCaps", "probe_template", "render_view"]

_PROBE_LOCK = threading.Lock()
# Per tokenizer OBJECT, weakly (an id() key outlives its object: a new tokenizer at a reused address would
# inherit the old one's capabilities), with the template the capabilities were probed from.
_CAPS: weakref.WeakKeyDictionary[Any, tuple[Any, TemplateCaps]] = weakref.WeakKeyDictionary()
# Tokenizers that cannot be weakly referenced or hashed: keyed by their template text instead.
_CAPS_BY_TEMPLATE: dict[str, TemplateCaps] = {}


@dataclass(frozen=True)
class TemplateCaps:
    has_template: bool
    system_role: bool
    consecutive_roles: bool
    leading_assistant: bool


def _renders(tokenizer: Any, messages: list[dict[str, str]], *, must_contain: str | None = None) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # jinja's TemplateError, or raise_exception() inside the template
        return False
    return must_contain is None or must_contain in text


def probe_template(tokenizer: Any) -> TemplateCaps:
    """What this tokenizer's chat template accepts (cached per tokenizer object and template)."""
    template = getattr(tokenizer, "chat_template", None) or None
    with _PROBE_LOCK:
        try:
            cached = _CAPS.get(tokenizer)
        except TypeError:  # not weakly referenceable, or unhashable
            key = repr(template)
            caps = _CAPS_BY_TEMPLATE.get(key)
            if caps is None:
                caps = _CAPS_BY_TEMPLATE[key] = _probe(tokenizer, template)
            return caps
        if cached is not None and cached[0] == template:
            return cached[1]
        caps = _probe(tokenizer, template)  # first sight, or the user assigned a new chat_template
        _CAPS[tokenizer] = (template, caps)
        return caps


def _probe(tokenizer: Any, template: Any) -> TemplateCaps:
    if template is None:
        return TemplateCaps(False, False, False, False)
    return TemplateCaps(
        has_template=True,
        system_role=_renders(
            tokenizer,
            [{"role": "system", "content": "SYSPROBE"}, {"role": "user", "content": "hi"}],
            must_contain="SYSPROBE",
        ),
        consecutive_roles=_renders(
            tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        ),
        leading_assistant=_renders(
            tokenizer, [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
        ),
    )


def fold_messages(view: View, caps: TemplateCaps) -> list[dict[str, str]]:
    """The view as chat messages, folded to what the template accepts."""
    messages = [{"role": m.role, "content": m.content} for m in view.messages]
    system = view.system
    if system and not caps.system_role:
        if messages and messages[0]["role"] == "user":
            messages[0] = {"role": "user", "content": f"{system}\n\n{messages[0]['content']}"}
        else:
            messages.insert(0, {"role": "user", "content": system})
        system = None
    if not caps.consecutive_roles:
        merged: list[dict[str, str]] = []
        for m in messages:
            if merged and merged[-1]["role"] == m["role"]:
                merged[-1] = {"role": m["role"], "content": f"{merged[-1]['content']}\n\n{m['content']}"}
            else:
                merged.append(m)
        messages = merged
    if messages and messages[0]["role"] == "assistant" and not caps.leading_assistant:
        messages.insert(0, {"role": "user", "content": ""})
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def render_view(tokenizer: Any, view: View) -> str:
    """The prompt text for ``view``, ending with the template's generation prompt."""
    caps = probe_template(tokenizer)
    messages = fold_messages(view, caps)
    if not caps.has_template:  # a base model: a plain transcript with a cue for the speaker
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text)
