"""Test helpers users can use too: tiny local models and a fake provider server on loopback."""

from ._fake_provider import (
    BatchSnapshot,
    FakeProviderServer,
    RequestRecord,
    count_tokens,
    default_reply,
)
from ._tiny_models import TINY_FAMILIES, TINY_SIZES, tiny_model

__all__: list[str] = [
    "TINY_FAMILIES",
    "TINY_SIZES",
    "BatchSnapshot",
    "FakeProviderServer",
    "RequestRecord",
    "count_tokens",
    "default_reply",
    "tiny_model",
]
