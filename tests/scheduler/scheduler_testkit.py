"""Small jobs and engines that satisfy the scheduler's protocols: clients of the contract, not mocks.

The engines are real objects the scheduler loads in a thread and calls with real batches; they record what
they saw (batch sizes, overlap on a device) so tests assert on the scheduler's observable behaviour.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from interlens.scheduler import (
    BatchCancelled,
    ExecutionMode,
    JobContext,
    JobResult,
    JobSpec,
    LineupSpec,
)


class TransientError(Exception):
    """What a flaky outside service raises; TurnsJob.is_transient says it is worth a retry."""


class OutOfMemoryError(RuntimeError):
    """Named like torch.OutOfMemoryError (the scheduler recognises it by name; torch is not imported)."""


class Device:
    """Watches one device: two batches overlapping on it would be a scheduler bug."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.overlaps = 0
        self.log: list[tuple[str, int]] = []  # (engine name, batch size), in the order they ran

    def enter(self, name: str, size: int) -> None:
        with self._lock:
            self.log.append((name, size))
            self.active += 1
            if self.active > 1:
                self.overlaps += 1

    def exit(self) -> None:
        with self._lock:
            self.active -= 1


class EchoEngine:
    """Answers each request with ``"<name>(<request>)"``; records every batch it is given."""

    def __init__(
        self,
        name: str,
        device: Device,
        *,
        poison: str | None = None,
        fail_batch: BaseException | None = None,
        block_until_cancelled: threading.Event | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.poison = poison
        self.fail_batch = fail_batch
        self.block_until_cancelled = block_until_cancelled  # set by us once a batch is blocked
        self.batches: list[list[Any]] = []
        self.modes: set[ExecutionMode] = set()
        self.saw_cancel = threading.Event()

    def generate_batch(
        self, requests: Sequence[Any], *, mode: ExecutionMode, cancelled: threading.Event | None = None
    ) -> list[Any]:
        self.device.enter(self.name, len(requests))
        try:
            self.batches.append(list(requests))
            self.modes.add(mode)
            if self.block_until_cancelled is not None:
                assert cancelled is not None
                self.block_until_cancelled.set()
                if cancelled.wait(timeout=30):
                    self.saw_cancel.set()
                    raise BatchCancelled("stopped: the run was cancelled")
                raise AssertionError("the scheduler never set the cancelled event")
            if self.fail_batch is not None:
                raise self.fail_batch
            if self.poison is not None and self.poison in requests:
                raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            out: list[Any] = []
            for r in requests:
                if isinstance(r, str) and r.startswith("bad-row"):
                    out.append(ValueError(f"cannot generate for {r}"))
                else:
                    out.append(f"{self.name}({r})")
            return out
        finally:
            self.device.exit()

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


@dataclass(eq=False)
class EchoSpec:
    """A load recipe; ``loads`` counts how often the scheduler loaded it (must be once per device)."""

    name: str
    device: Device = field(default_factory=Device)
    make: Callable[[str, Device], EchoEngine] | None = None
    fail_load: BaseException | None = None
    loads: list[str] = field(default_factory=list)
    engines: list[EchoEngine] = field(default_factory=list)
    load_gate: threading.Event | None = None

    @property
    def engine_key(self) -> str:
        return self.name

    def load_engine(self, device: str) -> EchoEngine:
        self.loads.append(device)
        if self.load_gate is not None:
            self.load_gate.wait(timeout=30)
        if self.fail_load is not None:
            raise self.fail_load
        engine = self.make(self.name, self.device) if self.make else EchoEngine(self.name, self.device)
        self.engines.append(engine)
        return engine

    @property
    def engine(self) -> EchoEngine:
        assert len(self.engines) == 1, f"expected one engine for {self.name}, got {len(self.engines)}"
        return self.engines[0]


@dataclass
class TurnsJob:
    """A conversation of ``turns`` turns; turn i asks ``engines[i % len(engines)]``.

    It replays committed turns (resume), records each new turn, and fails on purpose in the ways the tests
    need: ``raise_on_turn`` raises at that turn; the first ``transient_failures`` attempts raise
    TransientError when they reach turn ``transient_at_turn``; ``analysis_error`` returns a result with a
    failed analyzer; ``conversation_extra`` is merged into the returned conversation.
    """

    engines: Sequence[EchoSpec] = ()
    turns: int = 3
    needs_device: bool = True
    raise_on_turn: int | None = None
    transient_failures: int = 0
    transient_at_turn: int = 0
    conversation_extra: dict[str, Any] = field(default_factory=dict)
    analysis_error: BaseException | None = None
    request: Callable[[JobContext, int], Any] | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)  # one entry per attempt: what ctx said

    async def run(self, ctx: JobContext) -> JobResult:
        self.seen.append(
            {
                "attempt": ctx.attempt,
                "device": ctx.device,
                "mode": ctx.mode,
                "seed": ctx.seed,
                "committed": [dict(t) for t in ctx.committed_turns],
            }
        )
        turns = [dict(t) for t in ctx.committed_turns]
        for i in range(len(turns), self.turns):
            if i == self.transient_at_turn and ctx.attempt <= self.transient_failures:
                raise TransientError(f"flaky service, attempt {ctx.attempt}")
            if self.raise_on_turn == i:
                raise KeyError(f"row broke at turn {i}")
            if self.engines:
                req = self.request(ctx, i) if self.request else f"{ctx.job_id}:{i}"
                text = await ctx.generate(self.engines[i % len(self.engines)], req)
            else:
                text = f"scripted {i}"
            turn = {"index": i, "text": text}
            await ctx.record_turn(i, turn)
            turns.append(turn)
        return JobResult(
            conversation={"job": ctx.job_id, "turns": turns, **self.conversation_extra},
            tokens_generated=10 * len(turns),
            analysis={"n_turns": len(turns)},
            analysis_error=self.analysis_error,
        )

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, TransientError)


def lineup(name: str, jobs: Sequence[Any] | Iterator[JobSpec], *, n: int | None = None) -> LineupSpec:
    """A lineup whose jobs are TurnsJobs (wrapped as JobSpecs ``<name>/<i>``) or ready JobSpecs."""

    def specs() -> Iterator[JobSpec]:
        for i, job in enumerate(jobs):
            yield (
                job
                if isinstance(job, JobSpec)
                else JobSpec(f"{name}/{i:04d}", name, seed=i, job=job, row_index=i)
            )

    count = n if n is not None else (len(jobs) if isinstance(jobs, Sequence) else None)
    return LineupSpec(name=name, fingerprint=f"fp-{name}", jobs=specs(), n_jobs=count)
