"""Running recipes many times: rollout/arollout/run/arun, their options, input fingerprints, analyzers and the
API budget.
"""

from ._analyzers import register_analyzer, register_worker_init
from ._api_budget import APIBudget
from ._options import RunOptions
from ._rollout import arollout, rollout
from ._run_lineups import arun, run

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
