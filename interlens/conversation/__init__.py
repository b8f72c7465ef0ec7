"""The Conversation: the immutable recipe, the live transcript and turn loop, persistence and the
conversation-level interp calls; ``rebuild_recipe``, a lineup's recorded recipe as a Conversation again
(importing it registers it for ``RunReport.load``).
"""

from ._branch import rebuild_recipe
from ._conversation import Conversation

__all__ = [
    "Conversation",
    "rebuild_recipe",
]
