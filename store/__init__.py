"""The SQLite ledger that makes every run resumable and auditable (installed as ``interlens.store``).

One file per run directory, ``OUT_DIR/ledger.sqlite``: the scheduler writes it through :class:`Ledger` (the
only writer, group-committed, durable against a crash of the process on every acknowledged write); reports
and the CLI read it through :class:`LedgerReader` (synchronous, read-only, fine while a run is live). Only
JSON is stored, never pickle, so opening a run directory cannot execute code; no credential is ever stored
(:class:`SecretGuard` refuses results holding one and redacts error text and log lines: the one helper the
scheduler reuses for that). Each message is stored once (the turns) and a result's recipe once per lineup
(``_results``); an older ledger is migrated when a writer opens it (``_schema``).
This package imports nothing from interlens or its scheduler.

The face is lazy (PEP 562): each name below loads the private module that defines it on first use, and is
kept in this module's globals, so ``interlens._core`` can subclass the errors (``_errors`` imports nothing)
without loading the ledger's machinery.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from ._damage import UnreadableRecord
    from ._errors import (
        FingerprintMismatchError,
        LedgerCorruptError,
        LedgerFullError,
        LedgerLockedError,
        LedgerNotFoundError,
        LedgerSchemaError,
        StoreError,
        UnreadableRecordError,
    )
    from ._json import dumps as encode_json
    from ._ledger import Ledger
    from ._lock import LOCK_FILENAME
    from ._reader import LedgerReader
    from ._records import (
        JOB_STATES,
        RUN_STATUSES,
        TERMINAL_BATCH_STATES,
        BatchRecord,
        JobRecord,
        RecordedJobs,
        TurnRecord,
    )
    from ._schema import LEDGER_FILENAME, SCHEMA_VERSION
    from ._secrets import SecretGuard, redacting_logger

#: Each exported name -> the private module that defines it ("module:name" where it is named otherwise there).
_EXPORTS: dict[str, str] = {
    "UnreadableRecord": "._damage",
    "FingerprintMismatchError": "._errors",
    "LedgerCorruptError": "._errors",
    "LedgerFullError": "._errors",
    "LedgerLockedError": "._errors",
    "LedgerNotFoundError": "._errors",
    "LedgerSchemaError": "._errors",
    "StoreError": "._errors",
    "UnreadableRecordError": "._errors",
    "encode_json": "._json:dumps",
    "Ledger": "._ledger",
    "LOCK_FILENAME": "._lock",
    "LedgerReader": "._reader",
    "JOB_STATES": "._records",
    "RUN_STATUSES": "._records",
    "TERMINAL_BATCH_STATES": "._records",
    "BatchRecord": "._records",
    "JobRecord": "._records",
    "RecordedJobs": "._records",
    "TurnRecord": "._records",
    "LEDGER_FILENAME": "._schema",
    "SCHEMA_VERSION": "._schema",
    "SecretGuard": "._secrets",
    "redacting_logger": "._secrets",
    "restore_tokens": "._token_rows:restore",
}

__all__ = [
    "JOB_STATES",
    "LEDGER_FILENAME",
    "LOCK_FILENAME",
    "RUN_STATUSES",
    "SCHEMA_VERSION",
    "TERMINAL_BATCH_STATES",
    "BatchRecord",
    "FingerprintMismatchError",
    "JobRecord",
    "Ledger",
    "LedgerCorruptError",
    "LedgerFullError",
    "LedgerLockedError",
    "LedgerNotFoundError",
    "LedgerReader",
    "LedgerSchemaError",
    "RecordedJobs",
    "SecretGuard",
    "StoreError",
    "TurnRecord",
    "UnreadableRecord",
    "UnreadableRecordError",
    "encode_json",
    "redacting_logger",
    "restore_tokens",
]


def __getattr__(name: str) -> typing.Any:
    """Load an exported name from its module on first use and keep it here (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attribute = _EXPORTS[name].partition(":")
    value = globals()[name] = getattr(importlib.import_module(module, __name__), attribute or name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
