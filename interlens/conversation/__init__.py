"""The Conversation: the immutable recipe, the live transcript and turn loop, persistence and the
conversation-level interp calls.
"""

from ._conversation import Conversation

__all__ = [
    "Conversation",
]
