"""Analyzers: functions run on each finished conversation while its models are still resident.

A callable works wherever the job runs in this process. A NAME registered with :func:`register_analyzer` at
import time works everywhere, including spawned device workers, which import the user's main module.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._exceptions import AnalyzerError, ConfigurationError, UnknownAnalyzerError

if TYPE_CHECKING:
    from ._conversation import Conversation

__all__ = ["check_analyzer", "register_analyzer", "resolve_analyzer", "run_analyzer"]

_REGISTRY: dict[str, Callable[[Conversation], Any]] = {}


def register_analyzer(name: str, fn: Callable[[Conversation], Any]) -> None:
    """Register ``fn`` as ``name`` so ``.analyzer(name)`` can find it in any process (call at import time)."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"register_analyzer() needs a non-empty name, got {name!r}")
    if not callable(fn):
        raise ConfigurationError(f"register_analyzer({name!r}, ...) needs a callable(conv), got {fn!r}")
    _REGISTRY[name] = fn


def resolve_analyzer(analyzer: Callable[[Conversation], Any] | str) -> Callable[[Conversation], Any]:
    if callable(analyzer):
        return analyzer
    try:
        return _REGISTRY[analyzer]
    except KeyError:
        raise UnknownAnalyzerError(
            f"no analyzer registered as {analyzer!r}; call register_analyzer({analyzer!r}, fn) at import "
            "time "
            f"of your module. Registered: {sorted(_REGISTRY)}"
        ) from None


def check_analyzer(analyzer: Callable[[Conversation], Any] | str | None) -> None:
    """Fail before any job starts when a named analyzer is not registered."""
    if analyzer is not None:
        resolve_analyzer(analyzer)


async def run_analyzer(analyzer: Callable[[Conversation], Any] | str, conv: Conversation) -> Any:
    """Call the analyzer on ``conv`` and return its JSON-checked value.

    A sync analyzer runs in a worker thread, so the ``conv.sample(...)`` it calls can route its turn back to
    the event loop (and its batcher) instead of blocking it.
    """
    import anyio

    fn = resolve_analyzer(analyzer)
    if inspect.iscoroutinefunction(fn):
        value = await fn(conv)
    else:
        value = await anyio.to_thread.run_sync(fn, conv)
        if inspect.isawaitable(value):
            value = await value
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise AnalyzerError(
            f"the analyzer returned a value that is not JSON-serializable ({exc}); return plain dicts, "
            "lists, "
            "strings, numbers, booleans or None (convert tensors with .tolist() or float(...))"
        ) from None
    return value
