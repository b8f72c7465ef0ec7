"""Steering: a direction added to (or ablated from) the residual stream of chosen decoder layers.

A :class:`SteeringSpec` is a recipe part like a sampling setting: it changes a turn's answer, so it is part of
what a run fingerprints (by the sha256 of the direction's float32 bytes, never by pickle) and its summary
(mode, layers, coef, direction norm, digest) goes into each steered turn's ``metadata["steering"]``. The
engine applies it with forward hooks on the decoder layers' outputs, at every position (prompt and answer),
for every forward pass of the steered turn (``_hooks``). Steering needs the deterministic path
(``batched=False``): one row's hook would otherwise steer its batch mates too.

``mode="add"`` adds ``coef * direction`` to the layer output; ``mode="ablate"`` removes ``coef`` times the
output's component along the unit direction (``coef=1``: the output has no component along it left).
"""

from __future__ import annotations

import base64
import hashlib
import math
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .._core import ConfigurationError, ConfigurationTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["SteeringSpec", "as_vectors", "steering_from"]

_MODES = ("add", "ablate")


class SteeringSpec:
    """Steer with ``direction`` (a 1-D tensor/array/list of ``d_model`` floats) at decoder ``layers``.

    ``SteeringSpec(direction, layers=[4, 5], coef=4.0)`` adds ``4 * direction`` to the residual stream after
    layers 4 and 5; ``mode="ablate"`` projects the direction out instead. Immutable; equal when the direction
    (bit for bit, as float32), layers, coef and mode are.
    """

    __slots__ = ("_digest", "coef", "direction", "layers", "mode")

    direction: torch.Tensor
    layers: tuple[int, ...]
    coef: float
    mode: Literal["add", "ablate"]
    _digest: str

    def __init__(
        self,
        direction: Any,
        layers: int | Sequence[int],
        coef: float = 1.0,
        mode: Literal["add", "ablate"] = "add",
    ) -> None:
        import torch

        try:
            vector = torch.as_tensor(direction, dtype=torch.float32).detach().to("cpu").clone()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigurationTypeError(
                f"SteeringSpec(direction=...): cannot read a {type(direction).__name__} as a vector of "
                f"floats ({exc}); pass a 1-D torch tensor, numpy array or list of d_model floats"
            ) from None
        if vector.dim() != 1 or vector.numel() == 0:
            raise ConfigurationError(
                f"SteeringSpec(direction=...): the direction must be 1-D with d_model entries, got shape "
                f"{tuple(vector.shape)}; for activations [n, d_model] use SteeringSpec.difference_of_means"
            )
        if not bool(torch.isfinite(vector).all()) or float(vector.norm()) == 0.0:
            raise ConfigurationError(
                "SteeringSpec(direction=...): the direction must be finite and non-zero; check how it was "
                "computed (two identical activation sets give a zero difference of means)"
            )
        if isinstance(layers, bool) or not isinstance(layers, (int, Sequence)) or isinstance(layers, str):
            raise ConfigurationTypeError(
                f"SteeringSpec(layers={layers!r}): pass a layer index or a sequence of them, e.g. "
                "layers=[4, 5]"
            )
        layer_tuple = (layers,) if isinstance(layers, int) else tuple(layers)
        if not layer_tuple or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_tuple
        ):
            raise ConfigurationError(
                f"SteeringSpec(layers={layers!r}): needs at least one non-negative int decoder-layer index "
                "(0 is the first layer)"
            )
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
            raise ConfigurationError(f"SteeringSpec(coef={coef!r}): must be a finite number, e.g. coef=4.0")
        if mode not in _MODES:
            raise ConfigurationError(f"SteeringSpec(mode={mode!r}): must be 'add' or 'ablate'")
        for name, value in (
            ("direction", vector),
            ("layers", tuple(sorted(set(layer_tuple)))),
            ("coef", float(coef)),
            ("mode", mode),
            ("_digest", hashlib.sha256(vector.numpy().astype("<f4").tobytes()).hexdigest()),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"SteeringSpec is immutable; build a new one (cannot set {name!r})")

    @classmethod
    def difference_of_means(
        cls,
        pos_acts: Any,
        neg_acts: Any,
        layers: int | Sequence[int],
        coef: float = 1.0,
        mode: Literal["add", "ablate"] = "add",
    ) -> SteeringSpec:
        """The direction ``mean(pos_acts) - mean(neg_acts)``, each a ``[n, d_model]`` tensor, a sequence
        of ``[*, d_model]`` tensors, or :class:`ActivationRecord` objects (their answer's activations), every
        row weighted equally."""
        pos = as_vectors(pos_acts, what="difference_of_means(pos_acts=...)")
        neg = as_vectors(neg_acts, what="difference_of_means(neg_acts=...)")
        if pos.shape[1] != neg.shape[1]:
            raise ConfigurationError(
                f"SteeringSpec.difference_of_means: pos_acts have d_model {pos.shape[1]} but neg_acts "
                f"{neg.shape[1]}; capture both sets at the same site of the same model"
            )
        return cls(pos.mean(0) - neg.mean(0), layers, coef=coef, mode=mode)

    # ------------------------------------------------------------------ identity
    @property
    def sha256(self) -> str:
        """Digest of the direction's float32 little-endian bytes: what fingerprints and summaries name."""
        return self._digest

    def summary(self) -> dict[str, Any]:
        """What a steered turn records in ``metadata["steering"]`` and a run fingerprints."""
        return {
            "mode": self.mode,
            "layers": list(self.layers),
            "coef": self.coef,
            "norm": round(float(self.direction.norm()), 6),
            "d_model": int(self.direction.numel()),
            "sha256": self._digest,
        }

    def to_json(self) -> dict[str, Any]:
        """The summary plus the direction itself (base64 of its float32 bytes): a saved recipe reloads it."""
        raw = self.direction.numpy().astype("<f4").tobytes()
        return self.summary() | {"direction_f32_base64": base64.b64encode(raw).decode("ascii")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SteeringSpec:
        import numpy as np

        raw = base64.b64decode(data["direction_f32_base64"])
        spec = cls(np.frombuffer(raw, dtype="<f4").copy(), data["layers"], data["coef"], data["mode"])
        if spec.sha256 != data.get("sha256", spec.sha256):
            raise ConfigurationError(
                "a saved steering direction does not match its recorded sha256: the file was changed or "
                "damaged; recreate the SteeringSpec and save the recipe again"
            )
        return spec

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SteeringSpec):
            return NotImplemented
        key = (self._digest, self.layers, self.coef, self.mode)
        return key == (other._digest, other.layers, other.coef, other.mode)

    def __hash__(self) -> int:
        return hash((self._digest, self.layers, self.coef, self.mode))

    def __reduce__(self) -> tuple[Any, ...]:  # to worker processes: rebuilt from its parts
        return (SteeringSpec, (self.direction, self.layers, self.coef, self.mode))

    def __repr__(self) -> str:
        return (
            f"SteeringSpec(mode={self.mode!r}, layers={list(self.layers)}, coef={self.coef}, "
            f"d_model={self.direction.numel()}, norm={float(self.direction.norm()):.4g}, "
            f"sha256={self._digest[:12]})"
        )


def steering_from(value: Any, *, where: str) -> tuple[SteeringSpec, ...]:
    """``None``, one spec or an iterable of specs -> a tuple of specs (several steer together)."""
    if value is None:
        return ()
    if isinstance(value, SteeringSpec):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        specs = tuple(value)
        if all(isinstance(s, SteeringSpec) for s in specs):
            return specs
    raise ConfigurationTypeError(
        f"{where}: steering={reprlib.repr(value)} is a {type(value).__name__}; steering= takes a "
        "SteeringSpec, a list of them, or None; "
        "build one with SteeringSpec(direction, layers=[...]) or SteeringSpec.difference_of_means(...)"
    )


def as_vectors(acts: Any, *, what: str) -> torch.Tensor:
    """Rows of activations as one float32 CPU ``[n, d_model]`` tensor, from a tensor, a sequence of tensors
    or of records with an ``answer`` tensor (``ActivationRecord``)."""
    import torch

    items = [acts] if isinstance(acts, torch.Tensor) else list(acts)
    rows: list[torch.Tensor] = []
    for item in items:
        tensor = getattr(item, "answer", item)
        try:
            tensor = torch.as_tensor(tensor, dtype=torch.float32).detach().to("cpu")
        except (TypeError, ValueError, RuntimeError):
            raise ConfigurationTypeError(
                f"{what}: cannot read a {type(item).__name__} as activations; pass [n, d_model] tensors or "
                "ActivationRecord objects from a capture"
            ) from None
        rows.append(tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1))
    if not rows or sum(r.shape[0] for r in rows) == 0:
        raise ConfigurationError(f"{what}: no activations given; pass at least one [n, d_model] row")
    widths = {r.shape[1] for r in rows}
    if len(widths) != 1:
        raise ConfigurationError(f"{what}: activations of different widths {sorted(widths)} (d_model) mixed")
    return torch.cat(rows, 0)
