"""Linear probes read off captured activations: one scalar per turn.

A :class:`Probe` is a direction (and a bias) at one (layer, site). It reads a turn by pooling the answer's
activations over its tokens (``pool="mean"`` or ``"last"``) and taking the dot product with the direction:
``probe.read(record)``, or ``probe.per_turn(cache)`` for every turn in a capture. Built from a known
direction (``Probe(direction, layer=...)``), a difference of means (``Probe.difference_of_means``), or fitted
as a logistic-regression probe on two activation sets (``Probe.fit``).

Made for probe-in-the-loop rollouts: an analyzer captures (or re-reads with ``conv.turn_activations``) and
returns ``probe.per_turn(cache)`` — a few floats per job through the ledger, while the tensors stay in the
worker next to the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from .._core import ConfigurationError, ConfigurationTypeError
from ._capture import SITES, ActivationCache, ActivationRecord
from ._steering import as_vectors

if TYPE_CHECKING:
    import torch

__all__ = ["Probe"]

_POOLS = ("mean", "last")


class Probe:
    """``direction · pooled(answer activations) + bias`` at ``layer`` / ``site``."""

    def __init__(
        self,
        direction: Any,
        *,
        layer: int,
        site: str = "residual",
        pool: Literal["mean", "last"] = "mean",
        bias: float = 0.0,
    ) -> None:
        import torch

        vector = as_vectors([direction], what="Probe(direction=...)")
        if vector.shape[0] != 1:
            raise ConfigurationError(
                f"Probe(direction=...): one direction of d_model floats, got {vector.shape[0]} rows"
            )
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigurationError(f"Probe(layer={layer!r}): a non-negative decoder-layer index")
        if site not in SITES:
            raise ConfigurationError(f"Probe(site={site!r}): one of {list(SITES)}")
        if pool not in _POOLS:
            raise ConfigurationError(f"Probe(pool={pool!r}): 'mean' (over the answer's tokens) or 'last'")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ConfigurationTypeError(f"Probe(bias={bias!r}): a number")
        self.direction: torch.Tensor = vector[0].to(torch.float32)
        self.layer = layer
        self.site = site
        self.pool = pool
        self.bias = float(bias)

    # ------------------------------------------------------------------ building
    @classmethod
    def difference_of_means(
        cls, pos_acts: Any, neg_acts: Any, *, layer: int, site: str = "residual", pool: str = "mean"
    ) -> Probe:
        """Direction ``mean(pos) - mean(neg)``, bias placing 0 halfway between the two means."""
        pos, neg = cls._rows(pos_acts, pool, "pos_acts"), cls._rows(neg_acts, pool, "neg_acts")
        direction = pos.mean(0) - neg.mean(0)
        bias = -float(direction @ (pos.mean(0) + neg.mean(0))) / 2
        return cls(direction, layer=layer, site=site, pool=pool, bias=bias)  # type: ignore[arg-type]

    @classmethod
    def fit(
        cls,
        pos_acts: Any,
        neg_acts: Any,
        *,
        layer: int,
        site: str = "residual",
        pool: str = "mean",
        l2: float = 1e-3,
        steps: int = 200,
    ) -> Probe:
        """A logistic-regression probe (positives -> 1), fitted full-batch with L-BFGS on float32 CPU.

        ``pos_acts`` / ``neg_acts``: ``[n, d_model]`` tensors (one example per row) or ActivationRecords
        (each pooled over its answer with ``pool``). ``l2`` is the weight decay on the direction.
        """
        import torch

        pos, neg = cls._rows(pos_acts, pool, "pos_acts"), cls._rows(neg_acts, pool, "neg_acts")
        x = torch.cat([pos, neg])
        y = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])
        mean, scale = x.mean(0), x.std(0).clamp(min=1e-6)  # standardise for conditioning, fold back after
        z = (x - mean) / scale
        w = torch.zeros(x.shape[1], requires_grad=True)
        b = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w @ w)
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        direction = (w / scale).detach()
        bias = float(b.detach()) - float(direction @ mean)
        return cls(direction, layer=layer, site=site, pool=pool, bias=bias)  # type: ignore[arg-type]

    @staticmethod
    def _rows(acts: Any, pool: str, what: str) -> torch.Tensor:
        if isinstance(acts, Iterable) and not hasattr(acts, "shape"):
            items = list(acts)
            if items and all(isinstance(r, ActivationRecord) for r in items):
                import torch

                return torch.stack([_pooled(r.answer, pool) for r in items])
            acts = items
        return as_vectors(acts, what=f"Probe: {what}")

    # ------------------------------------------------------------------ reading
    def read(self, acts: ActivationRecord | Any) -> float:
        """The probe's scalar for one turn: a record (checked to be at this probe's layer and site) or its
        ``[n_tokens, d_model]`` answer tensor."""
        if isinstance(acts, ActivationRecord):
            if (acts.layer, acts.site) != (self.layer, self.site):
                raise ConfigurationError(
                    f"Probe(layer={self.layer}, site={self.site!r}) cannot read a record of layer "
                    f"{acts.layer}, site {acts.site!r}; pass the record of the probe's layer and site"
                )
            acts = acts.answer
        pooled = _pooled(as_vectors([acts], what="Probe.read"), self.pool)
        if pooled.shape[0] != self.direction.shape[0]:
            raise ConfigurationError(
                f"Probe.read: activations have d_model {pooled.shape[0]}, the probe {self.direction.shape[0]}"
            )
        return float(pooled @ self.direction) + self.bias

    def per_turn(self, cache: ActivationCache, *, participant: str | None = None) -> dict[int, float]:
        """``{message_idx: scalar}`` over the turns in ``cache`` (of ``participant``, if given) that were
        captured at this probe's layer and site."""
        records = cache.query(participant=participant, layer=self.layer, site=self.site)
        if not records and len(cache):
            raise ConfigurationError(
                f"Probe.per_turn: the cache holds no record at layer {self.layer}, site {self.site!r} "
                f"(it has layers {cache.layers}); capture with layers including {self.layer}"
            )
        return {r.message_idx: self.read(r) for r in records}

    def __repr__(self) -> str:
        return (
            f"Probe(layer={self.layer}, site={self.site!r}, pool={self.pool!r}, "
            f"d_model={self.direction.numel()}, bias={self.bias:.4g})"
        )


def _pooled(rows: torch.Tensor, pool: str) -> torch.Tensor:
    import torch

    rows = rows.to(torch.float32)
    if rows.shape[0] == 0:
        raise ConfigurationError("Probe: a turn with no answer tokens has nothing to pool")
    return rows.mean(0) if pool == "mean" else rows[-1]
