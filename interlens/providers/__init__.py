"""Hosted model providers: the provider-neutral request, its settings record and the result, one module per
provider (its request, parsing and batch code) and the registry.
"""

from ._base import APIRequest, APIResult
from ._registry import PROVIDERS, fold_view, key_optional, open_client, provider, resolve_base_url
from ._settings import DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT, APISettings

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TIMEOUT",
    "PROVIDERS",
    "APIRequest",
    "APIResult",
    "APISettings",
    "fold_view",
    "key_optional",
    "open_client",
    "provider",
    "resolve_base_url",
]
