"""Hosted model providers: the provider-neutral request and result, one module per provider (its request,
parsing and batch code) and the registry.
"""

from ._base import APIRequest, APIResult
from ._registry import PROVIDERS, fold_view, key_optional, open_client, provider, resolve_base_url

__all__ = [
    "PROVIDERS",
    "APIRequest",
    "APIResult",
    "fold_view",
    "key_optional",
    "open_client",
    "provider",
    "resolve_base_url",
]
