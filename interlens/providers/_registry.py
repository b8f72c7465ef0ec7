"""Which providers there are, and the few things interlens asks of a provider by name.

Each provider module (``_openai``: OpenAI and OpenRouter; ``_anthropic``) owns its request body, response
parsing, batch submission and result mapping around the provider-neutral :class:`~._base.APIRequest`, and
describes itself with a :class:`~._base.Provider` record, capabilities included (a batch API, keyless local
endpoints, seeds). This registry looks them up: the view folded for a provider, a request's body, a
provider's endpoint and key (read from the environment in the parent, at first use, never stored), and its
client for the gateway. Adding a provider is one module and one line here (ARCHITECTURE.md, "add a
provider"); nothing else compares provider names.
"""

from __future__ import annotations

import os
from typing import Any

from interlens.scheduler.gateway import ProviderClient

from .._core import ConfigurationError, View
from ._anthropic import ANTHROPIC
from ._base import APIRequest, Messages, Provider, is_local_endpoint
from ._openai import OPENAI, OPENROUTER

__all__ = [
    "PROVIDERS",
    "fold_view",
    "is_local_endpoint",
    "key_optional",
    "open_client",
    "provider",
    "read_api_key",
    "request_body",
    "resolve_base_url",
]

_REGISTRY: dict[str, Provider] = {p.name: p for p in (OPENAI, ANTHROPIC, OPENROUTER)}

PROVIDERS = tuple(_REGISTRY)
"""The provider names an ``APIParticipant`` accepts, in the order its error message lists them."""


def provider(name: str) -> Provider:
    """The provider called ``name`` (a name outside :data:`PROVIDERS` is refused by the participant first)."""
    return _REGISTRY[name]


def fold_view(view: View, name: str) -> Messages:
    """The view's messages as (role, content) pairs the provider accepts (the system block goes apart)."""
    return _REGISTRY[name].fold(tuple((m.role, m.content) for m in view.messages))


def request_body(request: APIRequest) -> dict[str, Any]:
    """The JSON body ``request`` is sent with (chat completions, or Anthropic messages)."""
    return _REGISTRY[request.provider].body(request)


def resolve_base_url(name: str, base_url: str | None) -> str:
    """An explicit ``base_url`` wins, then the provider's ``*_BASE_URL`` variable, then the public one."""
    entry = _REGISTRY[name]
    return (base_url or os.environ.get(entry.url_variable) or entry.default_url).rstrip("/")


def key_optional(name: str, base_url: str | None = None) -> bool:
    """Whether provider ``name`` at ``base_url`` (or its ``*_BASE_URL``) is called without a key when none
    is set: a provider that serves keyless local endpoints, on a local or private host."""
    return _REGISTRY[name].keyless_local and is_local_endpoint(resolve_base_url(name, base_url))


def read_api_key(name: str, *, who: str, auth: bool | None = None, base_url: str | None = None) -> str | None:
    """The key for provider ``name``, or None where the endpoint is called without one.

    ``auth=False``: never a key. ``auth=True``: the key is required. ``auth=None`` (the default): the key when
    its variable is set; when it is not, a provider that serves keyless local endpoints (``keyless_local``:
    ``openai``, for OpenAI-compatible servers) is called without one on a local or private host
    (:func:`key_optional`), and any other endpoint is refused.
    """
    if auth is False:
        return None
    variable = _REGISTRY[name].key_variable
    key = os.environ.get(variable, "").strip()
    if key:
        return key
    if auth is None and key_optional(name, base_url):
        return None
    url = resolve_base_url(name, base_url)
    local = (
        " For an OpenAI-compatible server that needs no key (vLLM, SGLang, llama.cpp), use "
        f"provider='{name}' with its base_url (a local or private host needs no key) or pass auth=False."
        if _REGISTRY[name].keyless_local
        else ""
    )
    raise ConfigurationError(
        f"{who} needs an API key for {name} at {url}: set the environment variable {variable} "
        f"(read from the environment at first use, never stored).{local}"
    )


def open_client(
    name: str, *, base_url: str | None, max_in_flight: int, who: str, auth: bool | None = None
) -> ProviderClient:
    """The gateway's client for provider ``name`` (called by the gateway, in the parent, at first use)."""
    key = read_api_key(name, who=who, auth=auth, base_url=base_url)
    url = resolve_base_url(name, base_url)
    return _REGISTRY[name].client(provider=name, base_url=url, api_key=key, max_in_flight=max_in_flight)
