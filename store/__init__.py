"""The SQLite ledger that makes every run resumable and auditable (installed as ``interlens.store``).

One file per run directory, ``OUT_DIR/ledger.sqlite``: the scheduler writes it through :class:`Ledger` (the
only writer, group-committed, durable against a crash of the process on every acknowledged write); reports
and the CLI read it through :class:`LedgerReader` (synchronous, read-only, fine while a run is live). Only
JSON is stored, never pickle, so opening a run directory cannot execute code; no credential is ever stored
(:class:`SecretGuard` refuses results holding one and redacts error text and log lines: the one helper the
scheduler reuses for that). Each message is stored once (the turns) and a result's recipe once per lineup
(``_results``); an older ledger is migrated when a writer opens it (``_schema``).
This package imports nothing from interlens or its scheduler.
"""

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
]
