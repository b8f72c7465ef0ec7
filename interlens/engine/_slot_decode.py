"""The deterministic rows' decode loop over static-shape slot steps: what the slot layout runs on CUDA (as
graphs).

The slot layout's eager loop (``ModelRunner.decode`` over a ``SlotCache``) pads, masks and compacts with new
tensors every step, so it cannot be replayed. :class:`SlotDecoder` decodes the same rows through a
:class:`~._slot_step.SlotDecodeStep` per key (padded rows, slot length, sampler variant, recording), kept
between batches, whose caches are views of the engine's one :class:`~._kv_pool.KVPool` (the batched rows'
decoder's too: the slot layout's shape, a row's slot its position, is a layout of it), each captured as a
graph on first use (``_decode_graphs``):

* :meth:`SlotDecoder.place` decides, once a batch, where it goes: its layout in the pool (made to hold it;
  ``SlotLayout.fill`` then prefills straight into the pool's view of it, and ``SlotDecodeStep.begin`` finds
  the prompts' KV in place), or the eager slot steps in a cache of their own (layers the pool cannot lay
  out, forward hooks, or a pool sized from the budget that the batch does not fit), counted in
  :attr:`SlotDecoder.stats`. The engine first splits a deterministic batch into pieces that fit a
  budget-sized pool (:meth:`SlotDecoder.chunks`): a deterministic row's tokens do not depend on its company;
* the rows are padded as the slot layout pads them (``padded_rows``: a multiple of ``ROW_BLOCK``, on CUDA
  the row bucket) and the slots to a multiple of the length quantum (``SLOT_BLOCK`` on the CPU, the graphs'
  ``LENGTH_QUANTUM`` on CUDA: both multiples of ``SLOT_BLOCK``, as the layout needs), chosen once a batch;
* the loop is the one the batched static decoder runs too (``_step_loop.StepLoop``): pipelined (step n+1
  launched before the host reads step n's tokens: one wait a step, on that copy), finished rows stay in the
  batch until the live ones fit a smaller row bucket, where the step in flight is drained and the live rows
  move to the pool's front rows (``hand_over``).

What the self-test (``_batch_invariance``) probes is this very step when the decoder is on (its verdicts
are keyed by it), so a co-stepped row is still token-identical to the row alone. Used on CUDA by default,
on the CPU only where asked (``INTERLENS_STATIC_DECODE=1``, or a test setting ``SlotLayout.decoder``). A
model with sliding-window layers (gemma2, gemma3) decodes here too: its pool's layers are all full-length
and the step builds a sliding layer's window from each row's position into that layer type's mask (the
eager slot step's masks, value for value: ``_slot_step``). Not for layers the pool does not lay out
(``KVPool.supported``), nor while forward hooks are on the model: those run the eager slot loop.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ._buckets import LENGTH_QUANTUM, length_bucket
from ._decode import ModelRunner, Row
from ._decode_graphs import GraphRunner
from ._kv_pool import KVPool
from ._slot_rows import SLOT_BLOCK, SlotLayout, padded_rows
from ._slot_step import SlotDecodeStep
from ._static_sampler import variant_for
from ._step_loop import StepLoop, StepLoopOwner, forward_hooked, static_wanted

__all__ = ["SlotDecoder", "slot_decoder_for"]


def slot_decoder_for(runner: ModelRunner, *, pool: KVPool | None = None) -> SlotDecoder | None:
    """The slot layout's static decoder: on CUDA unless ``INTERLENS_STATIC_DECODE=0``; elsewhere only with
    ``INTERLENS_STATIC_DECODE=1``; never for a model split over devices (as ``static_decoder_for``).
    ``pool``: the engine's KV pool, the batched rows' decoder's too."""
    return SlotDecoder(runner, pool=pool) if static_wanted(runner) else None


class SlotDecoder(StepLoopOwner):
    """Static-shape decoding of slot-layout rows for one runner (module docstring). ``quantum``: the slot
    length's step (a multiple of ``SLOT_BLOCK``); ``graphs``: the graph runner (a test may give one);
    ``pool``: the engine's KV pool (None: one of its own, grown by need)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        quantum: int | None = None,
        graphs: GraphRunner | None = None,
        pool: KVPool | None = None,
    ):
        self.runner = runner
        cuda = runner.device.startswith("cuda")
        self.quantum = quantum if quantum is not None else (LENGTH_QUANTUM if cuda else SLOT_BLOCK)
        if self.quantum % SLOT_BLOCK:
            from .._core import ConfigurationError

            raise ConfigurationError(
                f"SlotDecoder(quantum={self.quantum}): the slot length's step must be a multiple of "
                f"SLOT_BLOCK ({SLOT_BLOCK}), or the key reductions' lanes move with the length"
            )
        self.pool = pool if pool is not None else KVPool(runner.model)
        #: batches, steps by how they ran ("graph", "eager: why"), hand-overs, ignored steps, where each
        #: batch's prefill went ("prefills: in the pool" / "copied in"), batches left to the eager slot
        #: steps ("eager batches: why": counted once a batch, by :meth:`place`)
        self.stats: Counter[str] = Counter()
        #: the steps by (padded rows, slot length, variant, recording), the host buffers, the loop
        self.loop: StepLoop[SlotDecodeStep] = StepLoop(
            graphs=graphs if graphs is not None else GraphRunner(device=runner.device), stats=self.stats
        )
        self._generation = self.pool.generation

    def serves(self, layout: SlotLayout) -> bool:
        """Whether the layout's rows decode here: every layer full or sliding-window attention (the pool's
        layers), no forward hooks (counted nowhere: :meth:`place` counts a batch left to the eager slot
        steps, once)."""
        return self._refusal(layout) is None

    def _refusal(self, layout: SlotLayout) -> str | None:
        """Why the layout's rows cannot decode here (None: they can)."""
        if not self.pool.supported:
            return "cache layers"
        if forward_hooked(self.runner.model):
            return "forward hooks"
        return None

    def length_for(self, slots: int) -> int:
        """The slot length a batch needing ``slots`` slots runs at."""
        return length_bucket(slots, quantum=self.quantum)

    def place(self, layout: SlotLayout, rows: int, need: int) -> int | None:
        """Where a batch of ``rows`` rows needing ``need`` slots (longest prompt + largest token cap) is
        prefilled and decoded: the slot length of its layout in the pool (padded rows x that length), made
        to hold it, or None where it decodes in the eager slot steps in a cache of its own (a refusal of
        :meth:`serves`, or a pool sized from the budget that it does not fit), counted in :attr:`stats`
        once a batch."""
        why = self._refusal(layout)
        if why is None:
            length = self.length_for(need)
            if self._room(padded_rows(rows, buckets=layout.buckets), length):
                return length
            why = "pool full"
        self.stats[f"eager batches: {why}"] += 1
        return None

    def chunks(self, prompts: list[int], caps: list[int], *, buckets: bool) -> list[list[int]]:
        """Rows (prompt lengths ``prompts``, token caps ``caps``) in consecutive batches whose padded layouts
        (``padded_rows`` x the slot length of the longest prompt + the largest cap) fit a pool sized from
        the budget: all in one where it is sized by need; a row alone past the pool is a batch of its own
        (which :meth:`place` leaves to the eager slot steps). A deterministic row's tokens do not depend
        on its company, so a split changes none."""
        return self.pool.pieces(
            prompts, caps, lambda rows, need: padded_rows(rows, buckets=buckets) * self.length_for(need)
        )

    def probe_step(self, rows: int, length: int) -> SlotDecodeStep:
        """A greedy step over the pool that is never captured: the self-test runs it eagerly under its
        forward hooks (``_batch_invariance``); the pool is grown for it past a budget if it must be."""
        if not self._room(rows, length):
            self.pool.reserve(rows, length)
            self._room(rows, length)
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
        row ``index[j]``: the pool's view where :meth:`place` placed the batch, or a cache of its own, copied
        in) until every one is finished, with ``ModelRunner.decode``'s effects on the rows. ``buckets``:
        pad rows to row buckets (``padded_rows``). Call in ``SlotLayout.invariant_kernels``."""
        settings = [r.request.sampling for r in rows]
        prompts = [r.request.prompt_ids for r in rows]
        record = any(r.request.record_logprobs for r in rows)
        variant = variant_for(settings)
        length = self.length_for(max(len(p) for p in prompts) + max(s.max_new_tokens for s in settings))
        self.stats["batches"] += 1
        step, mode = self._step(padded_rows(len(rows), buckets=buckets), length, variant, record)
        self.stats[
            "prefills: in the pool" if step.prefilled_in_place(prefill) else "prefills: copied in"
        ] += 1
        step.begin(settings, prefill=prefill, index=index, prompts=prompts)
        del prefill
        self.loop.run(
            self.runner,
            rows,
            step,
            mode,
            padded=lambda live: padded_rows(live, buckets=buckets),
            smaller_step=lambda smaller: self._step(smaller, length, variant, record),
            cancelled=cancelled,
        )
        self._after_batch(rows)

    def _step(self, rows: int, length: int, variant: str, record: bool) -> tuple[SlotDecodeStep, str]:
        """The step for this key (built on first use, its graph captured then) and how it runs."""
        if not self._room(rows, length):  # place() made room for the batch's layout
            raise AssertionError(f"no room in the KV pool for {rows} x {length} slots")
        return self.loop.step(
            (rows, length, variant, record),
            lambda: SlotDecodeStep(
                self.runner.model, rows=rows, length=length, variant=variant, record=record, pool=self.pool
            ),
        )
