"""The records that cross the engine's boundary: one row asked of :class:`~interlens._generation.LocalEngine`
and what it answers.

They live apart from the engine because they are what the participants, the batcher and the tests build and
read, while the engine's decode machinery is private. A request validates itself on construction, so a bad
value fails in the participant that built it, not deep inside a batch shared with others.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from interlens._exceptions import ConfigurationError
from interlens._sampling import SamplingSettings

__all__ = ["FINISH_REASONS", "GenerationRequest", "GenerationResult"]

FINISH_REASONS = ("eos", "length", "stop")


@dataclass(frozen=True, init=False)
class GenerationRequest:
    """One row of a batched generate: a tokenized prompt and how to continue it (``sampling=``, as
    ``ChatEngine`` passes the participant's on, or the settings as keywords). Validated on construction, so
    a bad value fails in the participant that built it, not deep inside a batch shared with others.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingSettings
    reuse_key: Hashable | None  # KV reuse stream across turns (single-row requests); None = no reuse

    def __init__(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        reuse_key: Hashable | None = None,
        *,
        sampling: SamplingSettings | None = None,
    ) -> None:
        if sampling is None:  # a missing max_new_tokens fails check() below: it must be an int >= 1
            sampling = SamplingSettings(max_new_tokens, temperature, top_p, stop, seed)  # type: ignore[arg-type]
        # Accept any sequence of prompt ids (a list is the natural thing to pass), store a tuple.
        object.__setattr__(self, "prompt_ids", tuple(prompt_ids))
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "reuse_key", reuse_key)
        if not self.prompt_ids:
            raise ConfigurationError(
                "GenerationRequest(prompt_ids=()): the prompt is empty; pass at least one token id "
                "(render the conversation with the chat template first)."
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prompt_ids):
            raise ConfigurationError(
                "GenerationRequest(prompt_ids=...): every prompt id must be a non-negative int; "
                "pass the token ids the tokenizer returned (e.g. tokenizer(text).input_ids)."
            )
        sampling.check("GenerationRequest")
        if self.reuse_key is not None:
            try:
                hash(self.reuse_key)
            except TypeError:
                raise ConfigurationError(
                    f"GenerationRequest(reuse_key={self.reuse_key!r}): reuse_key must be hashable "
                    "(a string or a tuple such as (job_id, participant))."
                ) from None

    @property  # what the sampler and the decode loop read (``_sampling._Settings``)
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop

    @property
    def seed(self) -> int | None:
        return self.sampling.seed


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
    shared_prefill: bool  # the prompt was prefilled once for several identical rows
    reused_prefix_tokens: int  # prompt tokens whose KV came from this stream's previous turn (0 if none)
