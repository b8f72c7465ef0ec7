"""Small argument checks shared by constructors and run calls, each raising an error that names the argument.

Python's own failures for bad input come from deep inside (``'<' not supported between 'str' and 'int'``)
and name neither the argument nor the fix. These checks run where the user's call enters interlens. ``bool``
is an ``int`` in Python, so every int check refuses ``True``/``False`` explicitly: ``n=True`` is a typo,
never a count.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from typing import Any

from ._exceptions import ConfigurationError, ConfigurationTypeError

__all__ = [
    "check_bool",
    "check_int",
    "check_number",
    "check_text",
    "closest_name",
    "escape_controls",
    "invalid_text",
    "type_name",
]


def type_name(value: Any) -> str:
    """``'hot' (str)``: the value and its type, for messages."""
    return f"{value!r} ({type(value).__name__})"


def check_int(value: Any, *, what: str, low: int | None = None, fix: str = "") -> int:
    """``value`` as an int >= ``low``; ``what`` names the argument ("rollout(): seed")."""
    bound = f" >= {low}" if low is not None else ""
    hint = f"; {fix}" if fix else ""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigurationTypeError(f"{what} must be an int{bound}, got {type_name(value)}{hint}")
    if low is not None and value < low:
        raise ConfigurationError(f"{what} must be an int{bound}, got {value!r}{hint}")
    return value


def check_number(
    value: Any, *, what: str, low: float, high: float | None = None, open_low: bool = False, fix: str = ""
) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``open_low``)."""
    left = "(" if open_low else "["
    rule = (
        f"a number in {left}{low}, {high}]"
        if high is not None
        else f"a number {'>' if open_low else '>='} {low}"
    )
    hint = f"; {fix}" if fix else ""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigurationTypeError(f"{what} must be {rule}, got {type_name(value)}{hint}")
    number = float(value)
    in_range = (low < number if open_low else low <= number) and (high is None or number <= high)
    if not math.isfinite(number) or not in_range:
        raise ConfigurationError(f"{what} must be {rule}, got {value!r}{hint}")
    return number


def check_bool(value: Any, *, what: str, allow_none: bool = False, fix: str = "") -> bool | None:
    """``value`` as True/False (or None when ``allow_none``); a truthy string is not a bool."""
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        allowed = "True, False or None" if allow_none else "True or False"
        hint = f"; {fix}" if fix else ""
        raise ConfigurationTypeError(f"{what} must be {allowed}, got {type_name(value)}{hint}")
    return value


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known option or setting a typo most likely meant (``outdir`` -> ``out_dir``), or None: the one
    "did you mean" rule for every message that refuses an unknown name."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return close[0] if close else None


def invalid_text(text: str) -> str | None:
    """Why ``text`` cannot be stored (a lone surrogate, left by a broken decode, is no UTF-8), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"it holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not text (a "
            "broken decode leaves them); decode the source with errors='replace', or drop the character"
        )
    return None


def check_text(value: Any, *, what: str) -> None:
    """Refuse a str that cannot be stored, at the call that set it, naming it (``what``)."""
    if isinstance(value, str) and (why := invalid_text(value)) is not None:
        raise ConfigurationError(f"{what}: {why}")


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROLS_AND_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape_controls(text: object, *, breaks: bool = True) -> str:
    """``text`` safe for a terminal or a log line: control characters shown as ``\\xNN``, so user text (a
    message, a job id) cannot move the cursor or recolour the screen. ``breaks=False`` escapes newlines and
    tabs too (a name that must stay on its one line)."""
    pattern = _CONTROLS if breaks else _CONTROLS_AND_BREAKS
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))
