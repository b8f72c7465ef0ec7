"""Whether this engine's deterministic path is batch-invariant: the gate for co-stepping deterministic rows.

A deterministic row samples from its own seeded stream (``_sampler``), so its tokens depend only on its own
logits. Deterministic rows run on the slot layout (``_slot_rows``: prompts prefilled in one right-padded
batch, every row's KV at slots equal to its positions, rows, prefill widths and cache lengths padded to fixed
blocks), built so that a row's arithmetic does not change with its batch mates. Whether it really does not
depends on the kernels the library picks for this model, device and dtype, so it is not assumed:
:func:`batch_invariant` measures it once per engine, on the very calls the co-stepped path makes
(``SlotLayout.fill`` and ``SlotLayout.first``, then ``ModelRunner.step`` into the slot cache, with
``reorder_cache`` dropping a row as the decode loop does): probe rows alone and in batches with other
partners, sizes, prompt lengths and a longer cache.

Comparing the logits alone is too weak: in bfloat16 a kernel whose float32 accumulation differs by the
batch shape rounds to the same bf16 value almost always, and differs only now and then (seen on CPU: a
``q_proj`` of 6 rows and of 1 row, equal inputs, one differing element at the 8th decode step of a real
debate). So every submodule's output is compared too, for every row of every step (forward hooks), with
``torch.equal``: many thousands of roundings, where such a kernel shows itself. A single differing bit says
no, and the engine then runs deterministic rows alone. It is still a sample, not a proof.

Kernels are also picked by the batch's size (cuBLAS by size class), and :func:`batch_invariant` co-steps at
most :data:`PROBED_ROWS` rows. So a deterministic batch of more rows is probed at its own size first
(:func:`invariant_at`: once per size, the engine remembers); where that fails, the engine co-steps the rows
in chunks of the largest size that passed.

Each verdict is also kept on disk (``_verdicts``), keyed by everything it depends on and by
:func:`probe_definition`, so a later process on the same machine, model, dtype and libraries reads it instead
of paying for the test again (the first deterministic rollout of a fresh process was 2.4x slower than the
same rollout again: 29.3 s against 12.3 s, SmolLM2-135M bfloat16, 16 debates, AMD EPYC).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _slot_rows
from ._slot_rows import DECODE_CHUNK_ROWS, ROW_BLOCK, SLOT_BLOCK, padded_rows

if TYPE_CHECKING:
    import torch

    from ._slot_rows import SlotLayout
    from ._slot_step import SlotDecodeStep

__all__ = ["PROBED_ROWS", "batch_invariant", "invariant_at", "probe_definition"]

#: Raised when what the test checks changes in a way its constants do not show, so verdicts kept on disk by
#: an earlier test are not trusted (``_verdicts``).
SELF_TEST_VERSION = 1

#: Prompt lengths of the probe rows (one past a ``SLOT_BLOCK``) and the batch compositions checked against
#: each row alone (indices into the probe rows: other partners, sizes on both sides of ``ROW_BLOCK``), the
#: small batches first: a kernel picked by the row count shows itself there with the fewest rows run.
_LENGTHS = (3, 9, 5, 14, 2, 7, 21, 11, 70)
_BATCHES = ((1, 4), (8, 2), (5, 3, 0), (7, 6, 2, 1, 0, 4), (0, 1, 2, 3, 4, 5, 6, 7, 8))
_STEPS = 6  # decode steps after the prefill
#: The most rows :func:`batch_invariant` co-steps (its largest batch, padded to ``ROW_BLOCK``).
PROBED_ROWS = -(-max(len(b) for b in _BATCHES) // ROW_BLOCK) * ROW_BLOCK
#: A batch mate asking for more tokens makes the batch's cache longer than a row's alone, by a block or more.
_SLACK = SLOT_BLOCK + 3

#: Per row: per forward call (the prefill, then each step), the row's slice of every observed output.
_Trace = list[list[list["torch.Tensor"]]]


def batch_invariant(layout: SlotLayout) -> bool:
    """True when every probe row's logits and submodule outputs, at the prefill and every decode step, are
    bitwise equal alone and in each probe batch on ``layout`` (see the module docstring). Call under
    inference mode."""
    prompts, feeds = _probe_rows(layout, len(_LENGTHS))
    alone: dict[int, _Trace] = {}  # each probe row alone, run when a batch first needs it: where the
    # kernels are not invariant, the first small batch usually says so (on SmolLM2-135M in float32 on an
    # Intel CPU whose GEMM picks its kernel by row count: 1.9 s to say no, instead of 9 s)
    for members in _BATCHES:
        together = _run(
            layout, [prompts[r] for r in members], [feeds[r] for r in members], slack=_SLACK, drop_first_at=2
        )
        for r, got in zip(members, together, strict=True):
            if r not in alone:
                alone[r] = _run(layout, [prompts[r]], [feeds[r]], slack=0, drop_first_at=None)
            if not _same(alone[r][0], got):
                return False
    return True


def invariant_at(layout: SlotLayout, rows: int) -> bool:
    """Whether a batch of ``rows`` probe rows is invariant too: the first, middle and last rows' traces in
    it equal to each alone (a kernel picked by the batch's size changes every row; three are enough to
    see it, and each costs a run alone). Call under inference mode."""
    prompts, feeds = _probe_rows(layout, rows)
    together = _run(layout, prompts, feeds, slack=_SLACK, drop_first_at=2)
    for r in sorted({0, rows // 2, rows - 1}):
        if not _same(_run(layout, [prompts[r]], [feeds[r]], slack=0, drop_first_at=None)[0], together[r]):
            return False
    return True


def probe_definition() -> dict[str, Any]:
    """What a verdict of this test depends on besides the model and machine: the test's probes, the slot
    layout's blocks as they are now (read from ``_slot_rows`` at each call), and the engine's code (a digest
    of its modules' source: an edit to the path the test measures may change its answer)."""
    layout = ("ROW_BLOCK", "SLOT_BLOCK", "PREFILL_BLOCK", "DECODE_CHUNK_ROWS", "PREFILL_CHUNK_ROWS")
    return {
        "test": SELF_TEST_VERSION,
        "code": _engine_code(),
        "lengths": list(_LENGTHS),
        "batches": [list(b) for b in _BATCHES],
        "steps": _STEPS,
        "layout": {name: getattr(_slot_rows, name) for name in layout},
    }


@functools.cache
def _engine_code() -> str:
    digest = hashlib.sha256()
    try:
        for path in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"|" + path.read_bytes())
    except OSError:  # not installed as files: the test's version and constants still key it
        return "unread"
    return digest.hexdigest()


def _probe_rows(layout: SlotLayout, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` probe prompts (lengths cycling through ``_LENGTHS``) and each one's decode feeds."""
    vocab = layout.runner.vocab_size
    lengths = [_LENGTHS[r % len(_LENGTHS)] for r in range(count)]
    prompts = [[(7 * r + 3 * j + 11) % vocab for j in range(n)] for r, n in enumerate(lengths)]
    feeds = [[(13 * r + 5 * s + 17) % vocab for s in range(_STEPS)] for r in range(count)]
    return prompts, feeds


def _same(alone: list[list[torch.Tensor]], together: list[list[torch.Tensor]]) -> bool:
    """A row's trace in a batch (possibly shorter: it left early) bitwise equal to its trace alone."""
    import torch

    for a_call, b_call in zip(alone[: len(together)], together, strict=True):
        if len(a_call) != len(b_call):
            return False
        if not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(a_call, b_call, strict=True)):
            return False
    return True


def _run(
    layout: SlotLayout,
    prompts: list[list[int]],
    feeds: list[list[int]],
    *,
    slack: int,
    drop_first_at: int | None,
) -> _Trace:
    """Each row's trace through the slot path: the batch prefill (each row's own positions), the first step
    (its last prompt token), then the decode loop's steps; the first row leaves the batch after step
    ``drop_first_at`` as a finished row does, so its trace is shorter. The steps are the ones the engine
    runs: the static steps of ``_slot_decode`` where the layout has them, else the eager slot steps."""
    runner = layout.runner
    static = layout.static_steps()
    rows = [tuple(p) for p in prompts]
    out: _Trace = [[] for _ in prompts]
    seen: list[torch.Tensor] = []
    starts: list[int] = []  # per prefill block, its first position, and where its outputs begin in seen
    handles = [
        module.register_forward_hook(lambda _m, _i, o: _keep(seen, o))
        for name, module in runner.model.named_modules()
        if name
    ]
    handles.append(
        runner.model.register_forward_pre_hook(
            lambda _m, _a, kw: starts.extend((int(kw["position_ids"][0, 0]), len(seen))), with_kwargs=True
        )
    )
    try:
        if static:  # prefilled straight into the decoder's pool, at the slots the first step reads
            step = _probe_step(layout, prompts, slack=slack)
            cache = layout.fill(rows, step.length, pool=step.pool)
        else:
            cache = layout.fill(rows, max(len(p) for p in prompts) + _STEPS + slack)
        block = _slot_rows.PREFILL_BLOCK  # the prefill's outputs, block by block: (rows, block, ...)
        for k, p in enumerate(prompts):  # each row's own tokens (the last-position logits are a pad's)
            trace = []
            for i in range(0, len(starts), 2):
                real = min(block, len(p) - 1 - starts[i])
                if real > 0:
                    end = starts[i + 3] if i + 3 < len(starts) else len(seen)
                    trace += [
                        t[k, :real].clone()
                        for t in seen[starts[i + 1] : end]
                        if t.shape[:2] == (len(rows), block)
                    ]
            out[k].append(trace)
        seen.clear()
        handles.pop().remove()
        if static:
            _static_steps(layout, step, prompts, feeds, cache, seen, out, drop_first_at=drop_first_at)
        else:
            _eager_steps(layout, prompts, feeds, cache, seen, out, drop_first_at=drop_first_at)
    finally:
        for handle in handles:
            handle.remove()
    return out


def _eager_steps(
    layout: SlotLayout,
    prompts: list[list[int]],
    feeds: list[list[int]],
    cache: Any,
    seen: list[torch.Tensor],
    out: _Trace,
    *,
    drop_first_at: int | None,
) -> None:
    """The eager slot steps (``SlotLayout.first``, ``ModelRunner.step``; ``reorder_cache`` drops a row)."""
    import torch

    runner = layout.runner
    device = runner.device
    rows = [tuple(p) for p in prompts]
    logits = layout.first(rows, rows, cache)
    positions = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    active = list(range(len(prompts)))
    for step in range(_STEPS + 1):
        for k, r in enumerate(active):
            out[r].append([logits[k].clone()] + [t[k].clone() for t in seen if t.shape[0] == cache.rows])
        if step == _STEPS:
            break
        if step == drop_first_at and len(active) > 1:
            keep = torch.arange(1, len(active), dtype=torch.long, device=device)
            cache.reorder_cache(keep)
            positions = positions.index_select(0, keep)
            active = active[1:]
        tokens = torch.tensor([[feeds[r][step]] for r in active], dtype=torch.long, device=device)
        seen.clear()
        with layout.invariant_kernels(DECODE_CHUNK_ROWS):  # as the slot path's decode loop runs its steps
            logits = runner.step(tokens, positions, None, cache, 0, True)
        positions = positions + 1


def _probe_step(layout: SlotLayout, prompts: list[list[int]], *, slack: int) -> SlotDecodeStep:
    """The decoder's probe step for these rows, the pool made to hold its layout (before the prefill
    writes into it). A batch mate asking for more tokens makes the batch's slots a length quantum longer
    than a row's alone."""
    from ._slot_decode import SlotDecoder

    decoder = layout.decoder
    assert isinstance(decoder, SlotDecoder)
    extra = decoder.quantum + 3 if slack else 0
    length = decoder.length_for(max(len(p) for p in prompts) + _STEPS + extra)
    return decoder.probe_step(padded_rows(len(prompts), buckets=layout.buckets), length)


def _static_steps(
    layout: SlotLayout,
    step: SlotDecodeStep,
    prompts: list[list[int]],
    feeds: list[list[int]],
    cache: Any,
    seen: list[torch.Tensor],
    out: _Trace,
    *,
    drop_first_at: int | None,
) -> None:
    """The static slot steps (``_slot_step``) over the decoder's pool, from ``step`` (its prefill written
    in place), run eagerly (the forward hooks see them; a graph replays these very kernels, checked bit for
    bit at capture: ``_decode_graphs``): a row leaves by a hand-over into the next smaller row count's step,
    as in the decode loop."""
    from ._sampling import SamplingSettings
    from ._slot_decode import SlotDecoder

    decoder = layout.decoder
    assert isinstance(decoder, SlotDecoder)
    n = len(prompts)
    length = step.length
    greedy = SamplingSettings(max_new_tokens=_STEPS + 1, temperature=0)
    step.begin([greedy] * n, prefill=cache, index=list(range(n)), prompts=prompts)
    del cache
    active = list(range(n))
    with layout.invariant_kernels(DECODE_CHUNK_ROWS):  # as the decoder runs its steps
        for s in range(_STEPS + 1):
            seen.clear()
            step.step()
            for k, r in enumerate(active):
                out[r].append([t[k].clone() for t in seen if t.shape[0] == step.rows])
            if s == _STEPS:
                break
            if s == drop_first_at and len(active) > 1:
                to = decoder.probe_step(padded_rows(len(active) - 1, buckets=layout.buckets), length)
                step.hand_over(list(range(1, len(active))), to)
                step, active = to, active[1:]
            step.feed([feeds[r][s] for r in active])


def _keep(seen: list[Any], out: Any) -> None:
    tensor = out[0] if isinstance(out, tuple) and out else out
    if hasattr(tensor, "shape") and getattr(tensor, "dim", lambda: 0)() >= 2:
        seen.append(tensor)
