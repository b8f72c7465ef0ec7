"""The sampling record, :class:`SamplingSettings`: how one local turn is sampled, from the participant to
the engine's sampler, held whole all the way and checked in one place; and the special ids the decode loop
needs (which tokens end a turn, which pads a prompt).

The sampler that reads the record is ``_sampler.Sampler``, a pipeline of parts (``_sampler_parts``): one part
per setting, so a new setting is a field here (with its rule in :meth:`SamplingSettings.check`) and a part
there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .._core import ConfigurationTypeError, check_int, check_number, type_name

__all__ = ["SamplingSettings", "eos_ids", "pad_id"]


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How one local turn is sampled: the ONE record of these settings, from the participant that holds its
    own (``ModelParticipant.sampling``) through its ``ChatRequest`` to the engine's ``GenerationRequest``
    (each holds it; none copies its fields). Keyword-only, so a new field never shifts another's place.

    Unvalidated on its own: a participant's spent budget is a ``max_new_tokens`` of 0, answered without the
    engine. :meth:`check` holds the rules, and is called where a record is made from a user's values: by
    ``ModelParticipant`` (its settings) and by the record that goes to the engine (``GenerationRequest``).

    A new field needs a default that leaves sampling as it was: recipes written before it keep their
    fingerprints (:meth:`to_json` writes it only when set), and tests/test_fingerprints.py pins one.
    """

    max_new_tokens: int
    temperature: float = 1.0  # <= 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # generation of the row ends once its text contains one of these
    seed: int | None = None  # the row's own random stream: its draws do not depend on its batch mates

    def __post_init__(self) -> None:
        # Accept any sequence of stop strings (a list is the natural thing to pass), store a tuple; one string
        # is refused by check() with its fix, so it is kept as given.
        if isinstance(self.stop, Sequence) and not isinstance(self.stop, tuple | str):
            object.__setattr__(self, "stop", tuple(self.stop))
        # A float setting given as an int is stored as a float: recipe JSON (and so its fingerprint) has
        # always written temperature=1 as 1.0. A bool is left for check() to refuse.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and type(value) is int:
                object.__setattr__(self, f.name, float(value))

    def settings(self) -> dict[str, Any]:
        """The participant-level settings by name (every field but the per-turn ``seed``): what
        ``ModelParticipant`` passes back to its constructor when copied (``set``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _PER_TURN}

    def to_json(self) -> dict[str, Any]:
        """The participant's settings as recipe JSON (saved and fingerprinted). The fields of the first
        release are always written; a field added since only when it is set away from its default, so a
        recipe that does not use it keeps the fingerprint it had (a rerun of an old ledger resumes)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _PER_TURN or (f.name not in _ALWAYS_WRITTEN and value == f.default):
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def check(self, who: str, *, one_stop_string: bool = False) -> None:
        """Raise a ConfigurationError naming ``who(setting=value)``, the rule and its fix, for a setting the
        decode loop cannot use: the ONE place these rules live (``GenerationRequest`` and
        ``ModelParticipant`` both call it). ``who`` is the call to name: ``"GenerationRequest"``, or one
        with its own arguments such as ``"ModelParticipant(name='a')"`` (the setting is added inside).
        ``one_stop_string``: the caller takes one stop string as a list of one (the participant does), which
        only changes how the rule is worded."""
        check_int(
            self.max_new_tokens, what=_named(who, "max_new_tokens", self.max_new_tokens), low=1, fix=_CAP_FIX
        )
        check_number(
            self.temperature,
            what=_named(who, "temperature", self.temperature),
            low=0,
            fix="a finite number: 0 = greedy, 1 = as trained",
        )
        check_number(
            self.top_p,
            what=_named(who, "top_p", self.top_p),
            low=0,
            high=1,
            open_low=True,
            fix="1.0 = no nucleus cut-off",
        )
        where = _named(who, "stop", self.stop)
        if isinstance(self.stop, str):
            raise ConfigurationTypeError(
                f"{where} must be a list of strings, not one string; write stop=({self.stop!r},)"
            )
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            allowed = "a str or a list" if one_stop_string else "a list"
            raise ConfigurationTypeError(
                f"{where} must be {allowed} of non-empty str, got {self.stop!r}; e.g. stop=['###']"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigurationTypeError(
                f"{_named(who, 'seed', self.seed)} must be an int or None, got {type_name(self.seed)}; "
                "None draws from torch's global random state"
            )


def _named(who: str, setting: str, value: Any) -> str:
    """``who`` with the setting among its arguments, then the setting's name: the start of a message,
    ``GenerationRequest(top_p=0.0): top_p`` or ``ModelParticipant(name='a', top_p=0.0): top_p``."""
    arg = f"{setting}={value!r}"
    call = f"{who[:-1]}, {arg})" if who.endswith(")") else f"{who}({arg})"
    return f"{call}: {setting}"


#: The fix named for a bad ``max_new_tokens``.
_CAP_FIX = "the output cap per turn, e.g. 256"


#: Set per turn by the conversation (``turn_seed``), not a participant's setting: never in its JSON.
_PER_TURN = frozenset({"seed"})
#: The settings every recipe has written since the first release, at their defaults too.
_ALWAYS_WRITTEN = frozenset({"max_new_tokens", "temperature", "top_p", "stop"})


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a turn: the generation config's (end-of-turn tokens) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
            break
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def pad_id(model: Any, tokenizer: Any, eos: frozenset[int]) -> int:
    """Any valid id works for padding (pads are masked); prefer the declared pad token."""
    for value in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(getattr(model, "generation_config", None), "pad_token_id", None),
    ):
        if isinstance(value, int):
            return value
    return min(eos) if eos else 0
