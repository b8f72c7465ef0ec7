"""What both static-shape decoders share: their steps kept per key, a launched step, and the pipelined loop.

The batched rows' decoder (``_static_decode.StaticDecoder`` over ``_static_step.StaticDecodeStep``) and the
deterministic rows' one (``_slot_decode.SlotDecoder`` over ``_slot_step.SlotDecodeStep``) run the same loop
over different steps: which rows a step holds, how its cache is laid out and how a batch begins differ
(each step's module says why), but once begun both steps are driven alike, so that loop lives here once:

* :class:`StepLoop` keeps the decoder's steps by key (least recently used dropped past ``MAX_STEPS``, its
  graph forgotten with it: a graph holds its step's buffers), and asks the :class:`GraphRunner` how each
  runs (a replayed graph on CUDA, captured on first use);
* :meth:`StepLoop.launch` runs one step and queues the copy of its tokens to one of two host buffers
  (pinned memory on CUDA) with an event, without waiting; :meth:`StepLoop.read` waits on that event only:
  the loop's one host wait a step, never on a step queued after it;
* :meth:`StepLoop.run` is the pipelined loop: step n+1 is launched before the host reads and checks step
  n's tokens (``ModelRunner.take_tokens``), so the host's checks overlap the device's next step. A row
  ended at step n costs step n+1, ignored (counted); no step is launched ahead where every live row takes
  its last token in the one in flight. Finished rows stay in the batch until the live ones fit a smaller
  row count (the decoder's ``padded`` rule); there the step in flight is drained first, the decoder's
  ``on_edge`` sees the leavers, and the live rows are handed over to the smaller step. Recorded
  log-probabilities stay on the device and are read once at the end (``hand_out``).

The stats names (``steps: <mode>``, ``hand-overs``, ``ignored steps``) are the decoders' own
(``StaticDecoder.stats`` / ``SlotDecoder.stats``): this loop writes into the decoder's counter.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._decode import ModelRunner, Row, hand_out, raise_if_cancelled
from ._decode_graphs import Capturable, GraphRunner

if TYPE_CHECKING:
    import torch

    from ._kv_pool import KVPool

__all__ = [
    "ENV_SWITCH",
    "MAX_STEPS",
    "LaunchedStep",
    "LoopStep",
    "StepLoop",
    "StepLoopOwner",
    "forward_hooked",
    "static_wanted",
]

#: Set to "1" to decode through static steps on the CPU too (CI's proof of the GPU's path); "0" turns them
#: off on CUDA. Read by both decoders' ``*_decoder_for``.
ENV_SWITCH = "INTERLENS_STATIC_DECODE"

#: Most steps (keys) a decoder keeps between batches; their graphs are capped by the graph runner.
MAX_STEPS = 32


def static_wanted(runner: ModelRunner) -> bool:
    """Whether a runner decodes through static steps: on CUDA unless ``INTERLENS_STATIC_DECODE=0``;
    elsewhere only with ``INTERLENS_STATIC_DECODE=1``; never for a model split over several devices (each
    layer's KV lives on its own device, not in one pool)."""
    switch = os.environ.get(ENV_SWITCH, "")
    if switch == "0" or (switch != "1" and not runner.device.startswith("cuda")):
        return False
    return len({p.device for p in runner.model.parameters()}) <= 1


def forward_hooked(model: Any) -> bool:
    """Whether any forward hook is on the model (a graph would replay without calling it)."""
    import torch

    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class LoopStep(Capturable, Protocol):
    """A step the loop drives (both static steps): ``rows`` padded rows, outputs ``tokens`` (-1: that
    row's logits went non-finite) and, with ``record``, ``logprobs``; ``hand_over`` carries live rows on."""

    rows: int
    record: bool
    tokens: torch.Tensor
    logprobs: torch.Tensor

    def step(self) -> None: ...

    def hand_over(self, keep: Sequence[int], to: Any) -> None: ...


StepT = TypeVar("StepT", bound=LoopStep)


@dataclass
class LaunchedStep:
    """A step launched: where its tokens arrive on the host, the event that says they have (CUDA), and
    its log-probabilities (a device copy; None without recording)."""

    host: torch.Tensor
    event: Any
    logprobs: torch.Tensor | None


class StepLoop(Generic[StepT]):
    """One decoder's steps by key, its two host token buffers, and the pipelined loop (module docstring).

    ``graphs``: the decoder's graph runner; ``stats``: the decoder's counter (this loop adds its steps,
    hand-overs and ignored steps to it); ``host_rows``: the host buffers' least size in rows (grown to a
    larger step's rows when one comes)."""

    def __init__(self, *, graphs: GraphRunner, stats: Counter[str], host_rows: int = 0) -> None:
        self.graphs = graphs
        self.stats = stats
        #: the steps by key, least recently used first
        self.steps: OrderedDict[Hashable, StepT] = OrderedDict()
        self._host_rows = host_rows
        self._host: list[torch.Tensor] | None = None  # two host buffers the launched steps' tokens go to
        self._flip = 0

    def step(self, key: Hashable, build: Callable[[], StepT]) -> tuple[StepT, str]:
        """The step for ``key`` (built by ``build`` on first use, its graph captured then) and how it runs;
        past :data:`MAX_STEPS` the least recently used one goes, with its graph."""
        step = self.steps.get(key)
        if step is None:
            step = build()
            self.steps[key] = step
            while len(self.steps) > MAX_STEPS:
                old, _ = self.steps.popitem(last=False)
                self.graphs.forget(old)
        self.steps.move_to_end(key)
        return step, self.graphs.mode(key, step)

    def clear(self) -> None:
        """Drop every step and graph (their pool's storage is being reallocated or released)."""
        self.steps.clear()
        self.graphs.clear()

    def launch(self, step: StepT, n: int, mode: str) -> LaunchedStep:
        """Run one step and queue the copy of its first ``n`` rows' tokens to the host (pinned memory on
        CUDA, without waiting) and of their log-probabilities (on the device), before a next step can
        overwrite them."""
        import torch

        step.step()
        self.stats[f"steps: {mode}"] += 1
        cuda = step.device.startswith("cuda")
        if self._host is None or self._host[0].shape[0] < step.rows:
            size = max(step.rows, self._host_rows)
            self._host = [torch.empty(size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._flip ^= 1
        host = self._host[self._flip][:n]
        host.copy_(step.tokens[:n], non_blocking=True)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(step.device))  # the step's device, not the thread's
        lps = step.logprobs[:n].clone() if step.record else None
        return LaunchedStep(host, event, lps)

    @staticmethod
    def read(launched: LaunchedStep) -> tuple[list[int], torch.Tensor | None]:
        """A launched step's tokens (-1: non-finite), read on the host: the loop's one wait a step (for
        that step's copy only, not for a step queued after it)."""
        if launched.event is not None:
            launched.event.synchronize()
        return launched.host.tolist(), launched.logprobs

    def run(
        self,
        runner: ModelRunner,
        rows: list[Row],
        step: StepT,
        mode: str,
        *,
        padded: Callable[[int], int],
        smaller_step: Callable[[int], tuple[StepT, str]],
        cancelled: threading.Event | None,
        first: tuple[list[int], torch.Tensor | None] | None = None,
        on_edge: Callable[[list[int], list[Row], StepT], None] | None = None,
        room: Callable[[StepT], bool] | None = None,
    ) -> tuple[StepT, list[Row]]:
        """Decode the begun ``rows`` on ``step`` (run as ``mode``) until every one is finished (module
        docstring), with ``ModelRunner.decode``'s effects on the rows. ``padded``: the step rows a number of
        live rows runs at; ``smaller_step``: the step (and mode) for that many rows, handed over to at an
        edge; ``first``: tokens (and log-probabilities) already chosen at ``begin``, taken first;
        ``on_edge``: told the leaving rows (their indices in the step, the rows, the step) before a
        hand-over; ``room``: whether the step can take one more step ahead (None: always). Returns the last
        step and its rows (the decoder's end-of-batch work reads them)."""
        active = list(rows)
        recorded: list[tuple[list[tuple[int, Row]], torch.Tensor]] = []

        def take(chosen: list[int], lps: torch.Tensor | None) -> None:
            took = runner.take_tokens(active, chosen)
            if lps is not None and took:
                recorded.append((took, lps))

        if first is not None:
            take(*first)
        pending: LaunchedStep | None = None  # a step launched whose tokens the host has not read yet
        while not all(row.done for row in active):
            raise_if_cancelled(cancelled)
            live = [j for j, row in enumerate(active) if not row.done]
            smaller = padded(len(live))
            if smaller < step.rows:  # a row bucket edge
                if pending is not None:  # drain: the step in flight may end more rows
                    take(*self.read(pending))
                    pending = None
                    continue
                if on_edge is not None:  # e.g. the kept-KV collector reads the leavers before they move
                    gone = [j for j, row in enumerate(active) if row.done]
                    on_edge(gone, [active[j] for j in gone], step)
                to, mode = smaller_step(smaller)
                step.hand_over(live, to)
                step, active = to, [active[j] for j in live]
                self.stats["hand-overs"] += 1
            if pending is None:
                pending = self.launch(step, len(active), mode)
            # the next step runs on the device while the host checks this one (a row this one ends costs
            # that step, ignored); none where every live row takes its last token in the one in flight
            ahead = None
            if (room is None or room(step)) and any(
                not row.done and len(row.tokens) + 1 < row.request.sampling.max_new_tokens for row in active
            ):
                ahead = self.launch(step, len(active), mode)
            take(*self.read(pending))
            pending = ahead
        if pending is not None:
            self.stats["ignored steps"] += 1
        hand_out(recorded)
        return step, active


class StepLoopOwner:
    """A decoder whose steps a :class:`StepLoop` keeps over the engine's KV pool (both static decoders): its
    :attr:`graphs` is its loop's graph runner (a test may put a stand-in one there after the decoder is
    built); :attr:`_generation` is the pool's generation its steps were built on (set at construction)."""

    loop: StepLoop[Any]
    pool: KVPool
    _generation: int

    def release(self) -> None:
        """Drop the pool's storage (its budget asked again when next needed), every step and every graph
        (before an out-of-memory retry)."""
        self.loop.clear()
        self.pool.release()

    def _room(self, rows: int, length: int) -> bool:
        """Make the pool hold a ``rows`` x ``length`` layout if it can (``KVPool.room``: grown by need, or
        allocated once at the budget's size, then False where the layout does not fit). Steps and graphs
        over a storage reallocated since they were built (by this decoder or the other one, which shares
        the pool) are dropped."""
        fits = self.pool.room(rows, length)
        if self._generation != self.pool.generation:
            self.loop.clear()
            self._generation = self.pool.generation
        return fits

    def _after_batch(self, rows: list[Row]) -> None:
        """Zero the pool after a batch where a row's logits went non-finite: its NaN / inf KV would reach a
        later batch's masked slots (either decoder's: zero weight x NaN is NaN)."""
        if any(row.failure is not None for row in rows):
            self.pool.clear()

    @property
    def graphs(self) -> GraphRunner:
        """The graph runner of this decoder's steps."""
        return self.loop.graphs

    @graphs.setter
    def graphs(self, graphs: GraphRunner) -> None:
        self.loop.graphs = graphs
