"""``APISettings``: how one hosted turn is asked for, the ONE record of these settings.

It goes whole from the participant that holds it (``APIParticipant.settings``) into every request it builds
(``APIRequest.settings``, the turn's output cap and seed put in), and each provider's ``body()`` reads the
fields it supports from there. Nothing copies its fields one by one: the participant's recipe JSON, its
fingerprint (``describe``), its batch grouping and its error messages all read the record, so adding a hosted
setting is one field here (with its rule in :meth:`APISettings.check`), one keyword on ``APIParticipant``,
and its line in the ``body()`` of each provider that takes it (ARCHITECTURE.md, "add a hosted setting").
The anchor is inspect_ai's ``GenerateConfig``: one frozen record of what a generation call asks for.

A field says by its metadata how it is written: ``_HOW`` (how a turn is fetched, not what it says: kept in
the recipe, out of the fingerprint), ``_PER_TURN`` (set per request, never a participant's setting), and
``_FIRST_RELEASE`` (always written; every other field only when set away from its default, so a recipe that
does not use a newer setting keeps the JSON and fingerprint it had, and an old ledger resumes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .._core import ConfigurationError, ConfigurationTypeError

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_TIMEOUT", "APISettings"]

DEFAULT_MAX_TOKENS = 1024
"""Output tokens per turn unless ``max_tokens=`` says otherwise (Anthropic requires a value)."""

DEFAULT_TIMEOUT = 120.0
"""Seconds one request may take before it is abandoned and retried."""

_FIRST_RELEASE = {"first_release": True}  # always written to the recipe JSON, at its default too
_HOW = {"first_release": True, "how": True}  # how a turn is fetched: in the recipe, not in the fingerprint
_PER_TURN = {"per_turn": True}  # a request's own value: in no recipe or fingerprint

_FLOAT_TYPES = ("float", "float | None")  # fields' annotations (strings: postponed evaluation)


@dataclass(frozen=True, slots=True, kw_only=True)
class APISettings:
    """How one hosted turn is asked for (see the module docstring for who reads it).

    ``temperature``/``top_p``: sent when set, else the provider's defaults. ``max_tokens``: the output cap
    (a request's is the participant's lowered to the turn's budget). ``stop``: strings that end the output
    (one string is one stop). ``seed``: the turn's sampling seed, set per request where the provider takes
    one (a participant's record has None). ``timeout``: seconds a request may take. ``prompt_cache``: mark
    prompt-cache breakpoints where the provider takes them (Anthropic). ``record_tokens``: ask for each
    generated token's log-probability (chat completions' ``logprobs``).

    Unvalidated on its own (a spent budget is a request with ``max_tokens`` 0, answered without a call):
    :meth:`check` is the one place its rules live, called by the participant that holds it.
    """

    temperature: float | None = field(default=None, metadata=_FIRST_RELEASE)
    top_p: float | None = field(default=None, metadata=_FIRST_RELEASE)
    max_tokens: int = field(default=DEFAULT_MAX_TOKENS, metadata=_FIRST_RELEASE)
    stop: tuple[str, ...] = field(default=(), metadata=_FIRST_RELEASE)
    timeout: float = field(default=DEFAULT_TIMEOUT, metadata=_HOW)
    prompt_cache: bool = field(default=True, metadata=_HOW)
    record_tokens: bool = False
    seed: int | None = field(default=None, metadata=_PER_TURN)

    def __post_init__(self) -> None:
        # Normalize what is well-typed, so equal settings compare, hash and serialize equal (1 and 1.0, a
        # list of stops and a tuple); what is not is kept as given for check() to name. Every request makes
        # one (its turn's cap and seed put in), so this stays a few attribute reads.
        stop = self.stop
        if type(stop) is not tuple:
            if isinstance(stop, str):
                object.__setattr__(self, "stop", (stop,))
            elif isinstance(stop, Iterable):
                object.__setattr__(self, "stop", tuple(stop))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if type(value) is not float and _is_number(value):
                object.__setattr__(self, name, float(value))

    def for_request(self, *, max_tokens: int, seed: int | None) -> APISettings:
        """This record as one request carries it: the turn's output cap and seed put in. A field-by-field
        copy, checked and normalized already: ``dataclasses.replace`` runs ``__init__`` and costs every
        request about three times as much."""
        out = object.__new__(APISettings)
        for name in _FIELDS:
            object.__setattr__(out, name, getattr(self, name))
        object.__setattr__(out, "max_tokens", max_tokens)
        object.__setattr__(out, "seed", seed)
        return out

    # ---------------------------------------------------------------- the one check
    def check(self, who: str) -> None:
        """Raise a ConfigurationError naming ``who``, the setting, what is wrong and the fix, for a setting
        no provider can be sent (what one provider cannot take is its ``settings_problem``)."""
        _check_range(who, "temperature", self.temperature, 0, 2, open_low=False)
        _check_range(who, "top_p", self.top_p, 0, 1, open_low=True)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ConfigurationError(
                f"{who}: max_tokens must be a positive int (the output tokens per turn), got "
                f"{self.max_tokens!r}"
            )
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigurationError(
                f"{who}: stop must be a str or a list of non-empty str, got {self.stop!r}; () sends none"
            )
        if not (_is_number(self.timeout) and self.timeout > 0):
            raise ConfigurationError(f"{who}: timeout must be a number of seconds > 0, got {self.timeout!r}")
        for name, fix in _SWITCHES.items():
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"{who}: {name} must be True or False, got {getattr(self, name)!r}; {fix}"
                )
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigurationError(
                f"{who}: seed must be an int or None (None sends no seed), got {self.seed!r}"
            )

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        """The settings as a participant's recipe JSON: every field but the per-turn ones, in field order;
        a field of the first release always, a newer one only when set away from its default."""
        return {f.name: _json_value(getattr(self, f.name)) for f in fields(self) if self._written(f.name)}

    def describe(self) -> dict[str, Any]:
        """What of :meth:`to_json` shapes a turn's output (a recipe's fingerprint): not how it is fetched."""
        how = {f.name for f in fields(self) if f.metadata.get("how")}
        return {k: v for k, v in self.to_json().items() if k not in how}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> APISettings:
        """The record :meth:`to_json` wrote (other keys ignored, an absent field at its default)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The participant-level settings (every field but the per-turn ones), in field order."""
        return tuple(f.name for f in fields(cls) if not f.metadata.get("per_turn"))

    def _written(self, name: str) -> bool:
        metadata = _FIELDS[name].metadata
        if metadata.get("per_turn"):
            return False
        return bool(metadata.get("first_release")) or getattr(self, name) != _FIELDS[name].default


_FIELDS = {f.name: f for f in fields(APISettings)}
_FLOAT_FIELDS = tuple(f.name for f in _FIELDS.values() if f.type in _FLOAT_TYPES)

#: The on/off settings, and what True does (the fix their error message gives).
_SWITCHES = {
    "prompt_cache": "True marks prompt-cache breakpoints where the provider takes them (Anthropic)",
    "record_tokens": "True keeps each turn's tokens and their log-probabilities as the provider reports "
    "them (message.tokens)",
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _check_range(who: str, name: str, value: Any, low: float, high: float, *, open_low: bool) -> None:
    if value is None:
        return
    ok = _is_number(value)
    if not ok or not (low < value <= high if open_low else low <= value <= high):
        bracket = "(" if open_low else "["
        error = ConfigurationError if ok else ConfigurationTypeError  # "hot" is a TypeError, 3.0 a ValueError
        raise error(
            f"{who}: {name} must be None or a number in {bracket}{low}, {high}] (None sends no {name}: the "
            f"provider's default), got {value!r}"
        )
