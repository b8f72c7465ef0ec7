"""The deterministic rows' decode loop over static-shape slot steps: what the slot layout runs on CUDA (as
graphs).

The slot layout's eager loop (``ModelRunner.decode`` over a ``SlotCache``) pads, masks and compacts with new
tensors every step, so it cannot be replayed. :class:`SlotDecoder` decodes the same rows through a
:class:`~._slot_step.SlotDecodeStep` per key (padded rows, slot length, sampler variant, recording), kept
between batches, whose caches are views of one :class:`~._kv_pool.KVPool` of its own (the slot layout's
shape: a row's slot is its position), each captured as a graph on first use (``_decode_graphs``):

* the rows are padded as the slot layout pads them (``padded_rows``: a multiple of ``ROW_BLOCK``, on CUDA
  the row bucket) and the slots to a multiple of the length quantum (``SLOT_BLOCK`` on the CPU, the graphs'
  ``LENGTH_QUANTUM`` on CUDA: both multiples of ``SLOT_BLOCK``, as the layout needs), chosen once a batch;
* the loop is the batched static decoder's (``_static_decode``): pipelined (step n+1 launched before the
  host reads step n's tokens: one wait a step, on that copy), finished rows stay in the batch until the live
  ones fit a smaller row bucket, where the step in flight is drained and the live rows move to the pool's
  front rows (``hand_over``).

What the self-test (``_batch_invariance``) probes is this very step when the decoder is on (its verdicts
are keyed by it), so a co-stepped row is still token-identical to the row alone. Used on CUDA by default,
on the CPU only where asked (``INTERLENS_STATIC_DECODE=1``, or a test setting ``SlotLayout.decoder``); not
for a model with sliding-window layers (their window is a per-layer mask the eager slot step builds), nor
while forward hooks are on the model: those run the eager slot loop.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._buckets import LENGTH_QUANTUM, length_bucket
from ._decode import ModelRunner, Row, hand_out, raise_if_cancelled
from ._decode_graphs import GraphRunner
from ._kv_pool import KVPool
from ._slot_rows import SLOT_BLOCK, SlotLayout, padded_rows
from ._slot_step import SlotDecodeStep
from ._static_decode import ENV_SWITCH, _hooked
from ._static_sampler import variant_for

if TYPE_CHECKING:
    import torch

__all__ = ["SlotDecoder", "slot_decoder_for"]

#: Most steps (keys) kept between batches; their graphs are capped by the graph runner.
MAX_STEPS = 32


def slot_decoder_for(runner: ModelRunner) -> SlotDecoder | None:
    """The slot layout's static decoder: on CUDA unless ``INTERLENS_STATIC_DECODE=0``; elsewhere only with
    ``INTERLENS_STATIC_DECODE=1``; never for a model split over devices (as ``static_decoder_for``)."""
    switch = os.environ.get(ENV_SWITCH, "")
    if switch == "0" or (switch != "1" and not runner.device.startswith("cuda")):
        return None
    if len({p.device for p in runner.model.parameters()}) > 1:
        return None
    return SlotDecoder(runner)


class SlotDecoder:
    """Static-shape decoding of slot-layout rows for one runner (module docstring). ``quantum``: the slot
    length's step (a multiple of ``SLOT_BLOCK``); ``graphs``: the graph runner (a test may give one)."""

    def __init__(self, runner: ModelRunner, *, quantum: int | None = None, graphs: GraphRunner | None = None):
        self.runner = runner
        cuda = runner.device.startswith("cuda")
        self.quantum = quantum if quantum is not None else (LENGTH_QUANTUM if cuda else SLOT_BLOCK)
        if self.quantum % SLOT_BLOCK:
            from .._core import ConfigurationError

            raise ConfigurationError(
                f"SlotDecoder(quantum={self.quantum}): the slot length's step must be a multiple of "
                f"SLOT_BLOCK ({SLOT_BLOCK}), or the key reductions' lanes move with the length"
            )
        self.pool = KVPool(runner.model)
        self.graphs = graphs if graphs is not None else GraphRunner(device=runner.device)
        #: batches, steps by how they ran ("graph", "eager: why"), hand-overs, ignored steps
        self.stats: Counter[str] = Counter()
        self._steps: OrderedDict[tuple[int, int, str, bool], SlotDecodeStep] = OrderedDict()
        self._generation = self.pool.generation
        self._host: list[torch.Tensor] | None = None
        self._flip = 0

    def serves(self, layout: SlotLayout) -> bool:
        """Whether the layout's rows decode here: every layer full attention, no forward hooks."""
        config = layout.runner.model.config
        types = getattr(
            config.get_text_config() if hasattr(config, "get_text_config") else config, "layer_types", None
        )
        if types and set(types) != {"full_attention"}:
            self.stats["eager batches: sliding layers"] += 1
            return False
        if _hooked(self.runner.model):
            self.stats["eager batches: forward hooks"] += 1
            return False
        return True

    def length_for(self, slots: int) -> int:
        """The slot length a batch needing ``slots`` slots runs at."""
        return length_bucket(slots, quantum=self.quantum)

    def release(self) -> None:
        """Drop the pool's storage, every step and every graph (before an out-of-memory retry)."""
        self._steps.clear()
        self.graphs.clear()
        self.pool.release()

    def probe_step(self, rows: int, length: int) -> SlotDecodeStep:
        """A greedy step over the pool that is never captured: the self-test runs it eagerly under its
        forward hooks (``_batch_invariance``)."""
        self._fit(rows, length)
        return SlotDecodeStep(
            self.runner.model, rows=rows, length=length, variant="greedy", record=False, pool=self.pool
        )

    def decode(
        self,
        rows: list[Row],
        prefill: Any,
        index: Sequence[int],
        cancelled: threading.Event | None,
        *,
        buckets: bool,
    ) -> None:
        """Decode ``rows`` (their prompts prefilled in ``prefill`` by ``SlotLayout.fill``, row ``j`` at its
        row ``index[j]``) until every one is finished, with ``ModelRunner.decode``'s effects on the rows.
        ``buckets``: pad rows to row buckets (``padded_rows``). Call in ``SlotLayout.invariant_kernels``."""
        runner = self.runner
        settings = [r.request.sampling for r in rows]
        prompts = [r.request.prompt_ids for r in rows]
        record = any(r.request.record_logprobs for r in rows)
        variant = variant_for(settings)
        length = self.length_for(max(len(p) for p in prompts) + max(s.max_new_tokens for s in settings))
        self.stats["batches"] += 1
        step, mode = self._step(padded_rows(len(rows), buckets=buckets), length, variant, record)
        step.begin(settings, prefill=prefill, index=index, prompts=prompts)
        del prefill
        active = list(rows)
        recorded: list[tuple[list[tuple[int, Row]], torch.Tensor]] = []

        def take(chosen: list[int], lps: torch.Tensor | None) -> None:
            took = runner.take_tokens(active, chosen)
            if lps is not None and took:
                recorded.append((took, lps))

        pending: _Launched | None = None  # a step launched whose tokens the host has not read yet
        while not all(row.done for row in active):
            raise_if_cancelled(cancelled)
            live = [j for j, row in enumerate(active) if not row.done]
            smaller = padded_rows(len(live), buckets=buckets)
            if smaller < step.rows:  # a row bucket edge
                if pending is not None:  # drain: the step in flight may end more rows
                    take(*self._read(pending))
                    pending = None
                    continue
                to, mode = self._step(smaller, length, variant, record)
                step.hand_over(live, to)
                step, active = to, [active[j] for j in live]
                self.stats["hand-overs"] += 1
            if pending is None:
                pending = self._launch(step, len(active), mode)
            # the next step runs while the host checks this one; none where every live row takes its last
            # token in the one in flight
            ahead = None
            if any(
                not row.done and len(row.tokens) + 1 < row.request.sampling.max_new_tokens for row in active
            ):
                ahead = self._launch(step, len(active), mode)
            take(*self._read(pending))
            pending = ahead
        if pending is not None:
            self.stats["ignored steps"] += 1
        hand_out(recorded)

    def _launch(self, step: SlotDecodeStep, n: int, mode: str) -> _Launched:
        """Run one step and queue the copy of its first ``n`` rows' tokens to the host (pinned memory on
        CUDA, without waiting), and of their log-probabilities on the device."""
        import torch

        step.step()
        self.stats[f"steps: {mode}"] += 1
        cuda = step.device.startswith("cuda")
        if self._host is None or self._host[0].shape[0] < step.rows:
            self._host = [torch.empty(step.rows, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._flip ^= 1
        host = self._host[self._flip][:n]
        host.copy_(step.tokens[:n], non_blocking=True)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(step.device))
        lps = step.logprobs[:n].clone() if step.record else None
        return _Launched(host, event, lps)

    @staticmethod
    def _read(launched: _Launched) -> tuple[list[int], torch.Tensor | None]:
        """A launched step's tokens (-1: non-finite) on the host: the loop's one wait a step."""
        if launched.event is not None:
            launched.event.synchronize()
        return launched.host.tolist(), launched.logprobs

    def _fit(self, rows: int, length: int) -> None:
        """Grow the pool to ``rows`` x ``length`` if it is smaller (every step and graph on it goes stale)."""
        if self._generation != self.pool.generation or self.pool.rows < rows or self.pool.length < length:
            self._steps.clear()
            self.graphs.clear()
            self.pool.reserve(max(rows, self.pool.rows), max(length, self.pool.length))
            self._generation = self.pool.generation

    def _step(self, rows: int, length: int, variant: str, record: bool) -> tuple[SlotDecodeStep, str]:
        """The step for this key (built on first use, its graph captured then) and how it runs."""
        self._fit(rows, length)
        key = (rows, length, variant, record)
        step = self._steps.get(key)
        if step is None:
            step = SlotDecodeStep(
                self.runner.model, rows=rows, length=length, variant=variant, record=record, pool=self.pool
            )
            self._steps[key] = step
            while len(self._steps) > MAX_STEPS:
                old, _ = self._steps.popitem(last=False)
                self.graphs.forget(old)
        self._steps.move_to_end(key)
        return step, self.graphs.mode(key, step)


@dataclass
class _Launched:
    """A step launched: where its tokens arrive on the host, the event that says they have (CUDA), and
    its log-probabilities (a device copy; None without recording)."""

    host: torch.Tensor
    event: Any
    logprobs: torch.Tensor | None
