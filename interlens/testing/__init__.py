"""Test helpers users can use too: tiny local models, a fake provider server."""

from ._tiny_models import TINY_FAMILIES, TINY_SIZES, tiny_model

__all__: list[str] = ["TINY_FAMILIES", "TINY_SIZES", "tiny_model"]
