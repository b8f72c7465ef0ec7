"""The per-job context: which rollout job (if any) is running in this task, and the seed of its next turn.

A leaf module on purpose. Everything that generates a turn needs it: the conversation (to seed a turn), the
participants (a turn inside a job goes through the scheduler's batcher or API gateway instead of a direct
call), the sync bridge (an analyzer's ``conv.sample`` goes back to the job's loop). Kept here, below all of
them, it ties none of them to another: it imports nothing of the project (the scheduler's protocol only for
type checking).
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from interlens.scheduler import JobContext

__all__ = ["CURRENT_JOB", "collecting_samples", "in_job", "record_sample", "turn_seed"]

CURRENT_JOB: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar(
    "interlens_current_job", default=None
)
"""Set by a rollout job while it runs (see :func:`in_job`): turns then go through the scheduler's batcher
(local models) or API gateway (hosted models) instead of a direct call. ``None`` in live use."""


@contextmanager
def in_job(ctx: JobContext) -> Iterator[None]:
    """Run the body as job ``ctx``: its turns, samples and analyzer all see it, and nothing outside does."""
    token = CURRENT_JOB.set(ctx)
    try:
        yield
    finally:
        CURRENT_JOB.reset(token)


_SAMPLES: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "interlens_samples", default=None
)


@contextmanager
def collecting_samples() -> Iterator[list[dict[str, Any]]]:
    """Collect the metadata of every ``conv.sample`` made in the body (a rollout job's analyzer).

    Why: a sample is not a turn, so no turns row records what it cost; the job stores this list with its
    result, and the run's usage and API budget count it (an LLM judge is often the run's biggest bill)."""
    samples: list[dict[str, Any]] = []
    token = _SAMPLES.set(samples)
    try:
        yield samples
    finally:
        _SAMPLES.reset(token)


def record_sample(metadata: dict[str, Any]) -> None:
    """Note a sample's metadata for the collecting job (a no-op outside :func:`collecting_samples`)."""
    samples = _SAMPLES.get()
    if samples is not None:
        samples.append(dict(metadata))


class _Seeded(Protocol):
    """What :func:`turn_seed` reads of a conversation (kept a protocol so this module stays a leaf)."""

    @property
    def seed(self) -> int | None: ...

    @property
    def generated_turns(self) -> int: ...


def _mix(*parts: int | str) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def turn_seed(conv: _Seeded, participant: object, *, sample: int | None = None) -> int | None:
    """The sampling seed of the next turn of ``participant`` in ``conv``, or None for torch's global RNG.

    Inside a rollout EVERY local turn is seeded, in both execution modes, from (participant ``seed=`` or 0,
    the rollout seed of this job, the job's id, the turn index): two jobs, two lineups of one ``run`` or two
    turns never share a random stream, and rerunning the same recipe with the same ``seed=`` draws the same
    random numbers for every turn. What that buys depends on the mode:

    * ``batched=False`` (deterministic): each turn is generated alone (or co-stepped where the engine
      passed its batch-invariance self-test: bitwise the same logits), so a rollout is token-identical on
      the same hardware and software, whatever else runs beside it.
    * batched (the default): the turn's random draws are the same, but its logits come from a batched
      forward pass whose other rows (and their padding) depend on timing, and a turn that happens to run
      alone may continue its stream's kept KV cache (logits a few ulps off a fresh prefill). The tokens
      are reproducible only where the forward pass is batch-invariant, i.e. gives each row bitwise the same
      logits whatever its batch mates; with stock kernels it is not, on CPU (a matmul of another row count
      rounds differently; left padding moves keys to other vector lanes) or GPU (kernels pick reduction
      orders by batch shape). So a rerun is reproducible in distribution only: same seeds, same sampling
      law, possibly different tokens (deterministic mode's slot layout is what makes co-stepping exact).

    ``sample`` numbers the ``conv.sample()`` calls made on this conversation object (1, 2, ...): each gets a
    stream of its own, so an analyzer that samples five times gets five draws, the same five on a rerun,
    and a sample never shifts the seed of a turn. Outside a rollout (``conv.run()``, ``conv.sample()`` on a
    result) a participant with ``seed=`` is seeded the same way without a job id; one without a seed draws
    from torch's global RNG.
    """
    job = CURRENT_JOB.get()
    pinned = getattr(participant, "seed", None)
    if job is None and pinned is None:
        return None
    parts: list[int | str] = [pinned or 0, conv.seed or 0, job.job_id if job is not None else ""]
    parts.append(conv.generated_turns)
    if sample is not None:
        parts += ["sample", sample]
    return _mix(*parts)
