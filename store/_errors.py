"""Every error the ledger raises on purpose, in one place (exported from ``interlens.store``).

The hierarchy::

    StoreError                      base of every ledger error
    ├── LedgerLockedError           another live process holds the out_dir's writer lock
    ├── FingerprintMismatchError    a rerun's recipe fingerprint differs for existing job ids
    ├── LedgerSchemaError           written by a newer schema version, or an older one that cannot be upgraded
    ├── LedgerFullError             the disk (or quota) holding the ledger is full: no write can commit
    ├── LedgerCorruptError          the file is not a readable SQLite ledger (it is left untouched)
    │   └── UnreadableRecordError   one job's record does not parse, in a ledger that otherwise reads
    └── LedgerNotFoundError         no ledger where a reader looked (also a FileNotFoundError)

The store imports nothing from interlens, so these are its own classes; interlens translates them at its
boundary into ``InterlensError`` subclasses that also inherit from these.
"""

from __future__ import annotations

__all__ = [
    "FingerprintMismatchError",
    "LedgerCorruptError",
    "LedgerFullError",
    "LedgerLockedError",
    "LedgerNotFoundError",
    "LedgerSchemaError",
    "StoreError",
    "UnreadableRecordError",
]


class StoreError(Exception):
    """Base class of every ledger error."""


class LedgerLockedError(StoreError):
    """Another live process holds the writer lock of this out_dir."""


class FingerprintMismatchError(StoreError):
    """A rerun's recipe fingerprint differs from the one recorded for the same job ids."""


class LedgerSchemaError(StoreError):
    """The ledger was written by a newer schema version than this code understands, or by an older one whose
    upgrade failed (the file is then left as it was)."""


class LedgerFullError(StoreError):
    """The disk (or the user's quota) holding the ledger is full: the write was rolled back, what was
    committed before it is kept, and a rerun after freeing space resumes."""


class LedgerCorruptError(StoreError):
    """The file is not a readable SQLite ledger."""


class UnreadableRecordError(LedgerCorruptError):
    """One record of job ``job_id`` does not parse (turn ``idx``; None: its result); see ``_damage``."""

    def __init__(self, message: str, *, job_id: str, idx: int | None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.idx = idx


class LedgerNotFoundError(StoreError, FileNotFoundError):
    """There is no ledger at the path a reader was given."""
