"""The SQLite ledger that makes every run resumable and auditable (installed as ``interlens.store``)."""

from ._errors import (
    FingerprintMismatchError,
    LedgerCorruptError,
    LedgerLockedError,
    LedgerSchemaError,
    StoreError,
)

__all__ = [
    "FingerprintMismatchError",
    "LedgerCorruptError",
    "LedgerLockedError",
    "LedgerSchemaError",
    "StoreError",
]
