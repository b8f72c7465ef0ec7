"""Which provider wires the fake server speaks, and which wire a request is for.

Each route module describes its wire(s) with a :class:`~._fake_provider_core.FakeWire` record (routes, error
envelope, credentials, base path, environment variables), the way each production provider module describes
itself with a ``Provider`` record listed in ``interlens/providers/_registry.py``. This registry lists the
records; :class:`FakeProviderServer` takes them when it is built and looks a request's wire up here. Adding a
provider's fake wire is one route module and one line here (ARCHITECTURE.md, "add a provider"); nothing else
in ``interlens/testing`` compares provider names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ._fake_provider_anthropic import ANTHROPIC
from ._fake_provider_core import FakeWire
from ._fake_provider_openai import OPENAI, OPENROUTER

__all__ = ["Wires", "registered"]

_REGISTRY: dict[str, FakeWire] = {w.name: w for w in (OPENAI, ANTHROPIC, OPENROUTER)}


def registered() -> Wires:
    """The registered wires, in registration order (meters and messages list providers in it)."""
    return Wires(tuple(_REGISTRY.values()))


class Wires:
    """The wires one server speaks: looked up by name, or by the request they are for."""

    def __init__(self, wires: tuple[FakeWire, ...]) -> None:
        names = [w.name for w in wires]
        fallbacks = [w.name for w in wires if w.fallback]
        if len(set(names)) != len(names) or len(fallbacks) != 1:
            raise ValueError(
                f"the fake server's wires need distinct names and exactly one fallback wire; got names "
                f"{names} with fallback {fallbacks}: fix the records in _fake_provider_registry"
            )
        self._by_name = {w.name: w for w in wires}
        self._fallback = self._by_name[fallbacks[0]]
        self._prefixes = sorted(
            ((prefix, w) for w in wires for prefix in w.path_prefixes), key=lambda pw: -len(pw[0])
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def __iter__(self) -> Iterator[FakeWire]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> FakeWire:
        return self._by_name[name]

    def classify(self, path: str, headers: Mapping[str, str]) -> FakeWire:
        """The wire a request is for: the longest path prefix a wire claims, else the first wire whose
        marker header it carries, else the fallback wire (:class:`FakeWire` says why)."""
        for prefix, wire in self._prefixes:
            if path.startswith(prefix):
                return wire
        for wire in self:
            if any(h in headers for h in wire.marker_headers):
                return wire
        return self._fallback
