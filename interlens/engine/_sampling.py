"""Next-token choice for a batch of rows with per-row settings and per-row random streams, and the
special ids the decode loop needs (which tokens end a turn, which pads a prompt).

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
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

from .._core import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["Choice", "Sampler", "SamplingSettings", "eos_ids", "pad_id"]


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How one local turn is sampled: the ONE record of these settings, from the participant that holds its
    own (``ModelParticipant.sampling``) through its ``ChatRequest`` to the engine's ``GenerationRequest``
    (each holds it; none copies its fields). Keyword-only, so a new field never shifts another's place.

    Unvalidated on its own: a participant's spent budget is a ``max_new_tokens`` of 0, answered without the
    engine; :meth:`check` is called by the record that goes to the engine (``GenerationRequest``).

    A new field needs a default that leaves sampling as it was: recipes written before it keep their
    fingerprints (:meth:`to_json` writes it only when set), and tests/test_fingerprints.py pins one.
    """

    max_new_tokens: int
    temperature: float = 1.0  # <= 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # generation of the row ends once its text contains one of these
    seed: int | None = None  # the row's own random stream: its draws do not depend on its batch mates

    def __post_init__(self) -> None:
        # Accept any sequence of stop strings (a list is the natural thing to pass), store a tuple; one string
        # is refused by check() with its fix, so it is kept as given.
        if not isinstance(self.stop, tuple | str):
            object.__setattr__(self, "stop", tuple(self.stop))

    def settings(self) -> dict[str, Any]:
        """The participant-level settings by name (every field but the per-turn ``seed``): what
        ``ModelParticipant`` passes back to its constructor when copied (``set``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _PER_TURN}

    def to_json(self) -> dict[str, Any]:
        """The participant's settings as recipe JSON (saved and fingerprinted). The fields of the first
        release are always written; a field added since only when it is set away from its default, so a
        recipe that does not use it keeps the fingerprint it had (a rerun of an old ledger resumes)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _PER_TURN or (f.name not in _ALWAYS_WRITTEN and value == f.default):
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def check(self, who: str) -> None:
        """Raise ConfigurationError naming ``who(setting=value)`` for a setting the decode loop cannot use."""
        if isinstance(self.stop, str):
            raise ConfigurationError(
                f"{who}(stop={self.stop!r}): stop must be a sequence of strings, not one string; "
                f"write stop=({self.stop!r},)."
            )
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigurationError(f"{who}(max_new_tokens={self.max_new_tokens!r}): must be an int >= 1.")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise ConfigurationError(
                f"{who}(temperature={self.temperature!r}): must be a finite number "
                "(<= 0 means greedy decoding)."
            )
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ConfigurationError(
                f"{who}(top_p={self.top_p!r}): must be in (0, 1]; use 1.0 to disable nucleus sampling."
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigurationError(f"{who}(stop={self.stop!r}): stop strings must be non-empty strings.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigurationError(f"{who}(seed={self.seed!r}): seed must be an int or None.")


#: Set per turn by the conversation (``turn_seed``), not a participant's setting: never in its JSON.
_PER_TURN = frozenset({"seed"})
#: The settings every recipe has written since the first release, at their defaults too.
_ALWAYS_WRITTEN = frozenset({"max_new_tokens", "temperature", "top_p", "stop"})


class Choice(NamedTuple):
    """One step's picks (:meth:`Sampler.choose`), all on the device."""

    tokens: torch.Tensor  # (rows,) the chosen token ids
    finite: torch.Tensor  # (rows,) False where the row's logits were unusable (NaN, +inf, all -inf)
    #: (rows, 2) float32 when the sampler records: each chosen token's log-probability under the model's own
    #: distribution (a log-softmax of the logits: temperature 1, every token) and under the distribution it
    #: was drawn from (temperature and nucleus applied; 0.0 for a greedy row: its pick was certain)
    logprobs: torch.Tensor | None


class Sampler:
    """Picks the next token of every active row; built once per batch composition, not per step.

    Greedy rows (temperature <= 0) take the argmax. Sampling rows are scaled by their temperature, restricted
    to their nucleus when top_p < 1, and drawn by inverse CDF with one uniform each per step. It reads each
    row's :class:`SamplingSettings` record itself, so a new sampling setting reaches it with the record.
    With ``record``, each step also gives the chosen tokens' log-probabilities (:class:`Choice`): one more
    pass over rows x vocabulary (a log-sum-exp), only in the batches that ask.
    """

    def __init__(
        self,
        requests: list[SamplingSettings],
        device: str,
        streams: list[random.Random | None] | None = None,
        *,
        record: bool = False,
    ) -> None:
        import torch

        self.requests = requests
        self.device = device
        self.record = record
        if streams is None:  # seeded by the seed's text: an int seed would drop its sign (-5 == 5)
            streams = [
                random.Random(str(r.seed)) if r.seed is not None and r.temperature > 0 else None
                for r in requests
            ]
        self.streams = streams
        sampling = [j for j, r in enumerate(requests) if r.temperature > 0]
        self.all_greedy = not sampling
        self.all_sampling = len(sampling) == len(requests)
        # The seeded rows' uniforms are drawn ahead, a block of steps at a time, and sent to the device in
        # one copy (a copy a step from pageable memory waits on the device's stream: a host sync per step on
        # CUDA). A row's draws are its stream's next values whatever the block size, and a batch reduced by
        # ``select`` hands the rest of the block on, so a row's tokens never depend on its batch mates.
        self._sampling = sampling
        self._seeded: list[int] = []  # positions in ``sampling`` of the seeded rows: the block's columns
        self._block: torch.Tensor | None = None  # (steps, seeded rows) drawn ahead, on the device
        self._cursor = 0
        self._block_steps = _FIRST_BLOCK
        if self.all_greedy:
            return
        self.sampling_idx = torch.tensor(sampling, dtype=torch.long, device=device)
        self.temperatures = torch.tensor(
            [[requests[j].temperature] for j in sampling], dtype=torch.float32, device=device
        )
        self.row_streams = [streams[j] for j in sampling]
        self.n_unseeded = sum(s is None for s in self.row_streams)
        self._seeded = [k for k, s in enumerate(self.row_streams) if s is not None]
        # where both kinds share a batch, the rows each kind's uniforms go to
        self._seeded_idx = (
            torch.tensor(self._seeded, dtype=torch.long, device=device)
            if self._seeded and self.n_unseeded
            else None
        )
        self._unseeded_idx = (
            torch.tensor(
                [k for k, s in enumerate(self.row_streams) if s is None], dtype=torch.long, device=device
            )
            if self.n_unseeded and self._seeded
            else None
        )
        # Rows with a nucleus (top_p < 1) are sampled in sorted order; the others in vocabulary order.
        nucleus = [k for k, j in enumerate(sampling) if requests[j].top_p < 1.0]
        plain = [k for k, j in enumerate(sampling) if requests[j].top_p >= 1.0]
        self.nucleus_idx = torch.tensor(nucleus, dtype=torch.long, device=device) if nucleus else None
        self.plain_idx = (
            torch.tensor(plain, dtype=torch.long, device=device)
            if plain and len(plain) < len(sampling)
            else None
        )
        self.any_plain = bool(plain)
        self.top_p = torch.tensor(
            [[requests[sampling[k]].top_p] for k in nucleus], dtype=torch.float32, device=device
        )

    def select(self, keep: list[int]) -> Sampler:
        """The sampler for a batch reduced to rows ``keep``: each row's stream carries on where it was, the
        draws it already made ahead included."""
        import torch

        reduced = Sampler(
            [self.requests[j] for j in keep],
            self.device,
            [self.streams[j] for j in keep],
            record=self.record,
        )
        if self._block is not None and reduced._seeded:
            column = {j: c for c, j in enumerate(self._seeded_rows())}
            columns = [column[j] for j in keep if j in column]
            index = torch.tensor(columns, dtype=torch.long, device=self._block.device)
            reduced._block = self._block[self._cursor :].index_select(1, index)
            reduced._block_steps = self._block_steps
        return reduced

    def _seeded_rows(self) -> list[int]:
        """The batch rows (indices into ``requests``) of the seeded sampling rows, in block column order."""
        return [self._sampling[k] for k in self._seeded]

    def uniforms(self) -> torch.Tensor:
        """One uniform in [0, 1) per sampling row: its own stream's next draw, or the global RNG's."""
        import torch

        seeded = None
        if self._seeded:
            if self._block is None or self._cursor == self._block.shape[0]:
                steps = self._block_steps
                self._block_steps = min(2 * steps, _LAST_BLOCK)
                streams = [self.row_streams[k] for k in self._seeded]
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
        u = torch.empty(len(self.row_streams), dtype=torch.float32, device=self.device)
        u[self._seeded_idx] = seeded
        u[self._unseeded_idx] = shared
        return u

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.choose(logits).tokens

    def choose(self, logits: torch.Tensor) -> Choice:
        """Each row's token, and whether the row's logits were usable: False where one is NaN or +inf, or
        every one is -inf (a -inf logit alone is a token the model rules out). The check is the row maximum
        the sampling computes anyway, so it costs no pass of its own over rows × vocab. With ``record``,
        the tokens' log-probabilities too (:class:`Choice`)."""
        import torch

        if self.all_greedy:
            top, chosen = logits.max(dim=-1)
            return Choice(chosen, top.isfinite(), self._logprobs(logits, chosen, None))
        scores = logits if self.all_sampling else logits.index_select(0, self.sampling_idx)
        # Unnormalised weights exp(x / T - max), in place on one float32 copy: inverse CDF needs no
        # normalising (the target is u × the row's total), and each pass over rows × vocab counts (at 64
        # rows of a 49k vocabulary the sampler was ~5 ms of a ~120 ms CPU step).
        weights = scores.to(torch.float32, copy=True)
        # recording: the model's normaliser from the same float32 copy, before the temperature
        model_lse = weights.logsumexp(dim=-1) if self.record and self.all_sampling else None
        weights.div_(self.temperatures)
        top = weights.amax(dim=-1, keepdim=True)
        weights.sub_(top).exp_()
        u = self.uniforms()
        # the mass each sampling row's draw was taken from, out of its weights' total: the nucleus's for a
        # nucleus row, all of it for the others (recorded log-probabilities only)
        kept: torch.Tensor | None = None
        if self.nucleus_idx is None:
            picked = _draw(weights, u)
        else:
            picked = torch.empty(weights.shape[0], dtype=torch.long, device=weights.device)
            if self.any_plain:
                rows = self.plain_idx
                part = weights if rows is None else weights.index_select(0, rows)
                draws = u if rows is None else u.index_select(0, rows)
                picked[slice(None) if rows is None else rows] = _draw(part, draws)
            nucleus = weights.index_select(0, self.nucleus_idx)
            picked[self.nucleus_idx], mass = _nucleus_sample(
                nucleus / nucleus.sum(dim=-1, keepdim=True), self.top_p, u.index_select(0, self.nucleus_idx)
            )
            if self.record:
                kept = torch.ones(weights.shape[0], dtype=torch.float32, device=weights.device)
                kept[self.nucleus_idx] = mass
        drawn = (weights, picked, kept) if self.record else None
        if self.all_sampling:
            return Choice(picked, top.squeeze(1).isfinite(), self._logprobs(logits, picked, drawn, model_lse))
        best, chosen = logits.max(dim=-1)  # NaN propagates: a row with one is not finite here either
        chosen[self.sampling_idx] = picked
        return Choice(chosen, best.isfinite(), self._logprobs(logits, chosen, drawn))

    def _logprobs(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
        model_lse: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """(rows, 2): the chosen tokens' log-probabilities under the model's distribution, and under the one
        each was drawn from (0.0 for greedy rows). ``drawn``: the sampling rows' unnormalised weights
        (temperature applied), their picks, and the share of the weights' total their draw kept (None: all).
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
            if self.all_sampling:
                sampled = lp
            else:
                sampled[self.sampling_idx] = lp
        return torch.stack([model, sampled], dim=1)


#: Steps of uniforms drawn ahead in a batch's first block, doubling up to the last size: a short turn draws
#: little it will not use, a long one sends its draws to the device every 256 steps.
_FIRST_BLOCK = 16
_LAST_BLOCK = 256

#: The vocabulary is cut into blocks of this many tokens for a draw (:func:`_draw`).
_BLOCK = 256


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over non-negative ``weights`` (rows × vocab, contiguous, unnormalised) without a cumsum
    over the whole vocabulary: block sums (a vectorised reduction), their cumsum, the block the target falls
    in, then a cumsum over that block alone. The same draw as ``_inverse_cdf(weights.cumsum(-1), u)`` up to
    the sums' rounding; row-wise, so a row's token depends on its own weights and uniform only.

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


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a turn: the generation config's (end-of-turn tokens) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
            break
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def pad_id(model: Any, tokenizer: Any, eos: frozenset[int]) -> int:
    """Any valid id works for padding (pads are masked); prefer the declared pad token."""
    for value in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(getattr(model, "generation_config", None), "pad_token_id", None),
    ):
        if isinstance(value, int):
            return value
    return min(eos) if eos else 0
