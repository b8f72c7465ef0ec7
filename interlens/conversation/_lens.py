"""The conversation-level half of interp: scoring a text in a speaker's view, and re-reading a transcript's
turns through the models that spoke them.

Both are teacher-forced forward passes (nothing sampled), sent the way a turn is: live straight to the
participant's engine, inside a rollout job through the job's batcher, so the tensors stay where the model
is (the worker) and only what an analyzer returns travels. Capture itself is opened by
``Conversation.capture``; what a turn records is decided in ``ModelParticipant`` and done by the engine's
hooks (``_hooks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core import MODERATOR, ConfigurationError, GenerationOptions, InterpModeError
from ..interp import ActivationCache, CaptureSpec, CaptureTarget, steering_from
from ..participants import Participant

if TYPE_CHECKING:
    from ..interp import Logprobs
    from ._conversation import Conversation

__all__ = ["score_text", "turn_activations"]


def _scorer(participant: Participant, what: str) -> Any:
    ascore = getattr(participant, "ascore", None)
    if ascore is None:
        raise InterpModeError(
            f"{what}: {participant.name!r} is a {type(participant).__name__}, which has no local model to "
            "score with; logprobs and activations need a local participant "
            "(AutoModelParticipant.from_pretrained(...))"
        )
    return ascore


async def score_text(conv: Conversation, speaker: str, text: str, *, steering: Any = None) -> Logprobs:
    """``conv.logprobs``: score ``text`` as ``speaker``'s next message after its current view."""
    where = f"logprobs({speaker!r}, ...)"
    if not isinstance(text, str) or not text:
        raise ConfigurationError(
            f"{where}: text must be a non-empty str (the continuation to score), got {text!r}"
        )
    participant = conv.participant(speaker)
    ascore = _scorer(participant, where)
    options = GenerationOptions(
        capture=conv._capture_target("score"),
        steering=None if steering is None else steering_from(steering, where=where),
    )
    result: Logprobs = await ascore(conv.view(participant), text, options)
    return result


async def turn_activations(conv: Conversation, speaker: str | None, spec: CaptureSpec) -> ActivationCache:
    """``conv.turn_activations``: one teacher-forced pass per turn, recorded as ``kind="turn"``."""
    cache = ActivationCache(spec)
    where = f"turn_activations(speaker={speaker!r})"
    if speaker is not None:
        _scorer(conv.participant(speaker), where)
    for index, message in enumerate(conv.transcript):
        if message.author == MODERATOR or (speaker is not None and message.author != speaker):
            continue
        participant = conv.participant(message.author)
        ascore = getattr(participant, "ascore", None)
        if ascore is None or not message.content:
            continue  # scripted and hosted turns have no activations; an empty turn has no tokens
        options = GenerationOptions(capture=CaptureTarget(cache, index, "turn"))
        await ascore(conv.view(participant, upto=index), message.content, options)
    return cache
