"""Every error interlens raises on purpose, in one place.

The hierarchy::

    InterlensError                      base of everything below; catch this to catch us
    ├── ConfigurationError              bad input to a constructor, modifier or run call (a ValueError)
    │   ├── ConfigurationTypeError      a value of the wrong type, or an unknown option (also a TypeError)
    │   ├── TemplateError               a template cannot be resolved for a row
    │   │   └── MissingColumnError      dataset_field("col") names a column the row lacks
    │   ├── UnknownParticipantError     a speaker name that is not in the conversation
    │   ├── UnknownAnalyzerError        .analyzer("name") that nobody registered
    │   ├── InterpModeError             capture/steering where it cannot run (batched path, hosted API)
    │   ├── BranchError                 a branch point that cannot be taken (a turn past a job's end, a job
    │   │                               that failed before it or does not exist, a ledger of another recipe)
    │   └── DeviceError                 a device string that does not exist here
    ├── DataSourceError                 reading the rows given to .data() failed mid-stream (row named)
    ├── UnrunConversationError          sample() on a recipe that has not generated a turn
    ├── SchemaVersionError              a saved conversation written by a newer interlens
    ├── GenerationError                 a participant failed to produce a turn
    │   └── ModelLoadError              weights or tokenizer could not be loaded
    ├── AnalyzerError                   an analyzer raised or returned something not JSON-serializable
    ├── WorkerStartError                a worker process could not start (a device, an import, an init hook)
    └── LedgerError                     the run ledger (``out_dir/ledger.sqlite``) refused an operation
        ├── LedgerLockedError           another live process is writing the same out_dir
        ├── FingerprintMismatchError    a rerun's recipe differs from the one that produced the ledger
        ├── LedgerSchemaError           the ledger was written by a newer interlens
        └── LedgerCorruptError          the file is not a readable SQLite ledger (left untouched)

Errors from the ledger (``interlens.store``) and the engine (``interlens.scheduler``) are raised there as
their own classes, because those packages import nothing from interlens; at the boundary, inside
``with as_interlens_errors():``, they leave as the classes above (a scheduler configuration error becomes a
``ConfigurationError``; :func:`translate` maps one error), and
the classes above also inherit from the foreign ones where they correspond, so
``except interlens.store.LedgerLockedError`` keeps working on a translated error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# The packages' public faces export their errors. The faces are lazy, and the classes used below come from
# import-free error modules (scheduler/_errors.py, store/_errors.py): this floor loads nothing else of them.
import interlens.scheduler as _scheduler_errors
import interlens.store as _store_errors

__all__ = [
    "AnalyzerError",
    "BranchError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "DataSourceError",
    "DeviceError",
    "FingerprintMismatchError",
    "GenerationError",
    "InterlensError",
    "InterpModeError",
    "LedgerCorruptError",
    "LedgerError",
    "LedgerLockedError",
    "LedgerSchemaError",
    "MissingColumnError",
    "ModelLoadError",
    "SchemaVersionError",
    "TemplateError",
    "UnknownAnalyzerError",
    "UnknownParticipantError",
    "UnrunConversationError",
    "WorkerStartError",
]


class InterlensError(Exception):
    """Base class of every error interlens raises on purpose."""


class ConfigurationError(InterlensError, ValueError):
    """Bad input to a constructor, modifier or run call; raised before any work starts."""


class ConfigurationTypeError(ConfigurationError, TypeError):
    """A configuration value of the wrong type, or a keyword option that does not exist.

    Also a ``TypeError``, which is what Python raises for a wrong argument type or an unexpected keyword.
    """


class TemplateError(ConfigurationError):
    """A template value cannot be resolved for a data row."""


class MissingColumnError(TemplateError, KeyError):
    """``dataset_field("col")`` names a column that the row does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownParticipantError(ConfigurationError, KeyError):
    """A speaker name that is not one of the conversation's participants."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownAnalyzerError(ConfigurationError, KeyError):
    """``.analyzer("name")`` with a name nobody registered with ``register_analyzer``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InterpModeError(ConfigurationError):
    """Capture or steering asked for where it cannot run: on the batched path (a hook would touch every
    row of a shared batch; pass ``batched=False``) or on a hosted-API participant (no weights to hook)."""


class BranchError(ConfigurationError):
    """A branch point that cannot be taken: ``conv.upto(k)`` or ``report.branch(at_turn=k)`` past a job's
    length, a job that failed before turn k or does not exist, a ledger written by another recipe."""


class DeviceError(ConfigurationError, _scheduler_errors.DeviceError):
    """A device string that does not exist on this machine."""


class DataSourceError(InterlensError):
    """Reading the rows given to ``.data()`` failed mid-stream (a dropped connection, a read error); the
    message names the row reached. The jobs of the rows read before it are kept."""


class UnrunConversationError(InterlensError):
    """``sample()`` on a recipe that has not generated a turn yet."""


class SchemaVersionError(InterlensError):
    """A saved conversation was written by a newer interlens than this one."""


class GenerationError(InterlensError):
    """A participant failed to produce a turn."""


class ModelLoadError(GenerationError):
    """Model weights or tokenizer could not be loaded."""


class AnalyzerError(InterlensError):
    """An analyzer raised, or returned a value that is not JSON-serializable."""


class WorkerStartError(InterlensError, _scheduler_errors.WorkerStartError):
    """A worker could not start: its process died or timed out, or its set-up (imports, init hooks) raised.

    Raised by the run before any job starts; also ``interlens.scheduler.WorkerStartError``.
    """


class LedgerError(InterlensError, _store_errors.StoreError):
    """The run ledger refused an operation."""


class LedgerLockedError(LedgerError, _store_errors.LedgerLockedError):
    """Another live process is writing the same ``out_dir``."""


class FingerprintMismatchError(LedgerError, _store_errors.FingerprintMismatchError):
    """A rerun's recipe differs from the recipe that produced the ledger."""


class LedgerSchemaError(LedgerError, _store_errors.LedgerSchemaError):
    """The ledger was written by a newer version of interlens."""


class LedgerCorruptError(LedgerError, _store_errors.LedgerCorruptError):
    """The ledger file is not a readable SQLite ledger; it is left untouched."""


_TRANSLATION: dict[type[BaseException], type[InterlensError]] = {
    _scheduler_errors.DeviceError: DeviceError,
    _scheduler_errors.SchedulerConfigError: ConfigurationError,
    _scheduler_errors.WorkerStartError: WorkerStartError,
    _store_errors.LedgerLockedError: LedgerLockedError,
    _store_errors.FingerprintMismatchError: FingerprintMismatchError,
    _store_errors.LedgerSchemaError: LedgerSchemaError,
    _store_errors.LedgerCorruptError: LedgerCorruptError,
    _store_errors.StoreError: LedgerError,
}


@contextlib.contextmanager
def as_interlens_errors() -> Iterator[None]:
    """The package boundary: a scheduler or store error raised inside leaves as its interlens twin.

    The twin has the same message and inherits from both classes (either ``except`` works); it is chained to
    what the foreign error was chained to, so a traceback does not show the same message twice. An interlens
    error, or any other exception, passes unchanged.
    """
    try:
        yield
    except Exception as exc:
        ours = translate(exc)
        if ours is exc:
            raise
        raise ours from exc.__cause__


def translate(exc: BaseException) -> BaseException:
    """Return the interlens error for a foreign ``exc`` (same message), or ``exc`` itself."""
    if isinstance(exc, InterlensError):
        return exc
    for foreign, ours in _TRANSLATION.items():
        if isinstance(exc, foreign):
            translated = ours(*exc.args)
            translated.__cause__ = exc
            return translated
    return exc
