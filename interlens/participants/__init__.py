"""Who speaks: the participant base, the scripted participant, local model participants and API
participants.
"""

from ._api_participant import APIParticipant
from ._model_participant import AutoModelParticipant, ModelParticipant
from ._participant import Participant, ScriptedParticipant, participant_from_json

__all__ = [
    "APIParticipant",
    "AutoModelParticipant",
    "ModelParticipant",
    "Participant",
    "ScriptedParticipant",
    "participant_from_json",
]
