"""Analyzers: functions run on each finished conversation while its models are still resident.

A callable works wherever the job runs: in this process, and in spawned device workers too, where it travels
with the job by value (cloudpickle), closures included. A NAME registered with :func:`register_analyzer`
works everywhere: workers import the user's main module (as multiprocessing's spawn does), and the names a
run uses are also installed in each worker at start, so a name registered in a notebook or in a module the
main script never imports works as well. :func:`register_worker_init` adds set-up run once per worker.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from .._core import (
    TIME_LIMITS,
    AnalyzerError,
    ConfigurationError,
    UnknownAnalyzerError,
    call_blocking,
    within,
)

if TYPE_CHECKING:
    from ..conversation import Conversation

__all__ = [
    "check_analyzer",
    "check_shippable",
    "register_analyzer",
    "register_worker_init",
    "resolve_analyzer",
    "run_analyzer",
    "worker_hooks",
]

_REGISTRY: dict[str, Callable[[Conversation], Any]] = {}
_WORKER_INIT: list[Callable[[], Any]] = []


def register_analyzer(name: str, fn: Callable[[Conversation], Any]) -> None:
    """Register ``fn`` as ``name`` so ``.analyzer(name)`` can find it in any process (call at import time)."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"register_analyzer() needs a non-empty name, got {name!r}")
    if not callable(fn):
        raise ConfigurationError(f"register_analyzer({name!r}, ...) needs a callable(conv), got {fn!r}")
    _REGISTRY[name] = fn


def register_worker_init(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn()`` once in each worker before its first job, e.g. to load a probe once per GPU.

    Call at import time. In a multi-device run ``fn`` is sent to every worker process, so it must pickle: a
    module-level function by reference, one defined in your main script by name (each worker imports the
    script, as spawn does, and calls its own copy of ``fn``, which shares the script's globals with the
    analyzers it registered: a probe ``fn`` loads into a global is the one they read), a closure by value.
    With one device it runs once in this process at the start of each run. Registering the same function
    twice keeps one. Returns ``fn`` (usable as a decorator). ``fn`` learns its worker's device from
    :func:`interlens.worker_device` (``"cuda:0"`` in every CUDA worker process: each sees only its own GPU).
    """
    if not callable(fn):
        raise ConfigurationError(f"register_worker_init() needs a callable taking no arguments, got {fn!r}")
    if fn not in _WORKER_INIT:
        _WORKER_INIT.append(fn)
    return fn


def worker_hooks(analyzers: Iterable[Callable[[Conversation], Any] | str | None]) -> list[Callable[[], Any]]:
    """What each worker runs before its first job: install the registered analyzers named in ``analyzers``,
    then every :func:`register_worker_init` function, in registration order."""
    names = sorted({a for a in analyzers if isinstance(a, str)})
    entries = {name: fn for name in names if _pickles(fn := resolve_analyzer(name))}
    hooks: list[Callable[[], Any]] = [partial(_install_analyzers, entries)] if entries else []
    return hooks + list(_WORKER_INIT)


def _install_analyzers(entries: Mapping[str, Callable[[Conversation], Any]]) -> None:
    for name, fn in entries.items():
        _REGISTRY.setdefault(name, fn)  # one the worker registered itself (importing main) is kept


def check_shippable(analyzer: Callable[[Conversation], Any] | str | None, *, lineup: str) -> None:
    """Fail before any job starts when ``analyzer`` cannot reach a worker process, saying why and the fix."""
    if analyzer is None:
        return
    fn = resolve_analyzer(analyzer)
    if isinstance(analyzer, str) and _importable_main(fn):
        return  # registered by the main script, which each worker imports: it need not travel
    try:
        _pickles(fn, strict=True)
    except Exception as exc:
        what = f"analyzer {analyzer!r}" if isinstance(analyzer, str) else f"the analyzer {_name(fn)}"
        raise ConfigurationError(
            f"{what} of lineup {lineup!r} cannot be sent to the worker processes ({type(exc).__name__}: "
            f"{exc}). A closure over something that does not pickle (a lock, an open file, a loaded model) "
            "cannot cross a process boundary: define the function at module level, register it with "
            "register_analyzer(name, fn) and use .analyzer(name); load heavy state in each worker with "
            "register_worker_init(fn)"
        ) from exc


def _pickles(fn: Callable[..., Any], *, strict: bool = False) -> bool:
    import cloudpickle

    try:
        cloudpickle.dumps(fn)
    except Exception:
        if strict:
            raise
        return False
    return True


def _importable_main(fn: Callable[..., Any]) -> bool:
    import sys

    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and getattr(main, "__file__", None) is not None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


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

    A sync analyzer runs in a thread of its own (``call_blocking``), so the ``conv.sample(...)`` it calls can
    route its turn back to the event loop (and its batcher) instead of blocking it, and a Ctrl-C or the job's
    ``analyzer_timeout`` stops waiting for one that hangs.
    """
    fn = resolve_analyzer(analyzer)
    seconds = TIME_LIMITS.get().analyzer

    def timed_out() -> Exception:
        return AnalyzerError(
            f"the analyzer did not return within analyzer_timeout={seconds} s, so its job fails (its "
            "conversation is kept, and a rerun runs only the analyzer again). Raise analyzer_timeout= (or "
            "pass None) if it needs longer"
        )

    async def call() -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(conv)
        value = await call_blocking(fn, conv)  # its own thread: a blocked analyzer cannot hold the loop
        return await value if inspect.isawaitable(value) else value

    try:
        value = await within(seconds, call(), timed_out=timed_out)
    except SystemExit as exc:  # sys.exit (or a CLI parser) inside the analyzer: this job's failure only
        raise AnalyzerError(
            f"the analyzer raised SystemExit({exc.code!r}) (sys.exit, or an argument parser it called): an "
            "analyzer returns its value; raise an exception to fail the job"
        ) from exc
    try:
        json.dumps(value, allow_nan=False)  # NaN/Infinity are not JSON: strict readers reject the file
    except ValueError as exc:
        if "Out of range float" not in str(exc):
            raise AnalyzerError(f"the analyzer returned a value that is not JSON ({exc})") from None
        raise AnalyzerError(
            "the analyzer returned a value that is not JSON: it contains NaN or Infinity, which JSON cannot "
            "represent. Return None (or a string such as 'nan') where there is no number, e.g. "
            "None if math.isnan(x) else x"
        ) from None
    except TypeError as exc:
        raise AnalyzerError(
            f"the analyzer returned a value that is not JSON-serializable ({exc}); return plain dicts, "
            "lists, strings, numbers, booleans or None (convert tensors with .tolist() or float(...))"
        ) from None
    return value
