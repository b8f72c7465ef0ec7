"""The plain records the ledger takes and gives back.

They are frozen dataclasses of JSON-able values rather than ORM objects so that a report over a million jobs
can stream them without holding a session, and so that nothing read from a run directory can execute code.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "JOB_STATES",
    "RUN_STATUSES",
    "TERMINAL_BATCH_STATES",
    "BatchRecord",
    "JobRecord",
    "RecordedJobs",
    "TurnRecord",
]

#: Every state a job row can be in. pending → running → done | failed; running → pending when requeued.
JOB_STATES: Final = ("pending", "running", "done", "failed")

#: What ``end_run`` accepts. "running" is what a run is while live; "crashed" is written by the next
#: ``begin_run`` for a run whose process died without ending it.
RUN_STATUSES: Final = ("completed", "stopped", "interrupted", "failed")

#: Provider batch states after which there is nothing left to re-attach to (OpenAI and Anthropic names, plus
#: "collected" for a batch whose results the scheduler has already written back, and "superseded" for one
#: whose every row a rerun refused because its request changed: it is never polled or re-attached again).
TERMINAL_BATCH_STATES: Final = frozenset(
    {"completed", "failed", "expired", "cancelled", "ended", "collected", "superseded"}
)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job row. Pass the first four fields and ``input_fp`` to ``Ledger.add_jobs``; the ledger fills the
    rest.

    ``input_fp`` is what the job is asked, as an opaque string the caller computes (interlens: digests of
    the data row, the resolved prompts, the seed, the execution mode and the recipe). A rerun compares it
    before it resumes the job. None on jobs written by ledger schema 1, or added by a caller that gives none.
    """

    job_id: str
    lineup: str
    seed: int
    row_index: int | None = None
    state: str = "pending"
    attempts: int = 0
    device: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    tokens_generated: int = 0
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    run_id: int | None = None  # the run that last finished or failed this job
    input_fp: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ValueError(f"JobRecord.job_id must be a non-empty str, got {self.job_id!r}")
        if not isinstance(self.lineup, str):
            raise ValueError(f"JobRecord.lineup of job {self.job_id!r} must be a str, got {self.lineup!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"JobRecord.seed of job {self.job_id!r} must be an int, got {self.seed!r}")
        if self.row_index is not None and (
            not isinstance(self.row_index, int) or isinstance(self.row_index, bool)
        ):
            raise ValueError(f"JobRecord.row_index of job {self.job_id!r} must be an int or None")
        if self.input_fp is not None and not isinstance(self.input_fp, str):
            raise ValueError(f"JobRecord.input_fp of job {self.job_id!r} must be a str or None")
        if self.state not in JOB_STATES:
            raise ValueError(
                f"JobRecord.state of job {self.job_id!r} must be one of {JOB_STATES}, got {self.state!r}"
            )

    @property
    def duration_s(self) -> float | None:
        """Wall time of the last attempt, when it has finished."""
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


@dataclass(frozen=True, slots=True)
class RecordedJobs:
    """What a rerun must know of the jobs already in a ledger, read once when a run starts.

    ``done``: ids of done jobs (a rerun skips them). ``inputs``: every recorded job's input fingerprint (None
    where the ledger recorded none). ``per_lineup``: how many jobs each lineup has, so a verification pass
    can stop once it has seen them all. Memory is O(recorded jobs), like the resume scan always was.
    """

    done: set[str] = field(default_factory=set)
    inputs: dict[str, str | None] = field(default_factory=dict)
    per_lineup: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One committed turn of a job, as stored."""

    job_id: str
    index: int
    turn: dict[str, Any]
    committed_at: float


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """An in-flight provider batch: enough to re-attach to it after a crash instead of paying for it twice.

    ``requests`` maps each request's custom id to the ``(job_id, turn_index)`` it answers. ``meta`` holds
    provider details worth keeping (model, endpoint, input file id) as JSON — never a credential.
    ``request_hashes`` maps a custom id to the hash of the request exactly as it was sent (a hex digest, never
    the request itself): a rerun re-attaches a job to this row only when the job would send the same request
    now. A custom id without one (a row written by schema version 1) cannot be verified and is never
    re-attached.
    """

    provider: str
    batch_id: str
    state: str
    requests: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    created_at: float | None = None
    updated_at: float | None = None
    request_hashes: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("provider", "batch_id", "state"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"BatchRecord.{name} must be a non-empty str, got {value!r}")
        for custom_id, target in self.requests.items():
            ok = (
                isinstance(custom_id, str)
                and isinstance(target, tuple | list)
                and len(target) == 2
                and isinstance(target[0], str)
                and isinstance(target[1], int)
            )
            if not ok:
                raise ValueError(
                    f"BatchRecord {self.batch_id!r}: requests must map a str custom id to (job_id: str, "
                    f"turn_index: int), got {custom_id!r}: {target!r}"
                )
        for custom_id, digest in self.request_hashes.items():
            if custom_id not in self.requests:
                raise ValueError(
                    f"BatchRecord {self.batch_id!r}: request_hashes has custom id {custom_id!r}, which is "
                    "not in requests; give a hash only for a recorded request"
                )
            if digest is not None and (not isinstance(digest, str) or not digest):
                raise ValueError(
                    f"BatchRecord {self.batch_id!r}: the request hash of {custom_id!r} must be a non-empty "
                    f"str or None, got {digest!r}"
                )

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_BATCH_STATES


JOB_COLUMNS: Final = (
    "job_id, lineup, seed, row_index, state, attempts, device, created_at, started_at, finished_at, "
    "tokens_generated, error_type, error_message, error_traceback, run_id, input_fp"
)


def job_columns(schema_version: int) -> str:
    """:data:`JOB_COLUMNS` as a ledger of ``schema_version`` can answer them (version 1 has no input_fp)."""
    return JOB_COLUMNS if schema_version >= 2 else JOB_COLUMNS.replace("input_fp", "NULL")


def job_from_row(row: sqlite3.Row | tuple[Any, ...]) -> JobRecord:
    """Build a JobRecord from a row selected with :data:`JOB_COLUMNS` (same order)."""
    return JobRecord(*row)
