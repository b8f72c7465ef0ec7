"""The contract between the scheduler and the code it runs.

The scheduler never imports interlens' user-facing modules. It runs objects that satisfy the small protocols
below; interlens implements them (a conversation job, a model's load recipe, a loaded model), and pickling
brings that code into a worker process by reference. Everything crossing these protocols is plain data
(JSON-able dicts, strings, numbers) or an object that pickles without weights.

Flow of one job::

    scheduler                                   job (interlens)
    ─────────                                   ───────────────
    JobSpec pulled lazily from a LineupSpec
    ledger: start_job (attempt += 1)
    await job.run(ctx) ───────────────────────▶ replays ctx.committed_turns, then for each new turn:
                                                  local model turn → await ctx.generate(engine_spec, request)
    coalescing batcher per (engine key, device)     (batched with every other job's pending request)
                                                  API turn → await ctx.call_gateway(api_spec, request)
    the run's API gateway (parent process)          (limits, retries, provider batch rounds)
    ◀────────────────────────────────────────── await ctx.record_turn(index, turn)   (durable on return)
                                                runs the analyzer, returns a JobResult
    ledger: finish_job (done + result, one txn)
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ._errors import BatchCancelled

__all__ = [
    "BatchCancelled",
    "Engine",
    "EngineSpec",
    "ExecutionMode",
    "Job",
    "JobContext",
    "JobResult",
    "JobSpec",
    "LineupSpec",
    "WorkerInit",
]

JSON = Any  # a value that json.dumps accepts

#: A picklable callable run once in each worker before its first job (e.g. load a probe onto its device).
WorkerInit = Callable[[], object]


class ExecutionMode(enum.Enum):
    """How local-model turns are generated, and what a rerun with the same seed reproduces.

    In both modes every local turn samples from its own random stream, seeded from (participant seed, the
    job's rollout seed, the job id, the turn index), so the random draws of a turn never depend on other jobs.

    DETERMINISTIC: every turn is generated from scratch (no KV cache kept from an earlier turn), alone or
    co-stepped with other turns only where the engine knows its forward pass is batch-invariant (a local
    engine's self-test), so a conversation is token-identical on the same hardware and software whatever
    runs beside or before it (the guarantee interp work needs). The batcher coalesces these turns as in
    BATCHED mode and passes the mode on.

    BATCHED (the default): concurrent turns for one model on one device co-step in one batched generate.
    The same seeds give the same random draws, but a turn's logits come from a forward pass over a batch
    whose composition (other rows, their padding, how many are left, or a kept KV cache when a turn runs
    alone) depends on timing. Tokens are reproducible only where that pass is batch-invariant, giving each
    row bitwise the same logits whatever its batch mates (not so with stock kernels, even on CPU: a matmul
    rounds differently for another row count; GPU kernels pick reduction orders by batch shape); elsewhere a
    rerun is reproducible in distribution, not token for token.
    """

    BATCHED = "batched"
    DETERMINISTIC = "deterministic"


@runtime_checkable
class Engine(Protocol):
    """A model resident on one device. Built once per (EngineSpec.key, device) in a worker."""

    def generate_batch(
        self, requests: Sequence[Any], *, mode: ExecutionMode, cancelled: threading.Event | None = None
    ) -> list[Any]:
        """Generate one result per request, in order. Runs in a thread; may block for a long time.

        When ``cancelled`` is set (Ctrl-C, run cancelled) the engine stops within one decode step and raises
        :class:`BatchCancelled`, so a cancelled run does not wait for a long generate to finish.

        Raising fails the whole batch: the batcher splits a batch that ran out of memory in halves and
        retries, down to single requests. Before each retry it clears the failed call's frames (so its
        tensors are freed) and calls the engine's ``release_memory()`` if it has one (optional, not part of
        this protocol's required methods: e.g. return the CUDA allocator's cached blocks). A per-request
        failure can instead be returned in place as an Exception instance, raised to that caller only.

        Also optional: ``evict()``, called (in a thread) when the run no longer needs this engine (see
        ``LineupSpec.engine_keys``) and the worker drops it: let go of whatever keeps the weights alive (a
        process-wide cache) and return the device memory. The engine is not called again afterwards.
        """
        ...


@runtime_checkable
class EngineSpec(Protocol):
    """A lazy, picklable load recipe (no weights). Equal keys share one Engine per device."""

    @property
    def engine_key(self) -> Hashable: ...

    def load_engine(self, device: str) -> Engine:
        """Load the weights onto ``device`` (called in a thread, at most once per key and device)."""
        ...


class JobContext(Protocol):
    """What a running job may ask of the scheduler. Provided in-process and, identically, in a worker."""

    job_id: str
    seed: int
    device: str  # as its worker addresses it ("cpu", "cuda:0": a CUDA worker sees only its own GPU)
    mode: ExecutionMode
    attempt: int  # 1 on the first attempt
    committed_turns: Sequence[Mapping[str, JSON]]  # turns a previous attempt/run already committed, in order

    async def generate(self, engine: EngineSpec, request: Any) -> Any:
        """Queue ``request`` on the coalescing batcher of ``engine`` on the job's device; await its result."""
        ...

    async def record_turn(self, index: int, turn: Mapping[str, JSON]) -> None:
        """Commit one finished turn; returns once it is durable (out_dir set) or recorded in memory."""
        ...

    async def call_gateway(self, spec: Any, request: Any) -> Any:
        """Send one hosted-model ``request`` for ``spec`` (an ``APISpec``) through the run's API gateway.

        The gateway lives in the parent (it holds the API keys, the provider limits and the batch collectors,
        and records provider batches in the run's ledger): from a worker process the pair crosses the pipe.
        ``spec``, ``request``, the result and the error must pickle. Returns the provider adapter's result or
        raises its error (``ProviderCallError``, ``BatchRowError``). While its request waits on a provider
        batch, the job counts as blocked for the device batcher's quiescence (in either placement).
        """
        ...


@dataclass
class JobResult:
    """What a finished job hands back. Everything is JSON so the ledger never stores a pickle."""

    conversation: Mapping[str, JSON]  # recipe + transcript
    tokens_generated: int = 0
    analysis: JSON = None
    # A job whose conversation finished but whose analyzer failed returns its conversation AND this error; the
    # scheduler records the job as failed with the conversation kept, and a rerun re-runs only the analyzer.
    analysis_error: BaseException | None = None


@runtime_checkable
class Job(Protocol):
    """One conversation to run. Must pickle cheaply (lazy participants: no weights)."""

    needs_device: bool  # True when any participant is a local model; False → in-process worker

    async def run(self, ctx: JobContext) -> JobResult: ...

    def is_transient(self, exc: BaseException) -> bool:
        """Whether a failure of this job is worth retrying (bounded; attempts are recorded)."""
        ...


@dataclass
class JobSpec:
    """One job of a lineup.

    ``input_fp`` is what the job is asked, as an opaque string that is equal exactly when the question is
    (interlens: digests of the data row, the resolved prompts, the seed, the mode and the recipe). It is
    recorded with the job; a rerun into the same ``out_dir`` that would ask a recorded job something else is
    refused (see ``_resume``). None: the job is not compared (a caller that does not fingerprint its jobs).
    """

    job_id: str  # e.g. "rollout_0003", "gpqa/row_00012", "pair_7b"
    lineup: str  # the lineup (conversation name) it belongs to
    seed: int
    job: Job
    row_index: int | None = None
    input_fp: str | None = None


@dataclass
class LineupSpec:
    """One conversation recipe expanded to its jobs. ``jobs`` is pulled lazily (data is streamed).

    ``jobs`` may be an Iterable that makes a fresh pass each time it is iterated (a list, or an object whose
    ``__iter__`` expands the jobs again): then a rerun iterates it once more before any job starts, up to the
    jobs the ledger already holds, to compare what they are asked. An Iterator (a generator) can be read only
    once: its jobs are compared as they are pulled, and a mismatch stops the run before that job starts.
    ``explain_input(spec, recorded_fp)`` says, in lines, how what ``spec`` is asked now differs from the
    recorded fingerprint (for the refusal message; None: the fingerprints are shown as they are).
    """

    name: str
    fingerprint: str  # stable hash of the recipe: a rerun with another fingerprint is refused
    jobs: Iterable[JobSpec]
    n_jobs: int | None = None  # when known, for progress
    describe: Mapping[str, JSON] = field(default_factory=dict)  # recipe summary, to explain a mismatch
    explain_input: Callable[[JobSpec, str], list[str]] | None = None
    #: The ``engine_key`` of every engine its jobs use. Once every job of this lineup has ended, an engine no
    #: remaining lineup names is evicted from the workers (``_eviction``). None: unknown (its jobs may use
    #: any engine), so nothing is evicted while this lineup remains.
    engine_keys: frozenset[Hashable] | None = None
