"""Engines loaded lazily, once per (engine key, device), however many jobs ask at the same moment.

The first job to need an engine starts its load in the worker's own task group (not in the asking job's
task), so a job cancelled mid-load does not strand the others waiting on it. A failed load is remembered
for the run (without its frames' locals, which would hold half-loaded weights): every job that needs that
engine fails fast with :class:`EngineLoadError`; others carry on.
An engine the run no longer needs is evicted (``_eviction`` decides, :meth:`EngineCache.evict` drops it).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Hashable, Iterable
from functools import partial
from itertools import count
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._errors import EngineLoadError
from ._protocols import Engine, EngineSpec
from ._threads import run_in_thread

__all__ = ["EngineCache"]

log = logging.getLogger("interlens.scheduler")


class _Slot:
    __slots__ = ("engine", "error", "loaded", "token")

    def __init__(self, token: Hashable) -> None:
        self.token = (
            token  # the batcher's key: a fresh one per load, so a reload never meets an evicted engine
        )
        self.loaded = anyio.Event()
        self.engine: Engine | None = None
        self.error: BaseException | None = None


class EngineCache:
    """The engines resident on one worker's device."""

    def __init__(self, device: str, *, task_group: TaskGroup) -> None:
        self._device = device
        self._tg = task_group  # the worker's: loads outlive the job that asked first
        self._slots: dict[Hashable, _Slot] = {}
        self._loads = count()
        self._limiter = anyio.CapacityLimiter(4)  # own tokens: busy job threads cannot delay a load

    def __len__(self) -> int:
        return sum(1 for s in self._slots.values() if s.engine is not None)

    async def get(self, spec: EngineSpec) -> tuple[Hashable, Engine]:
        key = _key_of(spec)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot((key, next(self._loads)))
            self._tg.start_soon(self._load, spec, key, slot)
        await slot.loaded.wait()
        if slot.engine is None:
            err = slot.error
            why = f"failed with {type(err).__name__}: {err}" if err is not None else "was cancelled"
            raise EngineLoadError(
                f"loading engine {key!r} on {self._device!r} {why}; "
                "every job using this engine fails in this run, the others carry on"
            ) from err
        return slot.token, slot.engine

    async def evict(self, keys: Iterable[Hashable]) -> None:
        """Drop the loaded engines of ``keys`` and call their optional ``evict()`` (in a thread: it may
        collect garbage and wait on the device). A job still holding one finishes with it; a job asking for
        that engine again loads it afresh."""
        for key in keys:
            slot = self._slots.get(key)
            if slot is None or slot.engine is None:
                continue  # never loaded here, still loading, or a failed load (remembered for the run)
            del self._slots[key]
            engine, slot.engine = slot.engine, None
            evict = getattr(engine, "evict", None)
            del engine
            if callable(evict):
                try:
                    await run_in_thread(evict, limiter=self._limiter)
                except Exception:
                    log.warning("evicting engine %r on %r failed", key, self._device, exc_info=True)

    async def _load(self, spec: EngineSpec, key: Hashable, slot: _Slot) -> None:
        try:
            # abandon_on_cancel: a multi-GB load cannot be interrupted; Ctrl-C must not wait for it.
            load = partial(spec.load_engine, self._device)
            engine: Any = await run_in_thread(load, limiter=self._limiter, abandon_on_cancel=True)
            if not callable(getattr(engine, "generate_batch", None)):
                raise TypeError(
                    f"{type(spec).__name__}.load_engine returned {type(engine).__name__}, which has no "
                    "generate_batch(requests, *, mode, cancelled) method (the Engine protocol)"
                )
            slot.engine = engine
        except Exception as exc:
            _drop_frames(exc)
            slot.error = exc
        finally:
            slot.loaded.set()


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of a failed load's frames (its whole chain of causes): the error is kept for the
    rest of the run, and its traceback would keep the half-loaded weights on the device with it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def _key_of(spec: EngineSpec) -> Hashable:
    try:
        key = spec.engine_key
        hash(key)
    except TypeError as exc:
        raise TypeError(
            f"{type(spec).__name__}.engine_key must be hashable (a str or a tuple of plain values): {exc}"
        ) from exc
    return key
