"""Test helpers users can use too: tiny local models, a fake provider server."""

__all__: list[str] = []
