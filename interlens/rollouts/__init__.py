"""Running recipes many times: rollout/arollout/run/arun, their options, input fingerprints, analyzers and the
API budget.

The face is lazy (PEP 562): a name loads its module on first use and is kept here. ``Conversation.rollout``
imports ``rollouts._rollout``, and this ``__init__`` runs first: were it to import ``_run_lineups`` (``run``,
``arun``, which check that they were given Conversations), the facade would import ``conversation`` back.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from ._analyzers import register_analyzer, register_worker_init
    from ._api_budget import APIBudget
    from ._options import RunOptions
    from ._rollout import arollout, rollout
    from ._run_lineups import arun, run

#: Each exported name -> the private module that defines it.
_EXPORTS: dict[str, str] = {
    "register_analyzer": "._analyzers",
    "register_worker_init": "._analyzers",
    "APIBudget": "._api_budget",
    "RunOptions": "._options",
    "arollout": "._rollout",
    "rollout": "._rollout",
    "arun": "._run_lineups",
    "run": "._run_lineups",
}

__all__ = [
    "APIBudget",
    "RunOptions",
    "arollout",
    "arun",
    "register_analyzer",
    "register_worker_init",
    "rollout",
    "run",
]


def __getattr__(name: str) -> typing.Any:
    """Load an exported name from its module on first use and keep it here (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
