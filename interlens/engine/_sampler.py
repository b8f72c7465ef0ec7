"""Next-token choice for a batch of rows with per-row settings and per-row random streams: a pipeline of
small parts (``_sampler_parts``), one uniform per row per step, and an inverse-CDF draw.

Every local turn of a rollout carries a seed (see ``_core.turn_seed``), so a batch of 64 rows is
64 seeded rows: sampling them one ``torch.multinomial`` call per row (each with its own ``torch.Generator``)
cost 2.75x the unseeded path per step at a real vocabulary on CPU. Instead each step draws ONE uniform per
row (from the row's own stream, or from torch's global RNG for an unseeded row) and samples every row at
once by inverse CDF: ``cumsum`` of the row's probabilities, ``searchsorted`` of ``u * total``. All the work on
the vocabulary is vectorised and row-wise, so a row's token depends on its own logits and its own uniform
only: a seeded row draws the same tokens alone or in any batch, as long as its logits are the same.

A seeded row's stream is Python's ``random.Random``: its ``random()`` sequence for a given seed is guaranteed
stable across Python versions and platforms, and it does not depend on the device, so the same seed gives
the same uniforms on CPU and GPU (the logits, of course, may differ between them).

The sampler knows no setting by name: :class:`~._sampler_parts.Greedy` takes the argmax rows out, then each
part of ``PARTS`` that some row uses changes the rows' scores or weights, or draws them itself; the sampler
owns the order of the steps, the uniforms, the draw and the recorded log-probabilities.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, NamedTuple

from ._sampler_parts import PARTS, Greedy, SamplingPart, draw_inverse_cdf
from ._sampling import SamplingSettings

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = ["Choice", "Sampler"]


class Choice(NamedTuple):
    """One step's picks (:meth:`Sampler.choose`), all on the device."""

    tokens: torch.Tensor  # (rows,) the chosen token ids
    finite: torch.Tensor  # (rows,) False where the row's logits were unusable (NaN, +inf, all -inf)
    #: (rows, 2) float32 when the sampler records: each chosen token's log-probability under the model's own
    #: distribution (a log-softmax of the logits: temperature 1, every token) and under the distribution it
    #: was drawn from (the parts applied; 0.0 for a greedy row: its pick was certain)
    logprobs: torch.Tensor | None


class Sampler:
    """Picks the next token of every active row; built once per batch composition, not per step.

    Greedy rows (temperature <= 0) take the argmax. The sampling rows' logits are copied to float32, each
    part's ``scale`` runs (temperature), the weights ``exp(x - max)`` are formed, each part's ``weigh`` runs,
    and each row draws with its uniform: by the one part that draws (top-p, in its nucleus), else by inverse
    CDF over the vocabulary. With ``record``, each step also gives the chosen tokens' log-probabilities
    (:class:`Choice`): one more pass over rows x vocabulary (a log-sum-exp), only in the batches that ask.

    ``parts``: the part types to build (default :data:`~._sampler_parts.PARTS`), each built only where a row
    uses its setting.
    """

    def __init__(
        self,
        settings: Sequence[SamplingSettings],
        device: str,
        streams: Sequence[random.Random | None] | None = None,
        *,
        record: bool = False,
        parts: Sequence[type[SamplingPart]] = PARTS,
    ) -> None:
        self.settings = list(settings)
        self.device = device
        self.record = record
        self.greedy = Greedy(self.settings, device)
        sampling = [self.settings[j] for j in self.greedy.sampling]
        if streams is None:  # seeded by the seed's text: an int seed would drop its sign (-5 == 5)
            row_streams = [random.Random(str(s.seed)) if s.seed is not None else None for s in sampling]
        else:
            row_streams = [streams[j] for j in self.greedy.sampling]
        self.uniforms = _RowUniforms(row_streams, device)
        self.parts = [p for kind in parts if (p := kind.build(sampling, device)) is not None]

    def select(self, keep: list[int]) -> Sampler:
        """The sampler for a batch reduced to rows ``keep``: each part narrowed to the kept rows, each row's
        stream carrying on where it was, the draws it already made ahead included."""
        position = {j: k for k, j in enumerate(self.greedy.sampling)}
        kept = [position[j] for j in keep if j in position]  # the kept sampling rows, among the sampling rows
        reduced = object.__new__(Sampler)
        reduced.settings = [self.settings[j] for j in keep]
        reduced.device = self.device
        reduced.record = self.record
        reduced.greedy = Greedy(reduced.settings, self.device)
        reduced.uniforms = self.uniforms.select(kept)
        reduced.parts = [p for part in self.parts if (p := part.select(kept)) is not None]
        return reduced

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.choose(logits).tokens

    def choose(self, logits: torch.Tensor) -> Choice:
        """Each row's token, and whether the row's logits were usable: False where one is NaN or +inf, or
        every one is -inf (a -inf logit alone is a token the model rules out). The check is the row maximum
        the sampling computes anyway, so it costs no pass of its own over rows × vocab. With ``record``,
        the tokens' log-probabilities too (:class:`Choice`)."""
        import torch

        greedy = self.greedy
        if greedy.all_greedy:
            chosen, finite = greedy.choose(logits, None)
            return Choice(chosen, finite, self._logprobs(logits, chosen, None))
        # Unnormalised weights exp(x / T - max), in place on one float32 copy: inverse CDF needs no
        # normalising (the target is u × the row's total), and each pass over rows × vocab counts (at 64
        # rows of a 49k vocabulary the sampler was ~5 ms of a ~120 ms CPU step).
        weights = greedy.scores(logits).to(torch.float32, copy=True)
        # recording: the model's normaliser from the same float32 copy, before any part
        model_lse = weights.logsumexp(dim=-1) if self.record and greedy.all_sampling else None
        for part in self.parts:
            part.scale(weights)
        top = weights.amax(dim=-1, keepdim=True)
        weights.sub_(top).exp_()
        for part in self.parts:
            part.weigh(weights)
        u = self.uniforms.next()
        picked, kept = self._draw(weights, u)
        drawn = (weights, picked, kept) if self.record else None
        if greedy.all_sampling:
            return Choice(picked, top.squeeze(1).isfinite(), self._logprobs(logits, picked, drawn, model_lse))
        chosen, finite = greedy.choose(logits, picked)  # NaN propagates: a row with one is not finite there
        return Choice(chosen, finite, self._logprobs(logits, chosen, drawn))

    def _draw(self, weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling rows' tokens and their kept mass (None: every row drew from all its weights)."""
        for part in self.parts:
            drawn = part.draw(weights, u)
            if drawn is not None:
                return drawn
        return draw_inverse_cdf(weights, u), None

    def _logprobs(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
        model_lse: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """(rows, 2): the chosen tokens' log-probabilities under the model's distribution, and under the one
        each was drawn from (0.0 for greedy rows). ``drawn``: the sampling rows' unnormalised weights (the
        parts applied), their picks, and the share of the weights' total their draw kept (None: all).
        ``model_lse``: each row's log-sum-exp of its logits in float32, where already computed. None unless
        the sampler records."""
        import torch

        if not self.record:
            return None
        if model_lse is None:
            model_lse = logits.float().logsumexp(dim=-1)
        model = logits.gather(1, chosen.unsqueeze(1)).squeeze(1).float() - model_lse
        sampled = torch.zeros_like(model)
        if drawn is not None:
            weights, picked, kept = drawn
            total = weights.sum(dim=-1)
            if kept is not None:
                total = total * kept
            lp = weights.gather(1, picked.unsqueeze(1)).squeeze(1).log() - total.log()
            sampled = self.greedy.spread(lp, model.shape[0])
        return torch.stack([model, sampled], dim=1)


#: Steps of uniforms drawn ahead in a batch's first block, doubling up to the last size: a short turn draws
#: little it will not use, a long one sends its draws to the device every 256 steps.
_FIRST_BLOCK = 16
_LAST_BLOCK = 256


class _RowUniforms:
    """One uniform in [0, 1) per sampling row per step: its own stream's next draw, or the global RNG's.

    The seeded rows' uniforms are drawn ahead, a block of steps at a time, and sent to the device in one copy
    (a copy a step from pageable memory waits on the device's stream: a host sync per step on CUDA). A row's
    draws are its stream's next values whatever the block size, and a batch reduced by :meth:`select` hands
    the rest of the block on, so a row's tokens never depend on its batch mates.
    """

    def __init__(self, streams: list[random.Random | None], device: str) -> None:
        import torch

        self.streams = streams
        self.device = device
        self.n_unseeded = sum(s is None for s in streams)
        self._seeded = [k for k, s in enumerate(streams) if s is not None]  # the block's columns
        self._block: torch.Tensor | None = None  # (steps, seeded rows) drawn ahead, on the device
        self._cursor = 0
        self._block_steps = _FIRST_BLOCK
        # where both kinds share a batch, the rows each kind's uniforms go to
        both = bool(self._seeded) and bool(self.n_unseeded)
        unseeded = [k for k, s in enumerate(streams) if s is None]
        self._seeded_idx = torch.tensor(self._seeded, dtype=torch.long, device=device) if both else None
        self._unseeded_idx = torch.tensor(unseeded, dtype=torch.long, device=device) if both else None

    def select(self, keep: list[int]) -> _RowUniforms:
        """The uniforms of rows ``keep`` (indices into these rows): each seeded row's stream carries on where
        it was, the rest of the block drawn ahead included."""
        import torch

        reduced = _RowUniforms([self.streams[k] for k in keep], self.device)
        if self._block is not None and reduced._seeded:
            column = {k: c for c, k in enumerate(self._seeded)}
            columns = [column[k] for k in keep if k in column]
            index = torch.tensor(columns, dtype=torch.long, device=self._block.device)
            reduced._block = self._block[self._cursor :].index_select(1, index)
            reduced._block_steps = self._block_steps
        return reduced

    def next(self) -> torch.Tensor:
        """This step's uniforms, one per row (float32, on the device)."""
        import torch

        seeded = None
        if self._seeded:
            if self._block is None or self._cursor == self._block.shape[0]:
                steps = self._block_steps
                self._block_steps = min(2 * steps, _LAST_BLOCK)
                streams = [self.streams[k] for k in self._seeded]
                draws = [[s.random() for s in streams] for _ in range(steps)]  # type: ignore[union-attr]
                self._block = torch.tensor(draws, dtype=torch.float32, device=self.device)
                self._cursor = 0
            seeded = self._block[self._cursor]
            self._cursor += 1
            if not self.n_unseeded:
                return seeded
        shared = torch.rand(self.n_unseeded, dtype=torch.float64, device=self.device).float()
        if seeded is None:
            return shared
        u = torch.empty(len(self.streams), dtype=torch.float32, device=self.device)
        u[self._seeded_idx] = seeded
        u[self._unseeded_idx] = shared
        return u
