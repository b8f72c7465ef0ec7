"""JSON encoding for everything the ledger stores, with a guard against storing credentials.

JSON and never pickle, so that opening a run directory cannot execute code. ``json.dumps`` runs with no
``default=``: a value that is not plain JSON fails in the caller's task, before anything is queued, with an
error naming the job and the field, rather than being silently stringified.

The secret guard (``_secrets``) is the last line of the "no key in the ledger" promise: the values of
credential-looking environment variables are collected when the ledger opens, and any payload containing
one is refused with an error naming the variable, never its value. A leaked key in a transcript or a batch's
metadata therefore fails one write loudly instead of landing on disk.
"""

from __future__ import annotations

import json
from typing import Any

from ._secrets import SecretGuard

__all__ = ["SecretGuard", "dumps"]


def dumps(value: Any, *, what: str, guard: SecretGuard) -> str:
    """Encode ``value`` as JSON, or raise a TypeError/ValueError naming ``what`` ("the analysis of job x")."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except TypeError as exc:
        raise TypeError(
            f"{what} is not JSON-serializable ({exc}). The ledger stores JSON only, never pickle: use dicts, "
            f"lists, str, int, float, bool and None (convert numpy values with .item()/.tolist())."
        ) from exc
    except ValueError as exc:
        if "Out of range float" in str(exc):  # NaN/Infinity: not JSON, strict readers reject the file
            raise ValueError(
                f"{what} is not JSON: it contains NaN or Infinity, which JSON cannot represent. Store None "
                f"(or a string such as 'nan') where there is no number."
            ) from exc
        raise ValueError(f"{what} cannot be stored as JSON ({exc}).") from exc  # a circular reference
    guard.check(text, what=what)
    return text
