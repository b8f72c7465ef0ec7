"""interlens: run one multi-agent conversation recipe many times."""

from ._exceptions import InterlensError

__all__ = ["InterlensError"]
