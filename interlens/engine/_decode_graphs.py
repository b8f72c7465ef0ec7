"""The graphs a static decode step replays: captured lazily per step, one shared memory pool, an LRU cap.

On CUDA a decode step is ~1,600-2,400 kernel launches from Python (``../shared/notes/gpu_decode.md``), and
the host's launch time is the whole step; captured once as a ``torch.cuda.CUDAGraph`` over a
:class:`~._static_step.StaticDecodeStep`'s fixed buffers, a step is one replay. By hand, not
``torch.compile(mode="reduce-overhead")``: generation runs in worker threads and cudagraph trees are
thread-local (pytorch#123177); transformers' own continuous-batching runner captures its graphs this way.

Capture happens where a step is first used, possibly in the middle of a batch whose rows live in the same KV
pool. A warm-up run (on a side stream, as CUDA asks before capture) really writes KV, so every run before the
real ones is pointed at the step's LAST slot (its write position set there before each run): a slot no live
row has written yet and every row writes before attending to it (attention is causal by slot), so the junk is
overwritten unread. The step's other buffers are refilled by ``begin`` / ``hand_over`` after the capture.

:class:`GraphRunner` says per step which way it runs: ``"graph"``, or ``"eager"`` with the reason (not CUDA
and no stand-in graph; the capture raised). A stand-in graph type (``graph_type``: ``capture()`` and
``replay()`` over the step, the tests' address-checking one) takes the CUDA graph's place on the CPU, so the
CPU proves that no captured buffer moves across a rollout.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

log = logging.getLogger("interlens")

__all__ = ["MAX_GRAPHS", "Capturable", "GraphRunner"]

#: Most captured graphs kept at once (least recently used dropped first): each holds its own
#: intermediates (the logits and the sampler's float32 passes at its row bucket) in the shared pool.
MAX_GRAPHS = 24


class Capturable(Protocol):
    """A step a graph can hold: :class:`~._static_step.StaticDecodeStep` (batched rows) or
    :class:`~._slot_step.SlotDecodeStep` (deterministic rows). Its function runs over fixed buffers (the
    inputs and outputs ``_replay_differs`` names, its cache's layers), its next write at ``positions``."""

    device: str
    length: int
    cache: Any
    positions: torch.Tensor
    run: Callable[[], None]

    def _forward_and_sample(self) -> None: ...


class GraphRunner:
    """Captures a step's graph on first use and keeps at most ``cap`` (module docstring).

    ``device``: the engine's device (graphs only on CUDA); ``graph_type``: None for ``torch.cuda.CUDAGraph``
    on CUDA (eager elsewhere), or a stand-in class built as ``graph_type(step)`` with ``capture()`` and
    ``replay()``; ``capture`` False: every step eager (said as such). :attr:`stats` counts captures, capture
    failures and evictions."""

    def __init__(
        self,
        *,
        device: str,
        cap: int = MAX_GRAPHS,
        graph_type: Callable[..., Any] | None = None,
        capture: bool = True,
    ):
        self.device = device
        self.cap = cap
        self.graph_type = graph_type
        self.stats: Counter[str] = Counter()
        self._graphs: OrderedDict[Hashable, tuple[Any, Capturable]] = OrderedDict()
        self._pool: Any = None  # CUDA's graph memory pool, shared by every graph
        #: why capture was given up (every later step runs eagerly); ``capture=False``: from the start (a
        #: benchmark's eager side)
        self.failed: str | None = None if capture else "capture off"

    def mode(self, key: Hashable, step: Capturable) -> str:
        """Make ``step`` (built for ``key``) run as a graph if it can: ``"graph"``, else ``"eager: why"``.
        Sets ``step.run``. Call only between steps (a capture's warm-up writes the step's last slot)."""
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return "graph"
        if self.failed is not None:
            step.run = step._forward_and_sample
            return f"eager: {self.failed}"
        if self.graph_type is None and not self.device.startswith("cuda"):
            step.run = step._forward_and_sample
            return "eager: not CUDA"
        try:
            graph = self._capture(step)
            differs = _replay_differs(step, graph)
        except Exception as err:  # any refusal of the capture leaves the step eager
            self.stats["capture_failures"] += 1
            self.failed = f"capture failed ({type(err).__name__}: {err})"
        else:
            if differs is not None:
                self.stats["replay_mismatches"] += 1
                self.failed = f"a captured step's replay gave other {differs} than the eager step"
        if self.failed is not None:
            log.warning("interlens: decode steps run eagerly: %s", self.failed)
            step.run = step._forward_and_sample
            return f"eager: {self.failed}"
        self.stats["captures"] += 1
        self._graphs[key] = (graph, step)
        step.run = graph.replay
        while len(self._graphs) > self.cap:
            self.forget(next(iter(self._graphs)))
            self.stats["evictions"] += 1
        return "graph"

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s graph (its step runs eagerly until :meth:`mode` captures it again)."""
        entry = self._graphs.pop(key, None)
        if entry is not None:
            entry[1].run = entry[1]._forward_and_sample  # the step's reference was the graph's last

    def clear(self) -> None:
        """Drop every graph (the KV pool was reallocated: their addresses are stale)."""
        for key in list(self._graphs):
            self.forget(key)

    def graph(self, key: Hashable) -> Any:
        """``key``'s graph (None: none captured)."""
        entry = self._graphs.get(key)
        return entry[0] if entry is not None else None

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def _capture(self, step: Capturable) -> Any:
        """Warm up and capture ``step``'s function, each run writing only the step's last slot."""
        if self.graph_type is not None:
            _at_last_slot(step)
            graph = self.graph_type(step)
            graph.capture()
            return graph
        import torch

        with torch.cuda.device(step.device):  # a worker thread's current device may be another
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    _at_last_slot(step)
                    step._forward_and_sample()
            torch.cuda.current_stream().wait_stream(side)
            _at_last_slot(step)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                step._forward_and_sample()
        return graph


def _at_last_slot(step: Capturable) -> None:
    """Point the step's next run at its last cache slot (module docstring: no live row has written it)."""
    last = step.length - 1
    for layer in step.cache.layers:
        layer.cumulative_length.fill_(last)
    step.positions.fill_(last)


_INPUTS = ("input_ids", "mask", "uniforms", "temperature", "top_p", "greedy")
_OUTPUTS = ("tokens", "finite", "logprobs")


def _replay_differs(step: Capturable, graph: Any) -> str | None:
    """None when one replay of ``graph`` gives the eager step's outputs bit for bit on the same inputs, else
    the outputs that differ (module docstring). Runs at the last slot; ``begin``/``hand_over`` refill the
    inputs afterwards, as after the warm-up."""
    saved = [getattr(step, name).clone() for name in _INPUTS]

    def outputs(run: Callable[[], None]) -> list[torch.Tensor]:
        for name, value in zip(_INPUTS, saved, strict=True):
            getattr(step, name).copy_(value)
        _at_last_slot(step)
        run()
        return [getattr(step, name).clone() for name in _OUTPUTS]

    eager, replayed = outputs(step._forward_and_sample), outputs(graph.replay)
    differ = [name for name, a, b in zip(_OUTPUTS, eager, replayed, strict=True) if not _same(a, b)]
    return ", ".join(differ) or None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN (a row whose logits went bad gives NaN log-probabilities either way)."""
    import torch

    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))
