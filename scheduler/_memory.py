"""The recorder of a run without ``out_dir``: nothing touches disk, every outcome stays in memory.

It mirrors the ledger's behaviour where a user could tell the difference: values are stored as their JSON
round-trip (so a tuple comes back as a list, and a non-JSON value fails the same way it would with a
ledger), a value holding a credential from the environment is refused and error text has credentials
redacted (the ledger's :class:`~interlens.store.SecretGuard`), turns are committed in index order, and
attempts are counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from interlens.store import RecordedJobs, SecretGuard, StoreError, encode_json

from ._errors import DuplicateJobError
from ._outcome import AttemptOutcome, ErrorInfo, JobOutcome, JobState, RunOutcome
from ._protocols import JobSpec

__all__ = ["MemoryRecorder"]


def _json_copy(value: Any, what: str, guard: SecretGuard) -> Any:
    """What the ledger would store (JSON, no NaN, no credential), so both recorders refuse the same values."""
    return json.loads(encode_json(value, what=what, guard=guard))


@dataclass
class _Job:
    spec_lineup: str
    row_index: int | None
    seed: int
    state: str = "pending"
    attempts: int = 0
    device: str | None = None
    turns: dict[int, dict[str, Any]] = field(default_factory=dict)
    conversation: Any = None
    analysis: Any = None
    tokens_generated: int = 0
    error: ErrorInfo | None = None


class MemoryRecorder:
    """In-memory stand-in for the ledger, with the same async interface as ``LedgerRecorder``."""

    value_errors: tuple[type[BaseException], ...] = (TypeError, ValueError, StoreError)

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._guard = SecretGuard()

    @property
    def ledger_path(self) -> None:
        return None

    @property
    def batch_store(self) -> None:
        """No ledger, nothing to re-attach to: provider batches of an in-memory run are not recorded."""
        return None

    async def recorded(self) -> RecordedJobs:
        return RecordedJobs()  # nothing to resume without a ledger

    async def begin(self) -> None:
        pass

    async def add_many(self, specs: Sequence[JobSpec]) -> None:
        for spec in specs:
            if spec.job_id in self._jobs:
                raise DuplicateJobError(
                    f"job id {spec.job_id!r} occurs twice in this run (lineups "
                    f"{self._jobs[spec.job_id].spec_lineup!r} and {spec.lineup!r}); job ids must be unique "
                    "across all lineups of a run"
                )
            self._jobs[spec.job_id] = _Job(spec.lineup, spec.row_index, spec.seed)

    async def start(self, job_id: str, *, device: str) -> int:
        job = self._jobs[job_id]
        job.state, job.device = "running", device
        job.attempts += 1
        return job.attempts

    async def committed_turns(self, job_id: str) -> list[dict[str, Any]]:
        turns = self._jobs[job_id].turns
        return [json.loads(json.dumps(turns[i])) for i in sorted(turns)]

    async def record_turn(self, job_id: str, index: int, turn: Mapping[str, Any]) -> None:
        # Like the ledger: re-recording an index replaces it; turns come back in index order.
        self._jobs[job_id].turns[index] = _json_copy(
            dict(turn), f"turn {index} of job {job_id!r}", self._guard
        )

    async def finish(self, job_id: str, outcome: AttemptOutcome) -> None:
        job = self._jobs[job_id]
        conversation = _json_copy(outcome.conversation, f"the conversation of job {job_id!r}", self._guard)
        analysis = _json_copy(outcome.analysis, f"the analysis of job {job_id!r}", self._guard)
        job.state, job.conversation, job.analysis = "done", conversation, analysis
        job.tokens_generated, job.error = outcome.tokens_generated, None

    async def fail(self, job_id: str, outcome: AttemptOutcome) -> None:
        job = self._jobs[job_id]
        conversation = None
        if outcome.conversation is not None:
            what = f"the conversation of failed job {job_id!r}"
            conversation = _json_copy(outcome.conversation, what, self._guard)
        # Redacted again, as the ledger does: the last line for an error built from text, not an exception.
        error = None if outcome.error is None else outcome.error.redacted()
        job.state, job.conversation, job.error = "failed", conversation, error
        job.tokens_generated = outcome.tokens_generated

    async def retry(self, job_id: str) -> None:
        self._jobs[job_id].state = "pending"

    async def end(self, status: str) -> None:
        pass

    async def close(self) -> None:
        pass

    def outcome(self, *, counts: Mapping[str, int], skipped: list[str]) -> RunOutcome:
        return RunOutcome(ledger_path=None, counts=dict(counts), _source=_MemorySource(self._jobs))


class _MemorySource:
    def __init__(self, jobs: dict[str, _Job]) -> None:
        self._jobs = jobs

    def job_ids(self, state: JobState | None = None) -> list[str]:
        return [jid for jid, job in self._jobs.items() if state is None or job.state == state]

    def outcomes(self) -> Iterator[JobOutcome]:
        for job_id in list(self._jobs):
            yield self.outcome(job_id)

    def outcome(self, job_id: str) -> JobOutcome:
        job = self._jobs[job_id]
        state: JobState = "done" if job.state == "done" else "failed"
        return JobOutcome(
            job_id=job_id,
            lineup=job.spec_lineup,
            row_index=job.row_index,
            seed=job.seed,
            state=state,
            conversation=job.conversation,
            analysis=job.analysis,
            tokens_generated=job.tokens_generated,
            error=job.error,
            device=job.device,
            attempts=job.attempts,
        )
