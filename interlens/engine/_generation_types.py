"""The records that cross the engine's boundary: one row asked of :class:`~._generation.LocalEngine`
and what it answers.

They live apart from the engine because they are what the participants, the batcher and the tests build and
read, while the engine's decode machinery is private. A request validates itself on construction, so a bad
value fails in the participant that built it, not deep inside a batch shared with others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .._core import ConfigurationError, ConfigurationTypeError
from ..interp import Captured, CaptureSpec, SteeringSpec, steering_from
from ._sampling import SamplingSettings

__all__ = ["FINISH_REASONS", "GenerationRequest", "GenerationResult", "ScoreRequest", "ScoreResult"]

FINISH_REASONS = ("eos", "length", "stop")


@dataclass(frozen=True, init=False)
class GenerationRequest:
    """One row of a batched generate: a tokenized prompt and how to continue it (``sampling=``, the ONE
    record of the sampling settings, held whole: ``ChatEngine`` passes the participant's on, and the engine
    reads ``request.sampling.temperature`` and the rest from it, so a new setting needs no edit here).
    Keyword-only past the prompt, so no setting is taken by position. Validated on construction
    (``SamplingSettings.check``), so a bad value fails in the participant that built it, not deep inside a
    batch shared with others.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingSettings
    reuse_key: Hashable | None  # KV reuse stream across turns (single-row requests); None = no reuse
    capture: CaptureSpec | None  # record activations of this row (it then runs alone, from scratch)
    steering: tuple[SteeringSpec, ...]  # steer this row (it then runs alone, from scratch)
    # give each generated token's log-probabilities in the result (the tokens do not change)
    record_logprobs: bool

    def __init__(
        self,
        prompt_ids: Sequence[int],
        *,
        sampling: SamplingSettings,
        reuse_key: Hashable | None = None,
        capture: CaptureSpec | None = None,
        steering: Sequence[SteeringSpec] = (),
        record_logprobs: bool = False,
    ) -> None:
        if not isinstance(sampling, SamplingSettings):
            raise ConfigurationTypeError(
                f"GenerationRequest(sampling={sampling!r}): must be a SamplingSettings record; build one "
                "with SamplingSettings(max_new_tokens=..., temperature=..., ...)"
            )
        # Accept any sequence of prompt ids (a list is the natural thing to pass), store a tuple.
        object.__setattr__(self, "prompt_ids", tuple(prompt_ids))
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "reuse_key", reuse_key)
        object.__setattr__(self, "capture", _capture_arg(capture, "GenerationRequest"))
        object.__setattr__(self, "steering", steering_from(steering, where="GenerationRequest"))
        if not isinstance(record_logprobs, bool):
            raise ConfigurationTypeError(
                f"GenerationRequest(record_logprobs={record_logprobs!r}): must be True or False"
            )
        object.__setattr__(self, "record_logprobs", record_logprobs)
        _check_ids(self.prompt_ids, "GenerationRequest", "prompt_ids", empty_ok=False)
        sampling.check("GenerationRequest")
        if self.reuse_key is not None:
            try:
                hash(self.reuse_key)
            except TypeError:
                raise ConfigurationError(
                    f"GenerationRequest(reuse_key={self.reuse_key!r}): reuse_key must be hashable "
                    "(a string or a tuple such as (job_id, participant))."
                ) from None

    def capped(self, max_new_tokens: int) -> GenerationRequest:
        """This request with at most ``max_new_tokens`` new tokens (the cap at the model's context)."""
        cap = min(max_new_tokens, self.sampling.max_new_tokens)
        sampling = dataclasses.replace(self.sampling, max_new_tokens=cap)
        return GenerationRequest(
            self.prompt_ids,
            sampling=sampling,
            reuse_key=self.reuse_key,
            capture=self.capture,
            steering=self.steering,
            record_logprobs=self.record_logprobs,
        )

    @property
    def interp(self) -> bool:
        """Whether hooks run for this row (capture or steering): such a row runs alone, from scratch."""
        return self.capture is not None or bool(self.steering)


@dataclass
class GenerationResult:
    """What one row produced, plus how it was produced (recorded in the turn's metadata)."""

    token_ids: list[int]  # generated tokens, including the end-of-turn token when one was produced
    text: str  # decoded, special tokens skipped, cut BEFORE a matched stop string
    n_tokens: int  # == len(token_ids): tokens actually generated for this row
    finish_reason: str  # "eos" | "length" | "stop"
    prompt_tokens: int
    seconds: float  # wall time of the batched call this row was part of
    batch_size: int  # rows in that batched call
    # leading prompt tokens whose KV was computed once for several rows of the batch (identical prompts: all
    # but the last token; a shared prefix of a data rollout: that prefix); 0 when nothing was shared
    shared_prefix_tokens: int
    kv_reused_tokens: int  # prompt tokens whose KV came from this stream's previous turn (0 if none)
    captured: Captured | None = None  # the row's activations, when its request asked for a capture
    # the engine's batch-invariance self-test verdict (None: not run, i.e. no deterministic batch yet)
    batch_invariant: bool | None = None
    # whether the row's tokens may depend on its batch mates: co-stepped on a plain or reused-prefix batch
    # (a deterministic row co-stepped on the batch-invariant slot layout does not); the turn's "batched"
    batch_dependent: bool = False
    # per generated token (with ``record_logprobs``, else None), float32: its log-probability under the
    # model's own distribution (the log-softmax of the logits: temperature 1, every token), as a
    # teacher-forced ``LocalEngine.score`` of the same tokens computes it ...
    model_logprobs: list[float] | None = None
    # ... and under the distribution it was drawn from (temperature and nucleus applied; 0.0 for a greedy
    # row, whose pick was certain): what a policy-gradient trainer calls the sampler's log-probabilities
    sampling_logprobs: list[float] | None = None
    # with ``record_logprobs``: the prompt ids the row was generated from (else None)
    prompt_ids: tuple[int, ...] | None = None

    @property
    def shared_prefill(self) -> bool:
        """Whether part of the prompt was prefilled once for several rows."""
        return self.shared_prefix_tokens > 0


@dataclass(frozen=True, init=False)
class ScoreRequest:
    """One teacher-forced row for ``LocalEngine.score``: how likely ``continuation_ids`` follows the prompt.

    An empty continuation is accepted here and answered in place with a ``ConfigurationError`` by the
    engine, like the other problems of one row among many.
    """

    prompt_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]
    capture: CaptureSpec | None
    steering: tuple[SteeringSpec, ...]

    def __init__(
        self,
        prompt_ids: Sequence[int],
        continuation_ids: Sequence[int],
        *,
        capture: CaptureSpec | None = None,
        steering: Sequence[SteeringSpec] = (),
    ) -> None:
        object.__setattr__(self, "prompt_ids", _ids_arg(prompt_ids, "prompt_ids"))
        object.__setattr__(self, "continuation_ids", _ids_arg(continuation_ids, "continuation_ids"))
        object.__setattr__(self, "capture", _capture_arg(capture, "ScoreRequest"))
        object.__setattr__(self, "steering", steering_from(steering, where="ScoreRequest"))
        _check_ids(self.prompt_ids, "ScoreRequest", "prompt_ids", empty_ok=False)
        _check_ids(self.continuation_ids, "ScoreRequest", "continuation_ids", empty_ok=True)


@dataclass(frozen=True)
class ScoreResult:
    """``logprobs[i] = log P(continuation_ids[i] | prompt + continuation_ids[:i])`` (float32 log-softmax)."""

    continuation_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    captured: Captured | None  # rows aligned with continuation_ids (prompt rows first when spec.prompt)
    prompt_tokens: int
    seconds: float  # wall time of this row's forward pass


def _ids_arg(ids: Any, name: str) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ConfigurationTypeError(
            f"ScoreRequest({name}={ids!r}): pass a sequence of token ids (a list or tuple of ints), e.g. "
            "tokenizer(text).input_ids"
        )
    return tuple(ids)


def _check_ids(ids: tuple[int, ...], who: str, name: str, *, empty_ok: bool) -> None:
    if not ids and not empty_ok:
        raise ConfigurationError(
            f"{who}({name}=()): the prompt is empty; pass at least one token id "
            "(render the conversation with the chat template first)."
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ConfigurationError(
            f"{who}({name}=...): every {name[:-1].replace('_', ' ')} must be a non-negative int; "
            "pass the token ids the tokenizer returned (e.g. tokenizer(text).input_ids)."
        )


def _capture_arg(capture: Any, who: str) -> CaptureSpec | None:
    """The spec checked and normalised as ``CaptureSpec.build`` does (a spec built directly skipped that:
    an unknown site or a repeated layer must not reach the hooks)."""
    if capture is None:
        return None
    if not isinstance(capture, CaptureSpec):
        raise ConfigurationTypeError(
            f"{who}(capture={capture!r}): must be a CaptureSpec or None; build one with "
            "CaptureSpec.build(sites=..., layers=...)"
        )
    try:
        return CaptureSpec.build(
            sites=capture.sites, layers=capture.layers, prompt=capture.prompt, offload=capture.offload
        )
    except ConfigurationError as exc:
        raise type(exc)(f"{who}: {exc}") from None
