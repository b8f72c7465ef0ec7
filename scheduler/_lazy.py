"""A package's lazy face (PEP 562), for ``interlens.scheduler`` and its ``gateway``.

A package ``__init__`` maps each exported name to the module that defines it and takes its module-level
``__getattr__`` and ``__dir__`` from :func:`lazy_face`: a name is imported from its module on first use and
kept in the package's globals, so it is that module's own object (``isinstance``, ``except`` and pickling by
reference see one class) and later uses do not come here. Importing the package therefore loads nothing: a
floor that needs only the errors or the protocols loads those modules alone. (``interlens.store`` spells its
own face: it imports nothing of the scheduler.)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose names load from ``exports`` (name -> module,
    relative to the package)."""
    namespace = vars(sys.modules[package])

    def load(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(exports[name], package), name)
        return value

    def listing() -> list[str]:
        return sorted({*namespace, *exports})

    return load, listing
