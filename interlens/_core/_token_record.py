"""A generated turn's tokens as training data: their ids and, per token, two log-probabilities (issue 27).

A turn's record rides in its message's metadata (``metadata["tokens"]``), so it travels wherever the turn
goes (the ledger, ``save``, a worker's result) with no table or file of its own. Stored compactly: each array
is little-endian binary (ids as uint16 where every id fits, else uint32; log-probabilities as float32: the
engine's own precision), base64 in the JSON, about 5.3 characters a float instead of ~20 for a JSON float;
the sampling log-probabilities are not stored where they say nothing new (``"certain"``: a greedy turn's,
all 0.0; ``"model"``: a turn sampled at temperature 1 with no nucleus, equal to the model's). Decoded only
when asked (:attr:`Message.tokens`).

A turn's prompt holds the whole conversation so far, so stored whole the prompts grow with the square of the
turns. Where a transcript's turns are written (:func:`compact_turns`: ``Transcript.to_json``, and each turn
a rollout job records in the ledger), a record's prompt ids are stored as a difference from the same
speaker's previous recorded turn: how many leading ids of that turn's prompt + generated ids it keeps, then
its own. Every reader of a
transcript's turns in order expands them back (:func:`expand_turns`: ``Transcript.from_json``, a job's
replay, the token export), so in memory a record always holds its whole prompt. Sizes measured on
SmolLM2-135M: benchmarks/RESULTS.md.

A hosted model's turn (an ``APIParticipant`` with ``record_tokens=True``) is recorded from what its provider
reported: the tokens as text (OpenAI's chat completions give no ids), each one's log-probability as the
provider computed it, and the provider's name (``reported_by``); no sampling log-probabilities and no
prompt ids. Its JSON is format 2, so an interlens that predates it says it cannot read it; a local turn's
stays format 1.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._exceptions import ConfigurationError

__all__ = ["TOKENS_KEY", "TOKENS_TABLE", "TokenRecord", "common_prefix", "compact_turns", "expand_turns"]

#: The message metadata key a turn's record is stored under.
TOKENS_KEY = "tokens"
#: A ledger (schema 5-6) keeps records in this table and, in their place, a marker
#: ``{"stored": TOKENS_TABLE}`` (``interlens.store``'s ``_token_rows``); :attr:`Message.tokens` then asks the
#: message's ``token_source``.
TOKENS_TABLE = "turn_tokens"
_FORMAT = 1  # a local turn's record
_PROVIDER_FORMAT = 2  # a hosted model's turn: token texts and the provider's log-probabilities


@dataclass(frozen=True)
class TokenRecord:
    """One generated turn's tokens, aligned: ``ids[i]`` was sampled with ``model_logprobs[i]`` under the
    model's own distribution (the log-softmax of its logits: temperature 1, every token: what a
    teacher-forced pass of the same view gives) and ``sampling_logprobs[i]`` under the distribution it was
    drawn from (temperature and nucleus applied; 0.0 for a greedy turn, whose picks were certain). ``ids``
    include the end-of-turn token when the turn ended on one; they decode to the turn's text.
    ``prompt_ids``: the speaker's view as the model saw it (chat template and generation prompt
    included).

    A hosted model's turn (``reported_by``: its provider's name) has no ids: ``texts[i]`` is its i-th token as
    the provider wrote it (they join to the turn's text) and ``model_logprobs[i]`` that token's
    log-probability as the provider reported it (OpenAI's, and vLLM's by default, are the model's own
    distribution, before temperature and nucleus: docs/rollouts.md); ``sampling_logprobs`` is None (not
    reported) and ``prompt_ids`` empty."""

    ids: tuple[int, ...]
    model_logprobs: tuple[float, ...]
    sampling_logprobs: tuple[float, ...] | None
    prompt_ids: tuple[int, ...] = ()
    texts: tuple[str, ...] | None = None
    reported_by: str | None = None

    def __post_init__(self) -> None:
        if self.reported_by is not None:
            aligned = self.texts is not None and len(self.texts) == len(self.model_logprobs)
            if not aligned or self.ids or self.prompt_ids or self.sampling_logprobs is not None:
                raise ConfigurationError(
                    "TokenRecord: a provider's record (reported_by set) has texts aligned with "
                    "model_logprobs, and no ids, prompt_ids or sampling_logprobs"
                )
            return
        sampling = self.sampling_logprobs
        if (
            self.texts is not None
            or sampling is None
            or not len(self.ids) == len(self.model_logprobs) == len(sampling)
        ):
            raise ConfigurationError(
                "TokenRecord: ids, model_logprobs and sampling_logprobs must align (texts is for a "
                f"provider's record), got lengths {len(self.ids)}, {len(self.model_logprobs)} and "
                f"{None if sampling is None else len(sampling)}"
            )

    @classmethod
    def build(
        cls,
        ids: Sequence[int],
        model_logprobs: Sequence[float],
        sampling_logprobs: Sequence[float],
        prompt_ids: Sequence[int] = (),
    ) -> TokenRecord:
        """From the engine's lists (the log-probabilities rounded to float32, as stored)."""
        return cls(tuple(ids), _float32(model_logprobs), _float32(sampling_logprobs), tuple(prompt_ids))

    @classmethod
    def reported(cls, provider: str, texts: Sequence[str], logprobs: Sequence[float]) -> TokenRecord:
        """A hosted model's turn: its tokens' texts and their log-probabilities as ``provider`` reported
        them (rounded to float32, as stored)."""
        return cls((), _float32(logprobs), None, (), tuple(texts), provider)

    def to_json(self) -> dict[str, Any]:
        if self.reported_by is not None:
            return {
                "format": _PROVIDER_FORMAT,
                "reported_by": self.reported_by,
                "texts": list(self.texts or ()),
                "model_logprobs": _pack("f", self.model_logprobs),
            }
        code = "H" if all(i < 2**16 for i in (*self.ids, *self.prompt_ids)) else "I"
        sampling: str
        assert self.sampling_logprobs is not None  # __post_init__: a local record has them
        if not any(self.sampling_logprobs):
            sampling = _CERTAIN
        elif self.sampling_logprobs == self.model_logprobs:
            sampling = _MODEL
        else:
            sampling = _pack("f", self.sampling_logprobs)
        return {
            "format": _FORMAT,
            "ids": _pack(code, self.ids),
            "id_bytes": 2 if code == "H" else 4,
            "model_logprobs": _pack("f", self.model_logprobs),
            "sampling_logprobs": sampling,
            "prompt_ids": _pack(code, self.prompt_ids),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TokenRecord:
        form = data.get("format") if isinstance(data, Mapping) else None
        if form == _PROVIDER_FORMAT:
            model = tuple(_unpack("f", data["model_logprobs"]))
            return cls((), model, None, (), tuple(data["texts"]), str(data["reported_by"]))
        if form != _FORMAT:
            raise ConfigurationError(
                f"a turn's token record is an object of format {_FORMAT} or {_PROVIDER_FORMAT} (ids or "
                f"token texts, and log-probability arrays in base64), got {str(data)[:200]}: written by a "
                "newer interlens? Upgrade to read it"
            )
        if isinstance(data.get("prompt_ids"), Mapping):
            raise ConfigurationError(
                "this turn's token record stores its prompt ids as a difference from its speaker's previous "
                "turn (as the ledger keeps them): read the turn through its transcript (Transcript.from_json "
                "of the turns in order, or a RunReport), not on its own"
            )
        model = tuple(_unpack("f", data["model_logprobs"]))
        sampling = data["sampling_logprobs"]
        if sampling == _CERTAIN:
            sampled: tuple[float, ...] = (0.0,) * len(model)
        elif sampling == _MODEL:
            sampled = model
        else:
            sampled = tuple(_unpack("f", sampling))
        code = "H" if data["id_bytes"] == 2 else "I"
        ids, prompt = tuple(_unpack(code, data["ids"])), tuple(_unpack(code, data["prompt_ids"]))
        return cls(ids, model, sampled, prompt)


#: What ``sampling_logprobs`` holds instead of an array where the array would say nothing new.
_CERTAIN = "certain"  # every pick certain (a greedy turn): all 0.0
_MODEL = "model"  # drawn from the model's own distribution (temperature 1, no nucleus): the model's


def _float32(values: Sequence[float]) -> tuple[float, ...]:
    return tuple(array("f", values))


def _pack(code: str, values: Sequence[Any]) -> str:
    packed = array(code, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _unpack(code: str, text: str) -> array[Any]:
    values = array(code)
    values.frombytes(base64.b64decode(text))
    if sys.byteorder == "big":
        values.byteswap()
    return values


def compact_turns(turns: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A transcript's turns (messages' JSON in order, records whole) with each record's prompt ids as a
    difference from its author's previous recorded turn (``keep`` leading ids of that turn's prompt +
    generated ids, then its own ``ids``); a turn without a record, or its author's first, unchanged."""

    def difference(
        data: Mapping[str, Any], code: str, base: tuple[int, ...] | None, _: Any
    ) -> tuple[Any, ...]:
        prompt = tuple(_unpack(code, data["prompt_ids"]))
        if base is None:
            return data["prompt_ids"], prompt
        keep = common_prefix(base, prompt)
        return {"keep": keep, "ids": _pack(code, prompt[keep:])}, prompt

    return _rewrite_prompts(turns, difference)


def expand_turns(turns: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``turns`` (messages' JSON, a transcript's in order, or its first ones) with every record's prompt ids
    whole again: the inverse of :func:`compact_turns`."""

    def whole(
        data: Mapping[str, Any], code: str, base: tuple[int, ...] | None, author: Any
    ) -> tuple[Any, ...]:
        stored = data["prompt_ids"]
        if not isinstance(stored, Mapping):
            return stored, tuple(_unpack(code, stored))
        if base is None:
            raise ConfigurationError(
                f"turn by {author!r}: its token record's prompt ids are a difference from an earlier turn of "
                "its speaker that is not in the turns given; expand a transcript's turns from its first"
            )
        prompt = (*base[: stored["keep"]], *_unpack(code, stored["ids"]))
        return _pack(code, prompt), prompt

    return _rewrite_prompts(turns, whole)


def _rewrite_prompts(
    turns: Iterable[Mapping[str, Any]],
    rewrite: Callable[[Mapping[str, Any], str, tuple[int, ...] | None, Any], tuple[Any, ...]],
) -> list[dict[str, Any]]:
    """``turns`` with each record's ``prompt_ids`` as ``rewrite(record's JSON, id code, base, author)``
    stores it (it returns that and the whole prompt); ``base``: its author's previous recorded turn's
    prompt + generated ids, None for the author's first. Only ids are decoded, never the log-probabilities."""
    out: list[dict[str, Any]] = []
    latest: dict[Any, tuple[int, ...]] = {}  # per author: its latest record's prompt + generated ids
    for turn in turns:
        data = (turn.get("metadata") or {}).get(TOKENS_KEY)
        if data is None or "prompt_ids" not in data:  # no record, or a provider's (no ids)
            out.append(dict(turn))
            continue
        author = turn.get("author")
        code = "H" if data["id_bytes"] == 2 else "I"
        stored, prompt = rewrite(data, code, latest.get(author), author)
        latest[author] = (*prompt, *_unpack(code, data["ids"]))
        record = {**data, "prompt_ids": stored}
        out.append({**turn, "metadata": {**turn["metadata"], TOKENS_KEY: record}})
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share: what a later prompt kept of an earlier sequence."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
