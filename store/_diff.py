"""What differs between two recipe summaries, for the fingerprint-mismatch error.

A fingerprint says *that* a recipe changed; the user needs to see *what* changed to decide between "oops,
revert that" and "yes, start over". The summaries are the JSON ``describe`` each lineup records.
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe_diff", "mismatch_line"]

_ABSENT = object()


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}[{i}]", out)
    else:
        out[prefix or "(value)"] = value


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe_diff(old: Any, new: Any, *, limit: int = 20) -> list[str]:
    """Lines ``path: old → new`` for every leaf that differs (at most ``limit``, then a count)."""
    flat_old: dict[str, Any] = {}
    flat_new: dict[str, Any] = {}
    _flatten(old, "", flat_old)
    _flatten(new, "", flat_new)
    keys = list(flat_old) + [k for k in flat_new if k not in flat_old]
    lines = [
        f"{key}: {_show(flat_old.get(key, _ABSENT))} → {_show(flat_new.get(key, _ABSENT))}"
        for key in keys
        if flat_old.get(key, _ABSENT) != flat_new.get(key, _ABSENT)
    ]
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more differences"]
    return lines


def mismatch_line(name: str, old_fp: str, new_fp: str, old_desc: Any, new_desc: Any) -> str:
    """One lineup's paragraph of the FingerprintMismatchError message."""
    head = f"- lineup {name!r}: recorded fingerprint {old_fp!r}, this run's {new_fp!r}."
    if not old_desc or not new_desc:
        return head + " (No recipe summary on both sides to show what differs.)"
    lines = describe_diff(old_desc, new_desc)
    if not lines:
        return head + " (The recipe summaries are identical; the difference is in what they do not show.)"
    return head + " What differs (recorded → now):\n" + "\n".join(f"    {line}" for line in lines)
