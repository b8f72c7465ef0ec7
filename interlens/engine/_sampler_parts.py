"""The sampler's parts: one sampling setting each, applied to every row of a batch at once.

The decode loop's :class:`~._sampler.Sampler` runs them, in the order of :data:`PARTS`, on the float32 copy of
the sampling rows' logits (greedy rows have left by then: :class:`Greedy`). A part is what vLLM calls a
logits processor: per-row state built once per batch composition from each row's
:class:`~._sampling.SamplingSettings`, narrowed by :meth:`SamplingPart.select` when rows leave, and applied
to the batch's tensors in the hot path. A part hooks in at the step that suits its setting:

* ``scale``: the scores in log space, before the softmax's exponent (:class:`Temperature` divides them);
* ``weigh``: the unnormalised weights ``exp(x/T - max)``, whose row maximum is 1 (a ``min_p`` part zeroes
  every weight below ``min_p``: the draw and the recorded log-probability read the weights as left, so a
  weight it zeroes is out of both with nothing more to say);
* ``draw``: a part that cuts by rank draws its rows itself in its own order and says the share of the
  weights' total it kept, for the recorded sampling log-probability (:class:`TopP`: the nucleus, sorted).

Hooks work on batched tensors (one per-row tensor per setting) with no host sync and no per-row Python, so
the same parts can run inside a captured decode step. A part for a setting no row of the batch uses is never
built (``build`` returns None): a batch without a nucleus pays nothing for top-p.

Adding a setting: a field on ``SamplingSettings`` (with its rule in ``check``), a part here listed in
:data:`PARTS`, and the participant's keyword; nothing in the sampler or the decode loop changes.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ._sampling import SamplingSettings

if TYPE_CHECKING:
    import torch

__all__ = ["PARTS", "Greedy", "SamplingPart", "Temperature", "TopP"]


class SamplingPart(Protocol):
    """One sampling setting's effect on the sampling rows of a batch (greedy rows never reach a part).

    Rows are the batch's sampling rows, in batch order. Every hook has a default that leaves the rows as they
    are, so a part subclassing this protocol writes only the hooks its setting needs.
    """

    @classmethod
    @abstractmethod
    def build(cls, settings: Sequence[SamplingSettings], device: str) -> SamplingPart | None:
        """The part's per-row state for rows with these settings (tensors on ``device``), or None when no
        row uses the setting (the sampler then skips it)."""
        ...

    @abstractmethod
    def select(self, keep: list[int]) -> SamplingPart | None:
        """This part for the rows ``keep`` (indices into its rows, in order) when the others leave the batch;
        None when no kept row uses the setting. Off the hot path: once per batch reduction."""
        ...

    def scale(self, scores: torch.Tensor) -> None:
        """Change the rows' float32 scores (log space, rows x vocab) in place, before the softmax."""
        return None

    def weigh(self, weights: torch.Tensor) -> None:
        """Change the rows' unnormalised weights ``exp(x - max)`` in place (each row's largest is 1); a weight
        set to 0 is a token the row cannot draw."""
        return None

    def draw(self, weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Draw every row's token itself from ``weights`` with the row's uniform ``u`` (rows,), returning the
        tokens and each row's kept mass: the share of its weights' total its draw was taken from (1 where it
        kept all). None (the default): the sampler's inverse-CDF draw over the whole vocabulary. At most one
        part of a pipeline draws."""
        return None


class Greedy:
    """Rows at temperature <= 0 take their argmax: they leave the draw (and its passes over the vocabulary)
    before any part runs, and the probability of their pick under the distribution drawn from is 1.

    The first part of every pipeline, so not in :data:`PARTS`: it decides which rows the others see.
    """

    def __init__(self, settings: Sequence[SamplingSettings], device: str) -> None:
        import torch

        #: the batch rows that sample, in order: the rows every other part and the uniforms are over
        self.sampling = [j for j, s in enumerate(settings) if s.temperature > 0]
        self.all_greedy = not self.sampling
        self.all_sampling = len(self.sampling) == len(settings)
        self.sampling_idx = (
            None
            if self.all_greedy or self.all_sampling
            else torch.tensor(self.sampling, dtype=torch.long, device=device)
        )

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling rows' logits."""
        return logits if self.sampling_idx is None else logits.index_select(0, self.sampling_idx)

    def choose(self, logits: torch.Tensor, picked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's token (the argmax, or the sampling row's pick) and whether the row's logits were
        usable (the row maximum is finite: NaN propagates into it)."""
        best, chosen = logits.max(dim=-1)
        if picked is not None and self.sampling_idx is not None:
            chosen[self.sampling_idx] = picked
        return chosen, best.isfinite()

    def spread(self, sampled: torch.Tensor, rows: int) -> torch.Tensor:
        """The sampling rows' values spread over the whole batch, 0.0 on the greedy rows."""
        if self.sampling_idx is None:
            return sampled
        out = sampled.new_zeros(rows)
        out[self.sampling_idx] = sampled
        return out


class Temperature(SamplingPart):
    """Divides each row's scores by its temperature (> 0: greedy rows have left). Not built when every row's
    is 1.0: dividing by 1 changes no bit, so skipping it is the same draw for one pass less."""

    def __init__(self, values: list[float], device: str) -> None:
        import torch

        self.values = values
        self.device = device
        self.temperatures = torch.tensor([[t] for t in values], dtype=torch.float32, device=device)

    @classmethod
    def build(cls, settings: Sequence[SamplingSettings], device: str) -> Temperature | None:
        values = [float(s.temperature) for s in settings]
        return cls(values, device) if any(t != 1.0 for t in values) else None

    def select(self, keep: list[int]) -> Temperature | None:
        values = [self.values[k] for k in keep]
        return type(self)(values, self.device) if any(t != 1.0 for t in values) else None

    def scale(self, scores: torch.Tensor) -> None:
        scores.div_(self.temperatures)


class TopP(SamplingPart):
    """Nucleus sampling: each row with top_p < 1 draws within its smallest set of most likely tokens whose
    mass reaches its top_p, in descending order of weight (a stable sort: ties break the same way in any
    batch); the batch's other rows draw over the whole vocabulary in vocabulary order. The nucleus's share
    of the row's weights is its kept mass."""

    def __init__(self, values: list[float], device: str) -> None:
        import torch

        self.values = values
        self.device = device
        nucleus = [k for k, p in enumerate(values) if p < 1.0]
        plain = [k for k, p in enumerate(values) if p >= 1.0]
        self.nucleus_idx = torch.tensor(nucleus, dtype=torch.long, device=device)
        self.plain_idx = torch.tensor(plain, dtype=torch.long, device=device) if plain else None
        self.top_p = torch.tensor([[values[k]] for k in nucleus], dtype=torch.float32, device=device)

    @classmethod
    def build(cls, settings: Sequence[SamplingSettings], device: str) -> TopP | None:
        values = [float(s.top_p) for s in settings]
        return cls(values, device) if any(p < 1.0 for p in values) else None

    def select(self, keep: list[int]) -> TopP | None:
        values = [self.values[k] for k in keep]
        return type(self)(values, self.device) if any(p < 1.0 for p in values) else None

    def draw(self, weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        picked = torch.empty(weights.shape[0], dtype=torch.long, device=weights.device)
        if self.plain_idx is not None:
            rows = self.plain_idx
            picked[rows] = draw_inverse_cdf(weights.index_select(0, rows), u.index_select(0, rows))
        nucleus = weights.index_select(0, self.nucleus_idx)
        picked[self.nucleus_idx], mass = _nucleus_sample(
            nucleus / nucleus.sum(dim=-1, keepdim=True), self.top_p, u.index_select(0, self.nucleus_idx)
        )
        kept = torch.ones(weights.shape[0], dtype=torch.float32, device=weights.device)
        kept[self.nucleus_idx] = mass
        return picked, kept


#: The parts every sampler runs, in this order (after :class:`Greedy`): a new setting's part is listed here.
PARTS: tuple[type[SamplingPart], ...] = (Temperature, TopP)


#: The vocabulary is cut into blocks of this many tokens for a draw (:func:`draw_inverse_cdf`).
_BLOCK = 256


def draw_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's draw: inverse CDF over non-negative ``weights`` (rows × vocab, contiguous,
    unnormalised) in vocabulary order, without a cumsum over the whole vocabulary: block sums (a vectorised
    reduction), their cumsum, the block the target ``u × total`` falls in, then a cumsum over that block
    alone. The same draw as ``_inverse_cdf(weights.cumsum(-1), u)`` up to the sums' rounding; row-wise, so a
    row's token depends on its own weights and uniform only.

    The block's own cumsum may round to end at or below the part of the target left for it: the block's last
    token with weight is taken then, so a token of zero weight is never chosen.
    """
    import torch

    rows, vocab = weights.shape
    if vocab < 4 * _BLOCK:
        return _inverse_cdf(weights.cumsum(dim=-1), u)
    whole = vocab // _BLOCK * _BLOCK
    sums = weights[:, :whole].view(rows, -1, _BLOCK).sum(dim=-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cdf, target.unsqueeze(1), right=True).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0).squeeze(1)
    columns = block * _BLOCK + torch.arange(_BLOCK, device=weights.device)
    part = weights.gather(1, columns.clamp(max=vocab - 1)) * (columns < vocab)
    within = torch.searchsorted(part.cumsum(dim=-1), (target - before).unsqueeze(1), right=True)
    offsets = torch.arange(_BLOCK, device=weights.device).expand_as(part)
    last = torch.where(part > 0, offsets, 0).amax(dim=-1, keepdim=True)
    index = (block * _BLOCK + torch.minimum(within, last)).squeeze(1)
    # clamped for a row whose weights were NaN: the decode loop fails that row, but an index past the
    # vocabulary must never reach a gather on the device (a CUDA device-side assert)
    return index.clamp_(min=0, max=vocab - 1)


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """For each row, the first index whose cumulative mass exceeds ``u * total`` (total: the row's last cdf).

    The target is kept strictly below ``total``, so the index is always in range, and the first index whose
    cdf EXCEEDS the target is one where the cdf jumps: a token of zero probability is never chosen.
    """
    import torch

    if total is None:
        total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # clamped for a row whose logits were NaN (its target too): the decode loop fails that row, but an
    # index past the vocabulary must never reach a gather on the device (a CUDA device-side assert)
    index = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return index.clamp_(max=cdf.shape[-1] - 1)


def _nucleus_sample(
    probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample each row within its smallest set of most likely tokens whose mass reaches its top_p; returns
    the tokens and each row's kept mass (the nucleus's share of ``probs``).

    In descending order (a stable sort, so ties are broken the same way in any batch) the kept tokens are a
    prefix: every token whose cdf is below top_p, plus the one that reaches it. Sampling inside that prefix
    needs only the cdf up to its end.
    """
    import torch

    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cdf = sorted_probs.cumsum(dim=-1)
    kept = (torch.searchsorted(cdf, top_p) + 1).clamp(max=cdf.shape[-1])  # top_p: (rows, 1)
    total = cdf.gather(1, kept - 1).squeeze(1)
    index = _inverse_cdf(cdf, u, total)
    return order.gather(1, index.unsqueeze(1)).squeeze(1), total
