"""The engine's decode loop over static-shape steps: what ``ModelRunner.decode`` runs on CUDA (as graphs).

The eager loop (``_decode.ModelRunner.decode``) allocates as it goes and changes shapes every step (a
narrowed window, compaction into new tensors, a sampler whose tensors follow the batch's mix), so it cannot
be replayed. :class:`StaticDecoder` decodes the same batch through a
:class:`~._static_step.StaticDecodeStep` per bucket key (row bucket, length bucket, sampler variant,
recording), kept between batches, whose caches are views of the engine's one :class:`~._kv_pool.KVPool`:

* the prefill wrote the batch's KV straight into the pool (every plain and kept-KV prefill path asks
  :meth:`StaticDecoder.layout` where, and writes through ``KVPool.span`` views: ``_pool_prefill``), so
  ``begin`` finds it in place (counted in :attr:`StaticDecoder.stats`; a cache of the batch's own is copied
  into the pool's front rows) and draws the first tokens from the prefill's logits;
* each step runs the step's function (a replayed graph on CUDA: ``_decode_graphs``) and queues the copy of
  its chosen tokens (-1 for a row whose logits went non-finite) to pinned host memory; the loop is
  pipelined: step n+1 is launched before the host waits for step n's tokens (its one wait a step, on that
  copy's event only) and makes the eager loop's checks (end of turn, stop strings, token caps), so the
  host's checks overlap the device's next step. A row ended at step n costs step n+1, ignored; no step is
  launched ahead where every live row takes its last token in the one in flight. Recorded
  log-probabilities are copied on the device and read once at the end;
* finished rows stay in the batch (fed ignored tokens) until the live ones fit a smaller row bucket; there
  the step in flight is drained (read and checked) first, the kept-KV collector (``on_leave``) reads the
  leaving rows, then the live rows move to the pool's front rows (``hand_over``) and the smaller bucket's
  step carries on. The length bucket is chosen once per batch (its longest prompt plus its largest token
  cap), so no step runs out of slots.

The pool is the engine's one pool, shared with the deterministic rows' decoder (``_slot_decode``; the engine
hands both the same ``KVPool``). It is sized once from the engine's batch budget where the engine gives one
(CUDA: ``budget``, the scheduler's first token budget): a batched batch is split by the engine into pieces
whose padded layouts fit it (:meth:`StaticDecoder.chunks`), and a batch that still does not fit (one row past
the whole pool, a kept-KV layout wider than its prompts) decodes in the eager loop in its own cache. Without
a budget (the CPU) the pool grows by need, reallocated (steps and graphs rebuilt, here and in the other
decoder, which sees the pool's generation move) when a batch needs more slots than any before.

The steps kept per key, the launch/read of a step and the loop itself live in ``_step_loop`` (shared with
the deterministic rows' ``_slot_decode``); this module decides where a batch goes in the pool, begins it,
and gives the loop its row buckets and the kept-KV collector.

Per-row seeded streams carry on through hand-overs (``Sampler.select``), so a row's tokens are those of the
eager loop (``tests/test_static_decode.py``). Which way each step ran (graph or eager, and why) is counted
in :attr:`StaticDecoder.stats`.

Used on CUDA by default; on the CPU only where asked (``INTERLENS_STATIC_DECODE=1`` when the engine is
built, or a test setting ``ModelRunner.static_decode``): CI proves on the CPU what the GPU replays. A model
with sliding-window layers (gemma2, gemma3) decodes here too: the pool lays every layer out full-length and
a sliding layer's window is in the model's own mask, counted in slots, which is the window in positions in
the layouts such a batch gets (``_kv_pool``; no shared-prefix holes for it: ``_prefill``). Not for layers
the pool does not lay out (``KVPool.supported``: chunked or linear attention, state-space layers), batches
whose cache is not the pool's (a dynamic cache, a stream's single-row cache of a sliding-window model,
deterministic slot rows), nor while forward hooks are on the model (capture and steering, ``interp``):
those run the eager loop.

On CUDA the decoder gives a model on transformers' ``sdpa`` the grouped-query decode attention of
``_cpu_attention`` (``GROUPED_DECODE_ATTENTION``: two batched products and a float32 softmax over the
pool's views, where ``sdpa`` with a mask copies each layer's K/V ``repeat_kv`` times a step); a prefill
still runs ``sdpa``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._buckets import LENGTH_QUANTUM, ROW_BUCKETS, length_bucket, row_bucket
from ._cpu_attention import GROUPED_DECODE_ATTENTION, use_grouped_decode_attention
from ._decode import ModelRunner, Row
from ._decode_graphs import GraphRunner
from ._kv_pool import KVPool
from ._prefill import plain_static
from ._static_sampler import variant_for
from ._static_step import StaticDecodeStep
from ._step_loop import ENV_SWITCH, StepLoop, StepLoopOwner, forward_hooked, static_wanted

if TYPE_CHECKING:
    import torch

__all__ = ["ENV_SWITCH", "StaticDecoder", "static_decoder_for"]


def static_decoder_for(
    runner: ModelRunner, *, budget: Callable[[], int | None] | None = None, pool: KVPool | None = None
) -> StaticDecoder | None:
    """The runner's static decoder: on CUDA unless ``INTERLENS_STATIC_DECODE=0``; elsewhere only with
    ``INTERLENS_STATIC_DECODE=1``; never for a model split over several devices. ``budget``: the pool's
    size in slots, asked when first needed (:class:`StaticDecoder`); ``pool``: the engine's pool."""
    return StaticDecoder(runner, budget=budget, pool=pool) if static_wanted(runner) else None


class StaticDecoder(StepLoopOwner):
    """Static-shape decoding for one runner (module docstring). ``quantum``: the length bucket's step
    (tests use a small one); ``graphs``: the graph runner (a test may give one with a stand-in graph);
    ``pool``: the engine's KV pool (None: one of its own, sized from ``budget``)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        quantum: int = LENGTH_QUANTUM,
        graphs: GraphRunner | None = None,
        grouped_attention: bool | None = None,
        budget: Callable[[], int | None] | None = None,
        pool: KVPool | None = None,
    ) -> None:
        self.runner = runner
        if grouped_attention is None:
            grouped_attention = runner.device.startswith("cuda")
        #: the attention the model's one-token steps run (``_cpu_attention``'s grouped-query products on
        #: CUDA, where the model ran transformers' ``sdpa``: no ``repeat_kv`` copy of K/V a step)
        self.attention = str(getattr(runner.model.config, "_attn_implementation", ""))
        if grouped_attention and use_grouped_decode_attention(runner.model):
            self.attention = GROUPED_DECODE_ATTENTION
        self.quantum = quantum
        self.pool = pool if pool is not None else KVPool(runner.model)
        if budget is not None:
            self.pool.budget = budget
        #: batches, steps by how they ran ("graph", "eager: why"), batches left to the eager loop (why)
        self.stats: Counter[str] = Counter()
        #: the steps by (row bucket, length bucket, variant, recording), the host buffers, the loop
        self.loop: StepLoop[StaticDecodeStep] = StepLoop(
            graphs=graphs if graphs is not None else GraphRunner(device=runner.device),
            stats=self.stats,
            host_rows=ROW_BUCKETS[-1],
        )
        self._generation = self.pool.generation

    @property
    def budget(self) -> Callable[[], int | None] | None:
        """The pool's size in slots, asked once when it is first needed (the engine's ``token_budget``:
        the scheduler's first batch budget in tokens); None, or a budget that says None (the CPU): the
        pool grows by need (``KVPool.budget``: the pool is the engine's, shared by both decoders)."""
        return self.pool.budget

    @budget.setter
    def budget(self, budget: Callable[[], int | None] | None) -> None:
        self.pool.budget = budget

    def serves(self, rows: list[Row], cache: Any, static: bool, kv_len: int) -> bool:
        """Whether this batch can decode here: a static cache of plain layers, rows within the largest
        bucket, no forward hooks on the model, and (a cache not prefilled in the pool) room in the pool for
        its layout (counted in :attr:`stats` when not)."""
        if not static or getattr(cache, "feed", None) is not None or len(rows) > ROW_BUCKETS[-1]:
            return False
        if not plain_static(cache):
            self.stats["eager batches: cache layers"] += 1
            return False
        if forward_hooked(self.runner.model):
            self.stats["eager batches: forward hooks"] += 1
            return False
        if self.pool.holds(cache):
            return True
        need = kv_len + max(r.request.sampling.max_new_tokens for r in rows)
        if not self._room(row_bucket(len(rows)), length_bucket(need, quantum=self.quantum)):
            self.stats["eager batches: pool full"] += 1
            return False
        return True

    def layout(self, rows: int, need: int) -> int | None:
        """Where a batch of ``rows`` rows needing ``need`` slots (prompt width + largest token cap) is to
        be prefilled: the length bucket of its layout in the pool, made to hold it (the prefill then writes
        straight into :meth:`KVPool.span` views of it, which the steps read), or None where the batch will
        not decode here (too many rows, layers the pool does not lay out, forward hooks on the model, no
        room in a pool sized from the budget): the prefill then builds its own cache."""
        if not 1 <= rows <= ROW_BUCKETS[-1] or forward_hooked(self.runner.model) or not self.pool.supported:
            return None
        length = length_bucket(need, quantum=self.quantum)
        if not self._room(row_bucket(rows), length):
            return None
        return length

    def chunks(self, prompts: list[int], caps: list[int]) -> list[list[int]]:
        """Rows (prompt lengths ``prompts``, token caps ``caps``) in consecutive batches whose padded layouts
        (row bucket x length bucket of the longest prompt + the largest cap) fit a pool sized from the
        budget: all in one where it is sized by need; a row alone past the pool is a batch of its own,
        which then decodes eagerly in its own cache (``serves``)."""

        def layout(rows: int, need: int) -> int | None:
            if rows > ROW_BUCKETS[-1]:
                return None
            return row_bucket(rows) * length_bucket(need, quantum=self.quantum)

        return self.pool.pieces(prompts, caps, layout)

    def decode(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        cache: Any,
        positions: torch.Tensor,
        attn: torch.Tensor | None,
        kv_len: int,
        cancelled: threading.Event | None,
        *,
        on_leave: Callable[[list[int], list[Row], Any, int], None] | None = None,
    ) -> None:
        """``ModelRunner.decode``'s contract (same arguments, same effects on ``rows``; ``on_leave`` gets
        the step's pool-view cache), through static steps."""
        import torch

        settings = [r.request.sampling for r in rows]
        record = any(r.request.record_logprobs for r in rows)
        variant = variant_for(settings)
        length = length_bucket(kv_len + max(s.max_new_tokens for s in settings), quantum=self.quantum)
        self.stats["batches"] += 1
        # prefilled straight into the pool (``_pool_prefill``), or in a cache of its own that begin() copies
        self.stats["prefills: in the pool" if self.pool.holds(cache) else "prefills: copied in"] += 1
        step, mode = self._step(row_bucket(len(rows)), length, variant, record)
        prompt_mask = (
            attn[:, :kv_len] if attn is not None else torch.ones(len(rows), kv_len, dtype=torch.long)
        )
        choice = step.begin(
            settings, kv=cache, prompt_mask=prompt_mask.to(step.device), logits=logits, positions=positions
        )
        del cache, logits
        first = (torch.where(choice.finite, choice.tokens, -1).tolist(), choice.logprobs)
        del choice

        # at a bucket edge the collector reads the leavers before the live rows move to the front rows
        leaving: Callable[[list[int], list[Row], StaticDecodeStep], None] | None = None
        if on_leave is not None:
            collect = on_leave
            leaving = lambda gone, left, at: collect(gone, left, at.cache, kv_len)  # noqa: E731

        step, active = self.loop.run(
            self.runner,
            rows,
            step,
            mode,
            padded=row_bucket,
            smaller_step=lambda smaller: self._step(smaller, length, variant, record),
            cancelled=cancelled,
            first=first,
            on_edge=leaving,
            room=lambda at: at.slots_left > 0,
        )
        if on_leave is not None:
            on_leave(list(range(len(active))), active, step.cache, kv_len)
        self._after_batch(rows)

    def _step(self, rows: int, length: int, variant: str, record: bool) -> tuple[StaticDecodeStep, str]:
        """The step for this key (built on first use, its graph captured then) and how it runs."""
        if not self._room(rows, length):  # serves() or layout() made room for the batch's layout
            raise AssertionError(f"no room in the KV pool for {rows} x {length} slots")
        return self.loop.step(
            (rows, length, variant, record),
            lambda: StaticDecodeStep(
                self.runner.model,
                rows=rows,
                length=length,
                variant=variant,
                record=record,
                pad_id=self.runner.pad_id,
                pool=self.pool,
            ),
        )
