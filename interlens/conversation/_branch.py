"""A lineup's Conversation rebuilt from the recipe a ledger recorded (what ``RunReport.load`` branches
without the original objects), registered with ``_core.register_recipe_loader`` when this module is
imported (this package's ``__init__`` imports it; ``_core/_branch_points.py`` says why through there).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from .._core import ConfigurationError, register_recipe_loader
from ._conversation import Conversation
from ._persist import SCHEMA_VERSION, _from_payload

__all__ = ["rebuild_recipe"]


def rebuild_recipe(cls: type[Conversation], recipe: Mapping[str, Any], lineup: str) -> Conversation:
    """``recipe`` (a lineup's recorded recipe JSON) as a ``cls``. A part that JSON cannot bring back (a
    closure, a custom stop condition) is refused, naming the lineup and the fix."""
    try:
        return _from_payload(cls, {"schema": SCHEMA_VERSION, "recipe": recipe})
    except (ConfigurationError, ImportError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigurationError(
            f"lineup {lineup!r}: its recorded recipe cannot be rebuilt here ({type(exc).__name__}: {exc}); "
            f"pass the original Conversation: RunReport.load(out_dir, conversations={{{lineup!r}: conv}})"
        ) from exc


register_recipe_loader(functools.partial(rebuild_recipe, Conversation))  # for RunReport.load
