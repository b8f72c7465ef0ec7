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
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from interlens.scheduler import JobContext

__all__ = [
    "CURRENT_JOB",
    "collecting_samples",
    "in_job",
    "record_sample",
    "seed_of_turn",
    "turn_seed",
    "turns_on_this_seed_rule",
]

log = logging.getLogger("interlens")

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
    the job's rollout seed, the turn index) alone. Job ``i`` of a rollout with ``seed=s`` has rollout seed
    ``s + i`` (the spec: "per-rollout seeds are seed, seed+1, ..."), so it draws exactly the random numbers of
    job 0 of ``seed=s + i``; and the lineups of one ``interlens.run`` share their random numbers job by job:
    common random numbers across conditions, what a paired comparison wants (the conditions' differences are
    not drowned in sampling noise). Two turns never share a stream, and rerunning the same recipe with the
    same ``seed=`` draws the same random numbers for every turn. What that buys depends on the mode:

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
    result) a participant with ``seed=`` is seeded the same way (rollout seed 0: a live run draws what job 0
    of ``seed=0`` draws); one without a seed draws from torch's global RNG.

    Each seeded turn records the seed it drew from (``metadata["seed"]``, see ``Participant.recorded_seed``),
    which is how a resumed job tells turns committed under this rule from turns an older release committed
    (streams derived from the job id as well): see ``Conversation.replay``.
    """
    if CURRENT_JOB.get() is None and getattr(participant, "seed", None) is None:
        return None
    return seed_of_turn(participant, conv.seed, conv.generated_turns, sample=sample)


def seed_of_turn(
    participant: object, rollout_seed: int | None, turn: int, *, sample: int | None = None
) -> int:
    """The stream seed of generated turn ``turn`` (0-based) of ``participant`` in a conversation of rollout
    seed ``rollout_seed``: what :func:`turn_seed` gives inside a job (the rule, in one place)."""
    parts: list[int | str] = [getattr(participant, "seed", None) or 0, rollout_seed or 0, turn]
    if sample is not None:
        parts += ["sample", sample]
    return _mix(*parts)


def turns_on_this_seed_rule(
    committed: Sequence[Any], speakers: Mapping[str, Any], rollout_seed: int | None, first: int, *, job: str
) -> int:
    """How many of a job's ``committed`` messages (generated turns ``first``, ``first + 1``, ...) a resumed
    job may continue from: all of them, unless a local speaker's turn did not draw from the stream
    :func:`seed_of_turn` gives it (a ledger an earlier release left half done mixed the job's id into each
    stream); then the turns before it, with a warning (see ``Conversation.replay``)."""
    for index, message in enumerate(committed):
        speaker = speakers.get(message.author)
        if speaker is None or not speaker.needs_device:
            continue
        drawn = speaker.recorded_seed(seed_of_turn(speaker, rollout_seed, first + index))
        if message.metadata.get("seed") != drawn:
            log.warning(
                "job %s: committed turn %d (%s) did not draw from the random stream this release gives it "
                "(an earlier release mixed the job's id into each stream): it and the %d turn(s) after it "
                "are generated again, the %d before it kept, so that the conversation is the one its seed "
                "gives",
                job,
                index,
                message.author,
                len(committed) - index - 1,
                index,
            )
            return index
    return len(committed)
