"""One persistent KV pool per engine: the storage every static decode step's cache is a view of.

A captured decode step (``_static_step``) replays over fixed addresses, so its KV cache cannot be a tensor a
batch allocates and drops: the next batch's cache would lie elsewhere and the graph would write into freed
memory. Here each layer's keys and values are allocated once, ``(rows, kv heads, length, head dim)`` for the
largest row and length bucket the engine has needed, and a step of ``r`` rows and ``l`` slots gets the views
``keys[:r, :, :l]``: every bucket shares one layout, so a row's slot lies at the same address in every view.
That is what makes a hand-over cheap: rows that carry on into a smaller row bucket move inside the pool
(into its front rows, ``index_copy_``), or not at all when they are already there.

The pool grows only by reallocation, when a batch needs a larger bucket than any before (:meth:`KVPool.views`
then bumps :attr:`KVPool.generation`: every step, and every graph captured on one, built on an older
generation is stale and must be rebuilt). :meth:`KVPool.release` drops the storage (the engine's
out-of-memory retry), and the next batch allocates it again at its own size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["KVPool"]


class KVPool:
    """Per-layer K/V storage for ``model``'s decode steps (module docstring). Not thread-safe: the engine's
    lock guards it, as it guards the model."""

    def __init__(self, model: Any) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.layers = int(config.num_hidden_layers)
        self.heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.dtype = model.dtype
        self.device = next(model.parameters()).device
        self.rows = 0  # the storage's row and slot capacity (0: none allocated)
        self.length = 0
        #: bumped at every (re)allocation: views, steps and graphs of an older generation are stale
        self.generation = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def nbytes(self) -> int:
        """Bytes the pool holds now."""
        return sum(t.nbytes for t in (*self._keys, *self._values))

    def reserve(self, rows: int, length: int) -> bool:
        """Make the storage hold ``rows`` x ``length`` slots; returns whether it was (re)allocated (the old
        storage is freed first, so the peak is the new pool, not both)."""
        import torch

        if rows <= self.rows and length <= self.length:
            return False
        rows, length = max(rows, self.rows), max(length, self.length)
        self.release()
        shape = (rows, self.heads, length, self.head_dim)
        self._keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self._values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.rows, self.length = rows, length
        self.generation += 1
        return True

    def release(self) -> None:
        """Drop the storage (the next :meth:`reserve` allocates it again); stale views keep their memory
        alive until they are dropped too."""
        self._keys, self._values = [], []
        self.rows = self.length = 0

    def views(self, rows: int, length: int) -> Any:
        """A transformers ``StaticCache`` of ``rows`` x ``length`` slots whose layers' keys and values are
        views of the pool (reserved first), each with its own write position (a tensor, as a static
        layer's is). A forward through it writes straight into the pool."""
        import torch
        from transformers import StaticCache

        self.reserve(rows, length)
        cache: Any = StaticCache(config=self.config, max_cache_len=length)
        for layer, keys, values in zip(cache.layers, self._keys, self._values, strict=True):
            layer.max_cache_len = length
            layer.device = self.device
            layer.batch_size, layer.num_heads = rows, self.heads
            layer.k_head_dim = layer.v_head_dim = self.head_dim
            layer.keys = keys[:rows, :, :length]
            layer.values = values[:rows, :, :length]
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=self.device)
            layer.is_initialized = True
        return cache
