"""The Conversation: the immutable recipe, the live transcript and turn loop, persistence and the
conversation-level interp calls.
"""

import functools

from .._core import register_recipe_loader
from ._branch import rebuild_recipe
from ._conversation import Conversation

register_recipe_loader(functools.partial(rebuild_recipe, Conversation))  # for RunReport.load's branches

__all__ = [
    "Conversation",
]
