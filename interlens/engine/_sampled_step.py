"""What both static decode steps share: the sampler's static buffers and the sample-and-store tail.

The batched rows' step (``_static_step.StaticDecodeStep``) and the deterministic rows' one
(``_slot_step.SlotDecodeStep``) differ in their cache (a left-padded layout with a write position, or a row's
slot at its position), in how a batch begins (the prefill's KV found in place, or copied from the slot
layout's block prefill) and in what a padding row is fed (the pad id, or a copy of a real row, which the
slot layout's row-invariant kernels need). Their sampling is the same, so it lives here once, in
:class:`SampledStep`:

* the buffers a step's sampler reads and writes, allocated once: per row its uniform, temperature, top-p
  and greedy flag (padding rows greedy at 1.0, so their computed-and-ignored weights stay finite), the
  tokens fed and their positions, the attention mask, and the outputs (tokens, ``finite``, the recorded
  log-probabilities);
* :meth:`SampledStep._forward_and_sample_into`, the tail of the function a graph holds: the model's
  forward over the step's buffers and cache, ``sample_rows`` over those buffers, the tokens written with -1
  where a row's logits went non-finite (so the host's one read of the tokens brings that verdict along),
  and the next step's tokens fed in place;
* the host's part of a step: a batch's settings into their buffers, its sampler's uniform streams (only
  the sampling rows' uniforms are copied a step, one ``index_copy_``), the variant check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._core import ConfigurationError
from ._sampler import Sampler
from ._sampling import SamplingSettings
from ._static_sampler import VARIANTS, sample_rows, variant_for

if TYPE_CHECKING:
    import torch

__all__ = ["SAMPLER_BUFFERS", "SampledStep"]

#: The sampler's buffers of a step, by name (a captured graph holds their addresses).
SAMPLER_BUFFERS = (
    "input_ids",
    "positions",
    "mask",
    "uniforms",
    "temperature",
    "top_p",
    "greedy",
    "tokens",
    "finite",
    "logprobs",
)


class SampledStep:
    """A static step's sampler buffers and its sample-and-store tail (module docstring); subclassed by each
    step, which adds its cache and its forward (:meth:`_forward_and_sample`).

    ``rows`` x ``length``: the step's shape (the mask is this wide); ``variant`` / ``record``: the sampler
    variant (``_static_sampler.VARIANTS``) and whether log-probabilities are written; ``fed``: the token
    the input buffer starts with."""

    def __init__(self, model: Any, *, rows: int, length: int, variant: str, record: bool, fed: int) -> None:
        import torch

        if variant not in VARIANTS:
            raise ConfigurationError(
                f"{type(self).__name__}(variant={variant!r}): variant must be one of {', '.join(VARIANTS)}; "
                "variant_for(settings) gives the cheapest one for a batch"
            )
        self.model = model
        self.rows = rows
        self.length = length
        self.variant = variant
        self.record = record
        device = next(model.parameters()).device
        self.device = str(device)
        # inputs (the host fills them in begin() / hand_over() and the uniforms per step; the step
        # advances the rest)
        self.input_ids = torch.full((rows, 1), fed, dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.mask = torch.ones((rows, length), dtype=torch.long, device=device)
        self.uniforms = torch.full((rows,), 0.5, dtype=torch.float32, device=device)
        self.temperature = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        # outputs
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.finite = torch.ones(rows, dtype=torch.bool, device=device)
        self.logprobs = torch.zeros((rows, 2), dtype=torch.float32, device=device)
        #: what a step runs: this eager function, or what compiled / captured it
        self.run: Callable[[], None] = self._forward_and_sample
        self._sampler: Sampler | None = None
        self._sampling_idx: torch.Tensor | None = None  # the batch rows the uniforms go to
        self._n = 0  # the real rows of the batch begun
        self.cache: Any = None  # the subclass's cache, set after these buffers

    def _forward_and_sample(self) -> None:
        """The step a graph holds: each step's own, ending in :meth:`_forward_and_sample_into`."""
        raise NotImplementedError

    def _buffers(self, names: Sequence[str], cache: Any) -> dict[str, torch.Tensor]:
        """The named buffers and each cache layer's keys, values and write position, by name."""
        named = {name: getattr(self, name) for name in names}
        for i, layer in enumerate(cache.layers):
            named[f"cache.{i}.keys"] = layer.keys
            named[f"cache.{i}.values"] = layer.values
            named[f"cache.{i}.cumulative_length"] = layer.cumulative_length
        return named

    def _settings_into(self, settings: Sequence[SamplingSettings]) -> None:
        """The real rows' settings into their buffers (padding rows: greedy at 1.0), uniforms reset."""
        import torch

        n = len(settings)
        greedy = [s.temperature <= 0 for s in settings]
        self.greedy.fill_(True)
        self.greedy[:n].copy_(torch.tensor(greedy, dtype=torch.bool))
        self.temperature.fill_(1.0)
        self.temperature[:n].copy_(
            torch.tensor([1.0 if g else s.temperature for g, s in zip(greedy, settings, strict=True)])
        )
        self.top_p.fill_(1.0)
        self.top_p[:n].copy_(
            torch.tensor([1.0 if g else s.top_p for g, s in zip(greedy, settings, strict=True)])
        )
        self.uniforms.fill_(0.5)

    def _start(self, sampler: Sampler, n: int) -> None:
        """Take over ``sampler``'s streams for a batch of ``n`` real rows (begun or handed over)."""
        import torch

        self._sampler = sampler
        sampling = sampler.greedy.sampling
        self._sampling_idx = (
            torch.tensor(sampling, dtype=torch.long, device=self.device) if sampling else None
        )
        self._n = n

    def _next_uniforms(self, sampler: Sampler) -> None:
        """This step's uniforms into their buffer: the sampling rows' only, one copy."""
        if self._sampling_idx is not None:
            self.uniforms.index_copy_(0, self._sampling_idx, sampler.uniforms.next())

    def _begun_keeping(self, keep: Sequence[int]) -> Sampler:
        """The begun batch's sampler, where ``keep`` (the rows a hand-over carries on) are ascending indices
        of its rows, at least one; refused otherwise."""
        who = type(self).__name__
        if self._sampler is None:
            raise ConfigurationError(f"{who}.hand_over(): no batch begun on this step")
        if not keep or sorted(set(keep)) != list(keep) or keep[0] < 0 or keep[-1] >= self._n:
            raise ConfigurationError(
                f"{who}.hand_over(keep={list(keep)!r}): keep must be ascending indices of this "
                f"batch's {self._n} rows, at least one"
            )
        return self._sampler

    def _check_variant(self, settings: Sequence[SamplingSettings], who: str) -> None:
        """Refuse settings this step's sampler variant cannot serve (``who``: the method to name)."""
        needed = variant_for(settings)
        if VARIANTS.index(needed) > VARIANTS.index(self.variant):
            raise ConfigurationError(
                f"{type(self).__name__}.{who}(): these settings need the {needed!r} sampler variant, this "
                f"step is built for {self.variant!r}; build it with variant=variant_for(settings)"
            )

    def _forward_and_sample_into(
        self, *, source: torch.Tensor | None = None, attention: dict[str, torch.Tensor] | None = None
    ) -> None:
        """The model's forward for one token per row over the step's buffers and its cache (the subclass's
        ``cache``), then every row sampled from its last logits, the outputs written and the chosen tokens
        fed to the next step, all in place: a row whose logits went bad gets -1 as its token and is fed 0 (a
        valid id, ignored); ``source``: the row each row is fed from (a padding row copies a real row's);
        ``attention``: the model's masks by layer type, built by the step (None: the model builds them from
        :attr:`mask`). Call under ``torch.no_grad()``; the positions are the subclass's to advance."""
        import torch

        out = self.model(
            input_ids=self.input_ids,
            attention_mask=self.mask if attention is None else attention,
            position_ids=self.positions,
            cache=self.cache,
            use_cache=True,
        )
        tokens, finite, logprobs = sample_rows(
            out.logits[:, -1, :],
            temperature=self.temperature,
            top_p=self.top_p,
            greedy=self.greedy,
            uniforms=self.uniforms,
            variant=self.variant,
            record=self.record,
        )
        self.tokens.copy_(torch.where(finite, tokens, -1))
        self.finite.copy_(finite)
        if logprobs is not None:
            self.logprobs.copy_(logprobs)
        fed = torch.where(finite, tokens, 0)
        if source is not None:
            fed = fed.index_select(0, source)
        self.input_ids.copy_(fed.unsqueeze(1))
