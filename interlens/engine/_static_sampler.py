"""The sampler of a captured decode step: every row of a bucket through the same tensor ops, per-row settings
as tensors, no host sync and no shape that depends on the batch's mix.

The eager :class:`~._sampler.Sampler` picks its work by the batch's mix (greedy rows leave by
``index_select``, a part is built only where a row uses its setting): shapes and Python branches that change
with the batch, which a graph cannot replay. Here every row takes every path of its *variant* and a
``torch.where`` keeps each row's own answer, with the parts' math itself (``_sampler_parts``:
``draw_inverse_cdf``, the nucleus draw) on the whole batch. All of it is row-wise, so a row's token and
log-probabilities are the eager sampler's for the same logits and uniform:

* a greedy row takes the argmax of its logits (its temperature and top-p buffers hold 1.0, so its weights,
  computed and ignored, stay finite);
* a sampling row's float32 scores are divided by its temperature (1.0 divides to the same bits, as the eager
  sampler's skipped :class:`~._sampler_parts.Temperature` leaves them), weighed ``exp(x - max)`` and drawn
  by inverse CDF over the vocabulary with its uniform, or, where its top-p < 1, within its nucleus
  (:class:`~._sampler_parts.TopP`'s draw);
* recorded: the model's log-probability ``logit - logsumexp(float32 logits)``, and the sampling one
  ``log(weight) - log(total x kept mass)`` (0.0 for a greedy row), as ``Sampler._logprobs`` computes them.

Variants (:data:`VARIANTS`, each serving the ones before it) keep a graph from paying for what no row of
its batch uses: ``greedy`` (argmax only), ``sample`` (the draw over the vocabulary), ``top_p`` (the nucleus's
sort too). A new sampling part that needs its own pass is a new variant here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._sampler_parts import _nucleus_sample, draw_inverse_cdf
from ._sampling import SamplingSettings

if TYPE_CHECKING:
    import torch

__all__ = ["VARIANTS", "sample_rows", "variant_for"]

#: The sampler variants, cheapest first; a step built for one serves every batch an earlier one serves.
VARIANTS: tuple[str, ...] = ("greedy", "sample", "top_p")


def variant_for(settings: Sequence[SamplingSettings]) -> str:
    """The cheapest variant that samples rows with these settings as the eager sampler would."""
    sampling = [s for s in settings if s.temperature > 0]
    if not sampling:
        return "greedy"
    return "top_p" if any(s.top_p < 1.0 for s in sampling) else "sample"


def sample_rows(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    variant: str,
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every row's token, whether its logits were usable, and with ``record`` the (rows, 2) float32
    log-probabilities (model, sampling) of the tokens: the eager sampler's answers row by row (module
    docstring). ``temperature``, ``top_p``, ``uniforms``: (rows,) float32; ``greedy``: (rows,) bool; the
    greedy rows' temperature and top-p must be 1.0. ``variant`` and ``record`` are fixed per graph: the only
    Python branches here."""
    import torch

    best, argmax = logits.max(dim=-1)  # NaN propagates into the maximum: a row with one is not finite
    finite = best.isfinite()
    model_lse = logits.float().logsumexp(dim=-1) if record else None
    if variant == "greedy":
        return argmax, finite, _recorded(logits, argmax, model_lse, None)
    weights = logits.to(torch.float32, copy=True)
    weights.div_(temperature.unsqueeze(1))
    top = weights.amax(dim=-1, keepdim=True)
    weights.sub_(top).exp_()
    plain = draw_inverse_cdf(weights, uniforms)
    kept: torch.Tensor | None = None
    if variant == "top_p":
        cut = top_p < 1.0
        nucleus, mass = _nucleus_sample(
            weights / weights.sum(dim=-1, keepdim=True), top_p.unsqueeze(1), uniforms
        )
        picked = torch.where(cut, nucleus, plain)
        kept = torch.where(cut, mass, 1.0)
    else:
        picked = plain
    chosen = torch.where(greedy, argmax, picked)
    finite = finite & (greedy | top.squeeze(1).isfinite())
    drawn = (weights, picked, kept, greedy)
    return chosen, finite, _recorded(logits, chosen, model_lse, drawn)


def _recorded(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    model_lse: torch.Tensor | None,
    drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None,
) -> torch.Tensor | None:
    """(rows, 2): the chosen tokens' log-probabilities under the model and under the distribution drawn
    from (``drawn``: the weights, the sampling picks, their kept mass or None, the greedy flags); None
    without recording."""
    import torch

    if model_lse is None:
        return None
    model = logits.gather(1, chosen.unsqueeze(1)).squeeze(1).float() - model_lse
    if drawn is None:
        return torch.stack([model, torch.zeros_like(model)], dim=1)
    weights, picked, kept, greedy = drawn
    total = weights.sum(dim=-1)
    if kept is not None:
        total = total * kept
    sampled = weights.gather(1, picked.unsqueeze(1)).squeeze(1).log() - total.log()
    return torch.stack([model, torch.where(greedy, 0.0, sampled)], dim=1)
