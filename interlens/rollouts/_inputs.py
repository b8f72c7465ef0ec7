"""What a rollout job is asked, as a fingerprint that a rerun compares (``JobSpec.input_fp``).

A job's answer depends on its data row, its resolved prompts (the shared context, the shared system prompt,
each participant's system prompt), the turns it starts from (those of a conversation that had already run
when it was rolled out), its seed, the execution mode, and the participants' settings (models,
sampling settings) with the rest of the recipe (turns, stop conditions, analyzer), which
``Conversation.fingerprint()`` covers. The fingerprint is a small JSON object with one entry per part — a
digest for the row, the prompts and the settings, the seed and the mode as they are — so that a refused rerun
can say WHICH part changed, while the ledger stores each job's inputs only once (in its result). Digests are
sha256 over canonical JSON: the same in every process and every Python run (no ``hash()``, no ``id()``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from interlens.scheduler import JobSpec

    from ..conversation import Conversation

__all__ = ["canonical_json", "explain_change", "input_fingerprint"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PREVIEW = 160  # characters of the new row shown in a refusal


def _plain(value: Any) -> Any:
    """``value`` as plain JSON data, deterministically; see :func:`canonical_json`."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):  # iteration order follows hash randomization: sort
        return sorted((_plain(v) for v in value), key=canonical_json)
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": hashlib.sha256(value).hexdigest()}
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist):
        try:
            return _plain(tolist())
        except (TypeError, ValueError, RuntimeError):
            pass
    tobytes = getattr(value, "tobytes", None)  # PIL images
    if callable(tobytes):
        try:
            return {"$type": _type_name(value), "$bytes": hashlib.sha256(tobytes()).hexdigest()}
        except (TypeError, ValueError, RuntimeError, OSError):
            pass
    return {"$type": _type_name(value), "$repr": _ADDRESS.sub("", repr(value))}


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


# One encoder for every call: building one per json.dumps call is a good part of the cost per job.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> str:
    """One JSON text per value, the same in every process: sorted keys, no whitespace.

    Data rows may hold what JSON cannot: numpy/torch values are compared by their content (``tolist()``),
    bytes and images (``tobytes()``) by a digest of their bytes, sets sorted. Anything else falls back to its
    ``repr()`` with memory addresses (``at 0x7f...``) removed, which is stable for values whose repr shows
    their content (dates, decimals, dataclasses); an object whose repr shows only its type compares equal to
    any other object of that type.
    """
    try:
        return _ENCODER.encode(value)  # plain JSON data, the common case, in C
    except TypeError:
        return _ENCODER.encode(_plain(value))


def _digest(value: Any) -> str:
    # surrogatepass: a row holding a lone surrogate still has a fingerprint (its job fails, named); valid
    # text encodes to the same bytes either way
    return hashlib.sha256(canonical_json(value).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _start(conv: Conversation) -> list[Any]:
    """The turns an expanded conversation starts from besides the shared context: a conversation that had
    already run (``run``/``step``) rolls out from its turns, so they shape every copy's answer. None for
    the unrun recipe."""
    return [[m.author, m.content] for m in conv.transcript if not m.metadata.get("shared_context")]


def _prompts(conv: Conversation) -> list[Any]:
    """The resolved prompts of an expanded conversation: what its participants are told besides the turns."""
    context = next((m.content for m in conv.transcript if m.metadata.get("shared_context")), None)
    system = [[p.name, p.system_prompt] for p in conv.participants]
    return [context, conv.shared_system_prompt, system]


def input_fingerprint(conv: Conversation | None, *, row: Any, seed: int, mode: str, settings: str) -> str:
    """The fingerprint of one job. ``conv``: the job's expanded conversation (templates resolved for its
    row), None when its row could not be expanded (that job fails; its prompts are not known). ``settings``:
    the lineup's ``Conversation.fingerprint()`` (participants' settings and the rest of the recipe)."""
    parts = {
        "mode": mode,
        "prompts": None if conv is None else _digest(_prompts(conv)),
        "row": None if row is None else _digest(row),
        "seed": seed,
        "settings": settings,
    }
    start = [] if conv is None else _start(conv)
    if start:  # only then: a recipe's fingerprint stays what it was before this part existed
        parts["start"] = _digest(start)
    return _ENCODER.encode(parts)


def explain_change(spec: JobSpec, recorded: str) -> list[str]:
    """How what ``spec`` is asked now differs from the ``recorded`` fingerprint, part by part."""
    try:
        old = json.loads(recorded)
        new = json.loads(spec.input_fp or "{}")
    except ValueError:
        return []
    if not isinstance(old, dict) or not isinstance(new, dict):
        return []
    lines = []
    if old.get("row") != new.get("row"):
        row = getattr(getattr(spec.job, "conversation", None), "row", None)
        lines.append("row content changed" + (f": now {_preview(row)}" if row is not None else ""))
    elif old.get("prompts") != new.get("prompts"):  # with the row unchanged: a template resolved otherwise
        lines.append("resolved prompts changed (shared context, shared system prompt or a system prompt)")
    if old.get("start") != new.get("start"):
        lines.append(
            "the turns the conversation started from changed (a branch starts from its parent's recorded "
            "turns: the ledger it was branched from changed since this out_dir's branches ran; a "
            "conv.upto(k) from its turns; the recipe that has not run, from the shared context)"
        )
    for part in ("seed", "mode"):
        if old.get(part) != new.get(part):
            lines.append(f"{part}: {old.get(part)} → {new.get(part)}")
    if old.get("settings") != new.get("settings"):
        lines.append("participant settings or recipe changed (model, sampling, turns, stop conditions)")
    return lines


def _preview(row: Any) -> str:
    text = repr(row)
    return text if len(text) <= _PREVIEW else text[: _PREVIEW - 3] + "..."
