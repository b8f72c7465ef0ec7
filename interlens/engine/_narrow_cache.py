"""A static batch cache whose decode steps attend over the slots written so far, not the whole preallocation.

A batch's static cache is preallocated to its longest prompt plus its largest ``max_new_tokens``, and stock
static layers hand attention every slot of it, each step (masked where unwritten). Where rows end well
before their cap (an end-of-turn token after 60 of 512 allowed tokens) most of that is empty, and attention
over it is most of a step: measured on SmolLM2-135M in bfloat16 on 2 Intel cores, 300 tokens of context, a
decode step took 56 ms with a 384-slot cache, 80 ms with 1,024 and 116 ms with 2,048 at 16 rows (115 / 205 /
362 ms at 64). Here each step narrows every layer to the slots up to the furthest one written, rounded up to
:data:`WINDOW_BLOCK`: the same keys and values, the same mask over them, without the tail that held nothing.

On CUDA (``ModelRunner.mask_free_steps``), where no row is padded (every slot in the window holds a key every
row may see), the window is exactly the written slots and attention gets no mask at all: with none, SDPA may
take its fused kernels (the flash kernel takes no arbitrary mask, and is the only fused one for a
grouped-query model), where a mask leaves it the memory-efficient or the plain math kernel. On the CPU the
rounded, masked window was faster (``ModelRunner``). transformers builds a mask for every decode
step of a cache it may compile (``is_compileable``), so a layer with an exact window says it is not:
nothing here is compiled.

The prefill still sees every slot (no window until :meth:`narrow` is first called), and code that writes or
copies a layer's storage directly (a laid-out prefix, a kept stream's KV) sees the whole of it.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["WINDOW_BLOCK", "narrowed_layer_type", "narrowed_static_cache"]

#: Decode steps attend over the written slots rounded up to a multiple of this many.
WINDOW_BLOCK = 64


def narrowed_static_cache(config: Any, max_cache_len: int) -> Any:
    """A ``StaticCache`` for ``config`` of ``max_cache_len`` slots; where every layer is a plain static one,
    the narrowing kind (with :meth:`narrow`), else the stock one as it is (sliding-window layers keep their
    own sizes)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    if not all(type(layer) is StaticLayer for layer in cache.layers):
        return cache
    return _classes()[0](config, max_cache_len)


def narrowed_layer_type() -> type:
    """The narrowing layer's class (a ``StaticLayer``: its storage is laid out the same)."""
    return _classes()[1]


@functools.cache
def _classes() -> tuple[type, type]:
    """Built on first use (``import interlens`` does not import transformers)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    class NarrowedLayer(StaticLayer):
        """A static layer that hands attention only its first ``window`` slots (None: all of them)."""

        window: int | None = None
        exact = False  # the window is exactly the written slots and no row is padded: no mask is needed

        @property
        def is_compileable(self) -> bool:  # type: ignore[override]
            """transformers skips the mask of a one-token step only for a cache it will not compile, after
            asking the padding mask whether it holds a zero (a host sync): so only an exact window says no
            (the module docstring), and a padded batch's steps build their mask as before, without that
            question."""
            return not self.exact

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if self.window is None:
                return keys, values
            return keys[:, :, : self.window], values[:, :, : self.window]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return (self.max_cache_len if self.window is None else self.window), 0

    class NarrowedStaticCache(StaticCache):
        """A ``StaticCache`` of :class:`NarrowedLayer` layers."""

        def __init__(self, config: Any, max_cache_len: int) -> None:
            super().__init__(config=config, max_cache_len=max_cache_len)
            self.narrowed = [NarrowedLayer(max_cache_len) for _ in self.layers]
            self.layers = list(self.narrowed)
            self.length = max_cache_len

        def narrow(self, used: int, *, exact: bool = False) -> None:
            """The next steps attend over slots ``[0, used)``: exactly those where no row is padded (no
            mask is needed then, and none is built), else rounded up to ``WINDOW_BLOCK`` slots (a padded
            batch's mask covers the window)."""
            window = min(used if exact else -(-used // WINDOW_BLOCK) * WINDOW_BLOCK, self.length)
            for layer in self.narrowed:
                layer.window, layer.exact = window, exact

    return NarrowedStaticCache, NarrowedLayer
