"""interlens: run one multi-agent conversation recipe many times.

A :class:`Conversation` is the recipe, the live dialogue and the rollout driver in one object::

    conv = Conversation(participants=[a, b], shared_context="Debate: tabs vs spaces.").turns(6)
    report = conv.rollout(n=64, out_dir="runs/tabs_spaces")

Importing interlens is cheap: torch, transformers, datasets and the provider SDKs load on first use.
"""

from interlens.scheduler import BatchPolicy, ExecutionMode, RetryPolicy, available_devices, worker_device

from ._core import (
    AnalyzerError,
    BranchError,
    ConfigurationError,
    ConfigurationTypeError,
    DataSourceError,
    DeviceError,
    FingerprintMismatchError,
    GenerationError,
    InterlensError,
    InterpModeError,
    LedgerCorruptError,
    LedgerError,
    LedgerLockedError,
    LedgerSchemaError,
    MaxTurns,
    Message,
    MissingColumnError,
    ModelLoadError,
    SchemaVersionError,
    StopCondition,
    StopStrings,
    TemplateError,
    TokenBudget,
    TokenRecord,
    Transcript,
    UnknownAnalyzerError,
    UnknownParticipantError,
    UnrunConversationError,
    View,
    WorkerStartError,
    dataset_field,
)
from .conversation import Conversation
from .interp import ActivationCache, ActivationRecord, Logprobs, Probe, SteeringSpec
from .participants import (
    APIParticipant,
    AutoModelParticipant,
    ModelParticipant,
    Participant,
    ScriptedParticipant,
)
from .report import RunReport, RunResult
from .rollouts import APIBudget, arun, register_analyzer, register_worker_init, run

__version__ = "0.1.0"

__all__ = [
    "APIBudget",
    "APIParticipant",
    "ActivationCache",
    "ActivationRecord",
    "AnalyzerError",
    "AutoModelParticipant",
    "BatchPolicy",
    "BranchError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "Conversation",
    "DataSourceError",
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
    "TokenRecord",
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
