"""Plain-data results: what one attempt produced, what one job ended as, and what a run returns.

Everything here is picklable plain data, because an attempt's outcome is what a worker process will send
back to the parent (issue #5): exception objects do not cross that boundary, their :class:`ErrorInfo` does.
That is also where an exception becomes text, so that is where credentials are redacted (issue #9).
"""

from __future__ import annotations

import traceback as _tb
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from interlens.store import SecretGuard

if TYPE_CHECKING:
    from interlens.store import JobRecord

__all__ = ["AttemptOutcome", "ErrorInfo", "JobOutcome", "RunOutcome"]

JobState = Literal["done", "failed"]


@dataclass(frozen=True)
class ErrorInfo:
    """An exception reduced to text: its type name, message and formatted traceback."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorInfo:
        """The exception as text, with the value of every credential in the environment redacted.

        Done here, wherever the exception happened (a worker process included), so a key that a provider or
        a library put in an error message never travels, is never stored and never printed: it reads
        ``[redacted:VARNAME]``, and the job fails like any other.
        """
        guard = SecretGuard()
        return cls(
            type=type(exc).__qualname__,
            message=guard.redact(str(exc)),
            traceback=guard.redact("".join(_tb.format_exception(type(exc), exc, exc.__traceback__))),
        )

    def redacted(self) -> ErrorInfo:
        """This error with credentials redacted (for one built from text rather than from an exception)."""
        guard = SecretGuard()
        return ErrorInfo(guard.redact(self.type), guard.redact(self.message), guard.redact(self.traceback))


@dataclass(frozen=True)
class AttemptOutcome:
    """What one attempt of one job produced, as a worker reports it.

    ``error`` is None for success. A failed attempt may still carry its ``conversation`` (an analyzer that
    failed after the conversation finished). ``transient`` is decided next to the job (``job.is_transient``),
    where the exception object still exists. ``worker_lost``: the worker process died under the attempt, so
    the job never got to say how it ended (retried on a fresh worker, see ``_run_jobs``).
    """

    conversation: Mapping[str, Any] | None = None
    analysis: Any = None
    tokens_generated: int = 0
    error: ErrorInfo | None = None
    transient: bool = False
    worker_lost: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class JobOutcome:
    """How one job of a run ended. ``skipped`` jobs were already done by an earlier run of the ledger."""

    job_id: str
    lineup: str
    row_index: int | None
    seed: int
    state: JobState
    conversation: Mapping[str, Any] | None
    analysis: Any
    tokens_generated: int
    error: ErrorInfo | None
    device: str | None
    attempts: int
    skipped: bool = False

    @classmethod
    def from_ledger(
        cls, job: JobRecord, result: Mapping[str, Any] | None, *, skipped: bool = False
    ) -> JobOutcome:
        """The outcome a ledger records: its job row and stored result (``LedgerReader.job``/``result``)."""
        failed = job.state != "done"
        return cls(
            job_id=job.job_id,
            lineup=job.lineup,
            row_index=job.row_index,
            seed=job.seed,
            state="failed" if failed else "done",
            conversation=None if result is None else result["conversation"],
            analysis=None if result is None or failed else result["analysis"],
            tokens_generated=job.tokens_generated,
            error=ErrorInfo(job.error_type or "UnknownError", job.error_message or "", job.traceback or "")
            if failed
            else None,
            device=job.device,
            attempts=job.attempts,
            skipped=skipped,
        )


class OutcomeSource(Protocol):
    """Where a :class:`RunOutcome` reads per-job outcomes from: memory, or the ledger on disk."""

    def job_ids(self, state: JobState | None = None) -> list[str]: ...

    def outcome(self, job_id: str) -> JobOutcome: ...

    def outcomes(self) -> Iterator[JobOutcome]: ...


@dataclass(frozen=True)
class RunOutcome:
    """The result of :func:`run_jobs`.

    ``counts`` has ``total`` (jobs pulled in this run), ``done`` and ``failed`` (jobs that ran in this run)
    and ``skipped`` (done by an earlier run, not rerun). With an ``out_dir`` every per-job read goes to the
    ledger, so a million-job run does not hold a million conversations in memory. ``api``: the run's API
    gateway statistics (``Gateway.stats()``: per provider client its limit, peak in flight, rate-limited
    calls, retries; batches submitted, rows re-attached), read as it closed. ``stopped``: set when the API
    spend guard ended the run early; ``counts["pending"]`` then says how many jobs it left to a rerun.
    """

    ledger_path: Path | None
    counts: Mapping[str, int]
    _source: OutcomeSource = field(repr=False)
    _skipped: Sequence[str] = field(repr=False, default=())
    api: Mapping[str, Any] = field(repr=False, default_factory=dict)
    #: Why the run stopped before every job ran (the API spend guard's message, or a device in the run's
    #: own process poisoned by a CUDA error), else None.
    stopped: str | None = None

    @property
    def job_ids(self) -> list[str]:
        """Every job of this run, in job order: ``done`` + ``failed`` + ``skipped``."""
        return self._source.job_ids()

    @property
    def done(self) -> list[str]:
        """Jobs that ran and finished in this run (the skipped ones, done earlier, are in ``skipped``)."""
        return self._source.job_ids("done")

    @property
    def failed(self) -> list[str]:
        """Jobs that failed in this run (after their retries)."""
        return self._source.job_ids("failed")

    @property
    def skipped(self) -> list[str]:
        """Jobs found done in the ledger at the start and therefore not run again."""
        return list(self._skipped)

    def outcome(self, job_id: str) -> JobOutcome:
        """The outcome of one job; ``KeyError`` for an id that is not part of this run."""
        return self._source.outcome(job_id)

    def outcomes(self) -> Iterator[JobOutcome]:
        """Every job's outcome in job order, one at a time (paged from the ledger when there is one)."""
        return self._source.outcomes()
