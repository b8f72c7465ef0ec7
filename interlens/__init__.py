"""interlens: run one multi-agent conversation recipe many times.

A :class:`Conversation` is the recipe, the live dialogue and the rollout driver in one object::

    conv = Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(6)
    report = conv.rollout(n=64, out_dir="runs/tabs_spaces")

Importing interlens is cheap: torch, transformers, datasets and the provider SDKs load on first use.
"""

from interlens.scheduler import BatchPolicy, ExecutionMode, RetryPolicy, available_devices, worker_device

from ._analyzers import register_analyzer, register_worker_init
from ._api_participant import APIParticipant
from ._budget import APIBudget
from ._capture import ActivationCache, ActivationRecord
from ._conversation import Conversation
from ._exceptions import (
    AnalyzerError,
    ConfigurationError,
    ConfigurationTypeError,
    DeviceError,
    FingerprintMismatchError,
    GenerationError,
    InterlensError,
    InterpModeError,
    LedgerCorruptError,
    LedgerError,
    LedgerLockedError,
    LedgerSchemaError,
    MissingColumnError,
    ModelLoadError,
    SchemaVersionError,
    TemplateError,
    UnknownAnalyzerError,
    UnknownParticipantError,
    UnrunConversationError,
    WorkerStartError,
)
from ._message import Message, Transcript
from ._model_participant import AutoModelParticipant, ModelParticipant
from ._participant import Participant, ScriptedParticipant, View
from ._probes import Probe
from ._report import RunReport, RunResult
from ._run import arun, run
from ._scoring import Logprobs
from ._steering import SteeringSpec
from ._stop import MaxTurns, StopCondition, StopStrings, TokenBudget
from ._templating import dataset_field

__version__ = "0.1.0"

__all__ = [
    "APIBudget",
    "APIParticipant",
    "ActivationCache",
    "ActivationRecord",
    "AnalyzerError",
    "AutoModelParticipant",
    "BatchPolicy",
    "ConfigurationError",
    "ConfigurationTypeError",
    "Conversation",
    "DeviceError",
    "ExecutionMode",
    "FingerprintMismatchError",
    "GenerationError",
    "InterlensError",
    "InterpModeError",
    "LedgerCorruptError",
    "LedgerError",
    "LedgerLockedError",
    "LedgerSchemaError",
    "Logprobs",
    "MaxTurns",
    "Message",
    "MissingColumnError",
    "ModelLoadError",
    "ModelParticipant",
    "Participant",
    "Probe",
    "RetryPolicy",
    "RunReport",
    "RunResult",
    "SchemaVersionError",
    "ScriptedParticipant",
    "SteeringSpec",
    "StopCondition",
    "StopStrings",
    "TemplateError",
    "TokenBudget",
    "Transcript",
    "UnknownAnalyzerError",
    "UnknownParticipantError",
    "UnrunConversationError",
    "View",
    "WorkerStartError",
    "arun",
    "available_devices",
    "dataset_field",
    "register_analyzer",
    "register_worker_init",
    "run",
    "worker_device",
]
