"""Forward hooks for per-row interp: find a model's decoder layers by structure, steer them, record them.

Why by structure and not a per-family table: a table of attribute paths (``model.model.layers``,
``transformer.h``, ...) breaks on every new family and on wrapped models; the shape of a decoder stack does
not. The decoder layers are the ``nn.ModuleList`` of ``num_hidden_layers`` blocks that each hold an attention
and an MLP child; when several qualify (a vision tower beside the text stack), the one whose blocks carry
``d_model``-wide norm weights, then the longest.
Within a layer the attention sublayer is the child whose class name says ``Attention`` and the MLP the child
whose class name says ``MLP``/``FeedForward``; the usual attribute names (``self_attn``, ``mlp``, ...) are
the fallback for blocks named otherwise (a mixture-of-experts block under ``mlp``).

:func:`hooked` installs the hooks for one row's forward passes and removes them in ``finally``, so a model
never keeps a hook past the row it was meant for, even when generation raises. At a layer the steering hooks
are registered before the capture hook, and forward hooks run in registration order, so ``"residual"``
records the layer's output AFTER steering. The sites and positions are defined in ``_capture``,
the steering arithmetic in ``_steering``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._core import ConfigurationError
from ._capture import Captured, CaptureSpec, layer_indices
from ._steering import SteeringSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "DecoderLayer",
    "Recorder",
    "decoder_layers",
    "hidden_size",
    "hooked",
    "site_problem",
    "text_config",
]

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder block and its sublayers (``None`` where a sublayer could not be told apart)."""

    module: Any
    attn: Any | None
    mlp: Any | None


def decoder_layers(model: Any) -> list[DecoderLayer]:
    """The model's decoder layers, found by structure (see the module docstring); an error names the model."""
    from torch import nn

    expected = getattr(text_config(model.config), "num_hidden_layers", None)
    try:
        width = hidden_size(model)
    except (AttributeError, TypeError):
        width = -1  # no width to prefer a stack by
    best: list[DecoderLayer] | None = None
    best_rank = (False, 0)
    fallback: nn.ModuleList | None = None
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if expected is not None and len(module) != expected:
            continue
        parts = [DecoderLayer(child, _attention_of(child), _mlp_of(child)) for child in module]
        if all(p.attn is not None and p.mlp is not None for p in parts):
            # A stack as wide as the residual stream (its norms have d_model weights) beats one that is not
            # (a vision tower of the same depth); then the longer one.
            rank = (_has_width(module[0], width), len(parts))
            if best is None or rank > best_rank:
                best, best_rank = parts, rank
        elif expected is not None and fallback is None:
            fallback = module
    if best is not None:
        return best
    if fallback is not None:  # the right length but blocks we cannot read: residual only
        return [DecoderLayer(child, None, None) for child in fallback]
    raise ConfigurationError(
        f"cannot find the decoder layers of this {type(model).__name__}: no list of "
        f"{expected if expected is not None else 'decoder'} blocks with an attention and an MLP child; "
        "capture and steering need a standard decoder stack (a Llama-, Qwen- or Gemma-like model)"
    )


def hidden_size(model: Any) -> int:
    """The width of the residual stream (``d_model``)."""
    size = getattr(text_config(model.config), "hidden_size", None)
    if isinstance(size, int):
        return size
    return int(model.get_input_embeddings().weight.shape[1])


def _has_width(block: Any, width: int) -> bool:
    return any(p.dim() == 1 and p.numel() == width for p in block.parameters())


def text_config(config: Any) -> Any:
    """The decoder's own config: a multimodal model (Gemma 3's ``Gemma3ForConditionalGeneration``, what
    ``AutoModelForCausalLM`` loads for its checkpoints) keeps its layers' settings in ``text_config``."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _attention_of(block: Any) -> Any | None:
    return _child(block, lambda cls: "attention" in cls, _ATTN_NAMES)


def _mlp_of(block: Any) -> Any | None:
    return _child(block, lambda cls: "mlp" in cls or "feedforward" in cls, _MLP_NAMES)


def _child(block: Any, by_class: Any, names: tuple[str, ...]) -> Any | None:
    children = list(block.named_children())
    for _, child in children:
        if by_class(type(child).__name__.lower()):
            return child
    by_name = dict(children)
    return next((by_name[n] for n in names if n in by_name), None)


class Recorder:
    """Collects one row's captured outputs per (site, layer), forward pass after forward pass.

    The hooks see one row alone (a batch of one), so each forward pass adds ``[positions, d_model]`` to
    each key. The first ``skip`` positions (the prompt, when the spec does not keep it) are dropped as they
    arrive instead of being copied off the device.
    """

    def __init__(self, spec: CaptureSpec, keys: list[tuple[str, int]], *, skip: int) -> None:
        self.spec = spec
        self.chunks: dict[tuple[str, int], list[torch.Tensor]] = {key: [] for key in keys}
        self._skip = dict.fromkeys(keys, skip)
        self._copying: torch.device | None = None  # a device whose copies to pinned memory may be in flight

    def record(self, key: tuple[str, int], output: Any) -> None:
        hidden = _first(output)
        if hidden.dim() != 3 or hidden.shape[0] != 1:
            shape = tuple(hidden.shape)
            raise RuntimeError(f"interp hooks expect one row at a time, got an output of shape {shape}")
        rows = hidden[0]
        skip = self._skip[key]
        if skip:
            self._skip[key] = max(0, skip - rows.shape[0])
            rows = rows[skip:]
            if rows.shape[0] == 0:
                return
        rows = rows.detach()
        if self.spec.offload != "cpu":
            self.chunks[key].append(rows.clone())
        elif rows.device.type == "cuda":
            # into pinned memory without waiting (a blocking copy a layer a step would stall the stream's
            # queue every time); :meth:`captured` waits for the copies once, before reading them
            import torch

            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self.chunks[key].append(host.copy_(rows, non_blocking=True))
            self._copying = rows.device
        else:
            self.chunks[key].append(rows.to("cpu", copy=True))

    def captured(self, *, prompt_len: int, answer_ids: Sequence[int]) -> Captured:
        """The row's :class:`Captured`: ``prompt_len + len(answer_ids)`` positions per key (prompt kept), or
        ``len(answer_ids)``. Built outside inference mode, so the tensors work with autograd (a probe)."""
        import torch

        if self._copying is not None:
            torch.cuda.synchronize(self._copying)
        want = len(answer_ids) + (prompt_len if self.spec.prompt else 0)
        tensors: dict[tuple[str, int], torch.Tensor] = {}
        with torch.inference_mode(False):
            for key, parts in self.chunks.items():
                tensor = torch.cat(parts, 0)
                if tensor.shape[0] != want:
                    raise RuntimeError(f"captured {tensor.shape[0]} positions at {key}, expected {want}")
                tensors[key] = tensor
        return Captured(prompt_len, tuple(answer_ids), tensors, self.spec.prompt)


@contextmanager
def hooked(
    layers: list[DecoderLayer],
    *,
    steering: Sequence[SteeringSpec] = (),
    capture: CaptureSpec | None = None,
    prompt_len: int = 0,
) -> Iterator[Recorder | None]:
    """Steer and/or record the forward passes run inside the block; yields the recorder (``None`` without
    ``capture``). ``prompt_len`` is the number of leading positions that belong to the prompt. Every hook
    is removed when the block exits, however it exits."""
    handles: list[Any] = []
    recorder: Recorder | None = None
    try:
        for spec in steering:
            for index in spec.layers:
                handles.append(layers[index].module.register_forward_hook(_steer_hook(spec)))
        if capture is not None:
            keys = [
                (site, layer)
                for layer in layer_indices(capture.layers, len(layers), where="capture(layers=...)")
                for site in capture.sites
            ]
            recorder = Recorder(capture, keys, skip=0 if capture.prompt else prompt_len)
            for site, layer in keys:
                module = _site_module(layers[layer], site)
                handles.append(module.register_forward_hook(_record_hook(recorder, (site, layer))))
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


def site_problem(layers: list[DecoderLayer], capture: CaptureSpec) -> str | None:
    """Why this model cannot serve ``capture``'s sites (sublayers not told apart), or None."""
    missing = [s for s in capture.sites if s != "residual" and any(_part(x, s) is None for x in layers)]
    if missing:
        return (
            f"capture(sites={list(capture.sites)!r}): this model's decoder layers have no attention/MLP "
            f"child that can be told apart for {missing}; capture sites=('residual',) instead"
        )
    return None


def _part(layer: DecoderLayer, site: str) -> Any | None:
    return layer.attn if site == "attn" else layer.mlp


def _site_module(layer: DecoderLayer, site: str) -> Any:
    if site == "residual":
        return layer.module
    module = _part(layer, site)
    if module is None:
        raise ConfigurationError(f"capture site {site!r} is not available on this model's decoder layers")
    return module


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _steer_hook(spec: SteeringSpec) -> Any:
    on_device: dict[Any, torch.Tensor] = {}  # the float32 direction, moved to each device once

    def hook(module: Any, args: Any, output: Any) -> Any:
        hidden = _first(output)
        direction = on_device.get(hidden.device)
        if direction is None:
            direction = on_device[hidden.device] = spec.direction.to(hidden.device)
        h32 = hidden.float()
        if spec.mode == "add":
            steered = h32 + spec.coef * direction
        else:
            unit = direction / direction.norm()
            steered = h32 - spec.coef * (h32 @ unit).unsqueeze(-1) * unit
        steered = steered.to(hidden.dtype)
        return (steered, *output[1:]) if isinstance(output, tuple) else steered

    return hook


def _record_hook(recorder: Recorder, key: tuple[str, int]) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        recorder.record(key, output)

    return hook
