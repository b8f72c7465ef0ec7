"""Activation capture: what to record (:class:`CaptureSpec`), what the engine returns for one turn
(:class:`Captured`), and where a ``with conv.capture(...) as cache:`` block collects it
(:class:`ActivationCache`).

Sites, per decoder layer (found by structure in ``interlens.interp._hooks``, not by a per-family table):

* ``"residual"``: the decoder layer's output hidden state (the residual stream after the layer);
* ``"attn"``: the attention sublayer's output, before it is added to the residual stream;
* ``"mlp"``: the MLP sublayer's output, likewise.

Positions: row ``i`` of a record's ``answer`` is the hidden state at the position of the ``i``-th generated
token (with that token as the input), exactly what a forward pass over prompt + answer computes there. So
``answer`` has one row per generated token (the end-of-turn token included when one was produced), and
``prompt`` (when asked for with ``prompt=True``) one row per prompt token.

Memory: each (layer, site) costs ``d_model x bytes per element`` per captured token — 8 KiB per token per
layer per site for a 4096-wide bf16 model, so a 300-token answer captured at all 32 residual layers is
~75 MiB. Tensors move to CPU as they are produced (``offload="cpu"``, the default), so the accelerator
holds only the current forward pass; pick ``layers=`` and ``sites=`` to bound host memory when a block
captures many turns.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._core import ConfigurationError, ConfigurationTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["SITES", "ActivationCache", "ActivationRecord", "CaptureSpec", "CaptureTarget", "Captured"]

SITES = ("residual", "attn", "mlp")


@dataclass(frozen=True)
class CaptureSpec:
    """What to record on each captured forward pass. ``layers=None``: every decoder layer."""

    sites: tuple[str, ...] = ("residual",)
    layers: tuple[int, ...] | None = None
    prompt: bool = False  # also keep the prompt's positions (record.prompt)
    offload: str | None = "cpu"  # "cpu": move each tensor to host memory at once; None: keep on the device

    @classmethod
    def build(
        cls, *, sites: Any = ("residual",), layers: Any = None, prompt: Any = False, offload: Any = "cpu"
    ) -> CaptureSpec:
        """Validated from user input (``conv.capture(...)``); errors name the argument and the fix."""
        site_tuple = (sites,) if isinstance(sites, str) else tuple(sites)
        unknown = [s for s in site_tuple if s not in SITES]
        if not site_tuple or unknown:
            raise ConfigurationError(
                f"capture(sites={sites!r}): unknown or no site {unknown}; choose from {list(SITES)}"
            )
        layer_tuple: tuple[int, ...] | None
        if layers is None:
            layer_tuple = None
        else:
            layer_tuple = (layers,) if isinstance(layers, int) else tuple(layers)
            if not layer_tuple or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_tuple
            ):
                raise ConfigurationError(
                    f"capture(layers={layers!r}): pass None (every layer) or non-negative int layer indices"
                )
            layer_tuple = tuple(sorted(set(layer_tuple)))
        if not isinstance(prompt, bool):
            raise ConfigurationTypeError(f"capture(prompt={prompt!r}): must be True or False")
        if offload not in ("cpu", None):
            raise ConfigurationError(
                f"capture(offload={offload!r}): must be 'cpu' (move tensors to host memory) or None (keep "
                "them on the model's device)"
            )
        return cls(tuple(dict.fromkeys(site_tuple)), layer_tuple, prompt, offload)


@dataclass(frozen=True)
class Captured:
    """What the engine recorded for one generated or scored row: ``tensors[(site, layer)]`` is
    ``[n_answer, d_model]``, or ``[prompt_len + n_answer, d_model]`` when the spec asked for the prompt."""

    prompt_len: int
    answer_ids: tuple[int, ...]
    tensors: Mapping[tuple[str, int], torch.Tensor]
    with_prompt: bool


@dataclass(frozen=True)
class ActivationRecord:
    """One (turn, layer, site): the answer's activations and where they sit in the speaker's sequence.

    ``kind`` is ``"turn"`` (a committed step/run turn), ``"sample"`` (a ``sample()``, not committed; its
    ``message_idx`` is where it would have gone) or ``"score"`` (a ``logprobs()`` / teacher-forced pass).
    ``span`` is ``(prompt_len, prompt_len + n_answer)``: the answer's positions in the full sequence.
    """

    participant: str
    message_idx: int
    layer: int
    site: str
    kind: str
    answer: torch.Tensor  # [n_answer, d_model]
    prompt: torch.Tensor | None  # [prompt_len, d_model] when captured with prompt=True
    answer_ids: tuple[int, ...]
    prompt_len: int

    @property
    def span(self) -> tuple[int, int]:
        return (self.prompt_len, self.prompt_len + len(self.answer_ids))

    def __repr__(self) -> str:
        return (
            f"ActivationRecord({self.participant!r}, message_idx={self.message_idx}, layer={self.layer}, "
            f"site={self.site!r}, kind={self.kind!r}, answer={tuple(self.answer.shape)})"
        )


class ActivationCache:
    """The records of one ``conv.capture(...)`` block, in the order they were produced.

    ``cache.query(participant=..., message_idx=..., layer=..., site=...)`` filters (``None`` matches all);
    ``cache.at(...)`` returns the one matching record's answer tensor; ``len(cache)`` and iteration go over
    records.
    """

    def __init__(self, spec: CaptureSpec) -> None:
        self.spec = spec
        self._records: list[ActivationRecord] = []

    def add(self, participant: str, message_idx: int, kind: str, captured: Captured) -> None:
        """File one row's capture as one record per (layer, site)."""
        for (site, layer), tensor in sorted(captured.tensors.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            prompt = tensor[: captured.prompt_len] if captured.with_prompt else None
            answer = tensor[captured.prompt_len :] if captured.with_prompt else tensor
            self._records.append(
                ActivationRecord(
                    participant,
                    message_idx,
                    layer,
                    site,
                    kind,
                    answer,
                    prompt,
                    captured.answer_ids,
                    captured.prompt_len,
                )
            )

    def query(
        self,
        *,
        participant: str | None = None,
        message_idx: int | None = None,
        layer: int | None = None,
        site: str | None = None,
        kind: str | None = None,
    ) -> list[ActivationRecord]:
        """The records matching every given field, in capture order."""
        wanted = {"participant": participant, "message_idx": message_idx, "layer": layer, "site": site}
        wanted["kind"] = kind
        return [r for r in self._records if all(v is None or getattr(r, k) == v for k, v in wanted.items())]

    def at(
        self,
        *,
        participant: str | None = None,
        message_idx: int | None = None,
        layer: int | None = None,
        site: str | None = "residual",
        kind: str | None = None,
    ) -> torch.Tensor:
        """The answer activations ``[n_answer, d_model]`` of the ONE record matching the filters."""
        found = self.query(
            participant=participant, message_idx=message_idx, layer=layer, site=site, kind=kind
        )
        if len(found) != 1:
            have = sorted({(r.participant, r.message_idx, r.layer, r.site) for r in self._records})[:12]
            raise ConfigurationError(
                f"cache.at(participant={participant!r}, message_idx={message_idx!r}, layer={layer!r}, "
                f"site={site!r}) matches {len(found)} records, not exactly one; narrow it down (this cache "
                f"holds (participant, message_idx, layer, site) = {have}{' ...' if len(have) == 12 else ''})"
            )
        return found[0].answer

    @property
    def layers(self) -> list[int]:
        return sorted({r.layer for r in self._records})

    def __iter__(self) -> Iterator[ActivationRecord]:
        return iter(list(self._records))

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        turns = len({(r.participant, r.message_idx, r.kind) for r in self._records})
        return f"ActivationCache({len(self)} records over {turns} turns, sites={list(self.spec.sites)})"


@dataclass(frozen=True)
class CaptureTarget:
    """Where one turn's capture goes: the block's cache, tagged with the turn's message index and kind.
    Handed to the participant with the turn (``GenerationOptions.capture``); the tensors never leave the
    process that holds the model (inside a rollout: the worker running the job)."""

    cache: ActivationCache
    message_idx: int
    kind: str = "turn"

    @property
    def spec(self) -> CaptureSpec:
        return self.cache.spec

    def add(self, participant: str, captured: Captured | None) -> None:
        if captured is not None:
            self.cache.add(participant, self.message_idx, self.kind, captured)


def layer_indices(spec_layers: Sequence[int] | None, n_layers: int, *, where: str) -> list[int]:
    """``layers=`` resolved against a model with ``n_layers`` decoder layers (an error names the range)."""
    if spec_layers is None:
        return list(range(n_layers))
    bad = [i for i in spec_layers if not 0 <= i < n_layers]
    if bad:
        raise ConfigurationError(
            f"{where}: layers {bad} do not exist: this model has {n_layers} decoder layers "
            f"(0..{n_layers - 1})"
        )
    return list(spec_layers)
