"""Whether this engine's batched forward pass is batch-invariant: the gate for co-stepping deterministic rows.

A deterministic row samples from its own seeded stream (``_sampling``), so its tokens depend only on its own
logits. If every row gets bitwise the same logits alone and inside a left-padded batch (other partners,
other lengths, padding, a longer static cache, rows dropped mid-decode), deterministic rows may share one
batch and stay token-identical to running alone. Whether that holds depends on the model, the device, the
dtype and the kernels the library picks per shape (a BLAS kernel may change its reduction order with the
number of rows), so it is not assumed: :func:`batch_invariant` measures it once per engine, on the very
calls the co-stepped path makes (``ModelRunner._forward`` into a ``_new_batch_cache`` cache, then
``ModelRunner._step``, with ``reorder_cache`` dropping a row as the decode loop does).

Comparing the logits alone is too weak: in bfloat16 a kernel whose float32 accumulation differs by the
batch shape rounds to the same bf16 value almost always, and differs only now and then (seen on CPU: a
``q_proj`` of 6 rows and of 1 row, equal inputs, one differing element at the 8th decode step of a real
debate). So every submodule's output is compared too, at every position of every row (forward hooks), with
``torch.equal``: many thousands of roundings, where such a kernel shows itself. A single differing bit says
no, and the engine then runs deterministic rows alone. It is still a sample, not a proof.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from interlens._decode import left_pad
from interlens._prefill import BatchPrefill

if TYPE_CHECKING:
    import torch

__all__ = ["batch_invariant"]

#: Prompt lengths of the probe rows (different, so the batch is left-padded) and the batch compositions
#: checked against each row alone (indices into the probe rows: different partners, sizes and widths).
_LENGTHS = (3, 9, 5, 14, 2, 7, 21, 11)
_BATCHES = ((0, 1, 2, 3, 4, 5, 6, 7), (1, 4), (5, 3, 0), (7, 6, 2, 1, 0, 4))
_STEPS = 6  # decode steps after the prefill
_SLACK = 3  # a batch mate with a longer max_new makes the batch's static cache longer than a row's alone

#: Per row: per forward call (the prefill, then each step), the row's slice of every observed output.
_Trace = list[list[list["torch.Tensor"]]]


def batch_invariant(runner: BatchPrefill) -> bool:
    """True when every probe row's logits and submodule outputs, at the prefill and every decode step, are
    bitwise equal alone and in each probe batch (see the module docstring). Call under inference mode."""
    import torch

    vocab = runner._vocab_size
    prompts = [[(7 * r + 3 * j + 11) % vocab for j in range(n)] for r, n in enumerate(_LENGTHS)]
    feeds = [[(13 * r + 5 * s + 17) % vocab for s in range(_STEPS)] for r in range(len(_LENGTHS))]
    pairs = zip(prompts, feeds, strict=True)
    alone = [_run(runner, [p], [f], slack=0, drop_first_at=None)[0] for p, f in pairs]
    for members in _BATCHES:
        together = _run(
            runner, [prompts[r] for r in members], [feeds[r] for r in members], slack=_SLACK, drop_first_at=2
        )
        for r, got in zip(members, together, strict=True):
            want = alone[r][: len(got)]
            for a_call, b_call in zip(want, got, strict=True):
                if len(a_call) != len(b_call):
                    return False
                if not all(
                    a.shape == b.shape and torch.equal(a, b) for a, b in zip(a_call, b_call, strict=True)
                ):
                    return False
    return True


def _run(
    runner: BatchPrefill,
    prompts: list[list[int]],
    feeds: list[list[int]],
    *,
    slack: int,
    drop_first_at: int | None,
) -> _Trace:
    """Each row's trace through the plain left-padded batch path (``BatchPrefill`` without shared or grouped
    prefill, then the decode loop's steps); the first row leaves the batch after step ``drop_first_at`` as a
    finished row does (``reorder_cache``), so its trace is shorter."""
    import torch

    device = runner.device
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids, mask = left_pad(prompts, width, runner._pad_id)
    cache, static = runner._new_batch_cache(width + _STEPS + slack)
    seen: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(lambda _m, _i, out: _keep(seen, out))
        for name, module in runner.model.named_modules()
        if name
    ]
    try:
        logits = runner._forward(ids, mask, cache, device)
        full = torch.cat(
            [
                torch.tensor(mask, dtype=torch.long),
                torch.ones(len(prompts), _STEPS + slack, dtype=torch.long),
            ],
            1,
        )
        attn = None if min(lengths) == width else full.to(device)
        positions = torch.tensor(lengths, dtype=torch.long, device=device)
        active = list(range(len(prompts)))
        out: _Trace = [[] for _ in prompts]
        _record(out, active, seen, logits, [lengths[r] for r in active], width)
        kv_len = width
        for step in range(_STEPS):
            if step == drop_first_at and len(active) > 1:
                keep = torch.arange(1, len(active), dtype=torch.long, device=device)
                cache.reorder_cache(keep)
                positions = positions.index_select(0, keep)
                if attn is not None:
                    attn = attn.index_select(0, keep)
                    if bool(attn.all()):
                        attn = None
                active = active[1:]
            tokens = torch.tensor([[feeds[r][step]] for r in active], dtype=torch.long, device=device)
            kv_len += 1
            seen.clear()
            logits = runner._step(tokens, positions, attn, cache, kv_len, static)
            positions = positions + 1
            _record(out, active, seen, logits, [1] * len(active), 1)
    finally:
        for handle in handles:
            handle.remove()
    return out


def _keep(seen: list[Any], out: Any) -> None:
    tensor = out[0] if isinstance(out, tuple) and out else out
    if hasattr(tensor, "shape") and getattr(tensor, "dim", lambda: 0)() >= 2:
        seen.append(tensor)


def _record(
    out: _Trace, active: list[int], seen: list[torch.Tensor], logits: torch.Tensor, own: list[int], width: int
) -> None:
    """Append one forward call to each active row's trace: its logits, and of every output laid out as
    (rows, tokens, ...) its own tokens (the last ``own[k]`` of ``width``: the rest is left padding)."""
    rows = len(active)
    for k, r in enumerate(active):
        call = [logits[k].clone()]
        for t in seen:
            if t.shape[0] == rows and t.shape[1] == width:
                call.append(t[k, width - own[k] :].clone())
        out[r].append(call)
    seen.clear()
