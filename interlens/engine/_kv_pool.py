"""One persistent KV pool per engine: the storage every static batch's KV lives in, prefill to last step.

A captured decode step (``_static_step``) replays over fixed addresses, so its KV cache cannot be a tensor a
batch allocates and drops: the next batch's cache would lie elsewhere and the graph would write into freed
memory. Here each layer's keys and values are one flat buffer of :attr:`KVPool.slots` slots (a slot: one
token of one row, every kv head), allocated once, and a batch of ``r`` rows over a length bucket of ``l``
slots sees it as ``(r, kv heads, l, head dim)``: the first ``r * l`` slots, row-major. Every row bucket of
one length bucket therefore lays a row's slots at the same address (row ``j`` starts at ``j * l`` slots
whatever ``r`` is), which is what makes a hand-over cheap: rows that carry on into a smaller row bucket move
inside the pool (into its front rows, ``index_copy_``), or not at all when they are already there. The flat
buffer fits any rectangle of at most :attr:`KVPool.slots` slots, as the scheduler's batch budget counts a
batch (rows x the longest prompt + its token cap), not only the largest rows and length seen so far.

The prefill paths write straight into it (:meth:`KVPool.span`: a ``StaticCache`` over a range of rows and a
range of slots of a batch's layout), so a static batch allocates no KV tensor of its own (``_pool_prefill``).

One pool per engine: the batched rows' decoder (``_static_decode``) and the deterministic rows' one
(``_slot_decode``) decode over the same pool object (the engine builds it once and hands it to both), so a
process running both modes holds one pool, and the engine's memory figures count it once. Batches run one
at a time under the engine's lock, so a batch of either kind owns the whole storage while it runs; nothing
in it outlives its batch (the kept-KV collector reads its rows before the batch ends).

Two ways to size it (:meth:`KVPool.room`, what both decoders ask before a batch). By need (the CPU; the
default): :meth:`KVPool.reserve` reallocates when a batch needs more slots than the pool has
(:attr:`KVPool.generation` is bumped: every step, and every graph captured on one, built on an older
generation is stale and must be rebuilt: each decoder compares the generation its steps were built on with
the pool's before it uses them, so a reallocation by one decoder makes the other's steps stale too). From
the engine's memory budget (CUDA: :attr:`KVPool.budget`): the pool reserves :meth:`KVPool.reserve_slots`
once, the KV of the scheduler's first batch budget in tokens (``LocalEngine.token_budget``), and a batch
whose padded rectangle does not fit is split (``StaticDecoder.chunks``, ``SlotDecoder.chunks``), so a long
run never reallocates it. :meth:`KVPool.release` drops the storage (the engine's out-of-memory retry), and
the next batch allocates it again (asking the budget again).

Every layer is a full-length static layer here, a sliding-window one included (:attr:`KVPool.window`): a
ring buffer of the window's size would put a row's keys at slots that depend on how far it has gone, which
neither a fixed layout nor a captured graph can follow. A sliding layer's window is in its mask instead:
the model's own sliding mask over a cache of full-length layers counts the window in slots (transformers'
``sliding_window_overlay``: slot ``s`` is seen from slot ``q`` where ``q - window < s <= q``), which is the
window in positions wherever a row's tokens lie in consecutive slots (a left-padded block, a length group, an
identical prompts' expansion, the decode steps after them). A layout with holes between a row's tokens (a
shared prefix before its suffix, a kept prefix) would count the holes: such layouts are not used for these
models (``_prefill``, ``_kv_reuse``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["KVPool", "full_length_layers"]


def _layer_kinds(config: Any) -> tuple[bool, int | None]:
    """Whether a model of ``config`` has only full and sliding-window attention layers over static cache
    layers (chunked or linear attention and state-space layers are not laid out by slots), and its sliding
    window where some layer slides."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    types = set(getattr(config, "layer_types", None) or ("full_attention",))
    try:
        kinds = {type(layer) for layer in StaticCache(config=config, max_cache_len=1).layers}
    except (TypeError, ValueError, KeyError, NotImplementedError):
        return False, None
    sliding = StaticSlidingWindowLayer in kinds or "sliding_attention" in types
    supported = (
        bool(kinds)
        and kinds <= {StaticLayer, StaticSlidingWindowLayer}
        and types <= {"full_attention", "sliding_attention"}
        # a sliding layer the config's layer types do not name: the model would not know to mask it
        and (StaticSlidingWindowLayer not in kinds or "sliding_attention" in types)
    )
    window = getattr(config, "sliding_window", None) if sliding else None
    return supported and (not sliding or bool(window)), window if supported else None


def full_length_layers(cache: Any, length: int) -> list[Any]:
    """``cache``'s layers as full-length static layers of ``length`` slots: a sliding-window layer's ring
    buffer replaced by a plain ``StaticLayer`` (its window is in the model's mask: module docstring), the
    others kept as they are."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    return [
        StaticLayer(length) if isinstance(layer, StaticSlidingWindowLayer) else layer
        for layer in cache.layers
    ]


class KVPool:
    """Per-layer K/V storage for ``model``'s static batches (module docstring). Not thread-safe: the engine's
    lock guards it, as it guards the model. ``budget``: the storage's size in slots, asked when first needed
    (the engine's ``token_budget``); None, or a budget that says None (the CPU): grown by need."""

    def __init__(self, model: Any, *, budget: Callable[[], int | None] | None = None) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.layers = int(config.num_hidden_layers)
        self.heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        #: whether every layer is full or sliding-window attention (the layers the pool lays out), and the
        #: window where some layer slides (None: every layer attends to the whole length)
        self.supported, self.window = _layer_kinds(config)
        self.dtype = model.dtype
        self.device = next(model.parameters()).device
        #: the storage's capacity in slots (0: none allocated)
        self.slots = 0
        #: the largest row and length bucket reserved since the storage was allocated (for figures)
        self.rows = 0
        self.length = 0
        #: bumped at every (re)allocation: views, steps and graphs of an older generation are stale
        self.generation = 0
        #: the storage's size in slots, asked once when first needed (None: grown by need)
        self.budget = budget
        self._budget_slots: int | None = None  # the budget's answer, once asked (0: by need)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def slot_bytes(self) -> int:
        """Bytes one slot takes over every layer (keys and values): what the budget divides by."""
        import torch

        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.heads * self.head_dim * itemsize

    def nbytes(self) -> int:
        """Bytes the pool holds now."""
        return sum(t.nbytes for t in (*self._keys, *self._values))

    def pieces(
        self, prompts: list[int], caps: list[int], layout: Callable[[int, int], int | None]
    ) -> list[list[int]]:
        """Rows (prompt lengths ``prompts``, token caps ``caps``) in consecutive batches whose layouts fit a
        pool sized from the budget (both decoders' ``chunks``): ``layout(rows, need)`` is the slots a batch
        of ``rows`` rows needing ``need`` slots (the longest prompt + the largest cap) takes, padding
        included, or None where that many rows never share a step. All in one batch where the pool is
        sized by need; a row alone past the pool is a batch of its own."""
        slots = self.budget_slots()
        if slots is None:
            return [list(range(len(prompts)))]
        out: list[list[int]] = []
        for i in range(len(prompts)):
            if out:
                batch = [*out[-1], i]
                taken = layout(len(batch), max(prompts[j] for j in batch) + max(caps[j] for j in batch))
                if taken is not None and taken <= slots:
                    out[-1].append(i)
                    continue
            out.append([i])
        return out

    def fits(self, rows: int, length: int) -> bool:
        """Whether the storage allocated now holds a ``rows`` x ``length`` layout."""
        return rows * length <= self.slots

    def reserve(self, rows: int, length: int) -> bool:
        """Make the storage hold ``rows`` x ``length`` slots; returns whether it was (re)allocated (the old
        storage is freed first, so the peak is the new pool, not both)."""
        grown = self.reserve_slots(rows * length)
        self.rows, self.length = max(rows, self.rows), max(length, self.length)
        return grown

    def reserve_slots(self, slots: int) -> bool:
        """Make the storage hold ``slots`` slots (at least its present size); returns whether it was
        (re)allocated."""
        import torch

        if slots <= self.slots:
            return False
        slots = max(slots, self.slots)
        self.release()
        shape = (slots * self.heads * self.head_dim,)
        self._keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self._values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.slots = slots
        self.generation += 1
        return True

    def budget_slots(self) -> int | None:
        """The storage's size in slots from :attr:`budget` (asked once, until :meth:`release`); None: sized
        by need."""
        if self._budget_slots is None and self.budget is not None:
            self._budget_slots = self.budget() or 0
        return self._budget_slots or None

    def room(self, rows: int, length: int) -> bool:
        """Make the storage hold a ``rows`` x ``length`` layout if it can: grown by need, or allocated once
        at the budget's size (then False where the layout does not fit it). A caller whose steps were built
        on an older :attr:`generation` rebuilds them."""
        slots = self.budget_slots()
        if slots is None:
            self.reserve(rows, length)
            return True
        if rows * length > max(slots, self.slots):
            return False
        self.reserve_slots(slots)
        self.reserve(rows, length)  # within the storage: the largest layout, for figures
        return True

    def release(self) -> None:
        """Drop the storage (the next :meth:`reserve` allocates it again, the budget asked again); stale
        views keep their memory alive until they are dropped too."""
        self._keys, self._values = [], []
        self.slots = self.rows = self.length = 0
        self._budget_slots = None

    def clear(self) -> None:
        """Zero the storage: after a row whose logits went non-finite wrote NaN or inf KV, which a later
        batch's masked slots would carry into its attention (zero weight times NaN is NaN)."""
        for tensor in (*self._keys, *self._values):
            tensor.zero_()

    def shaped(self, keys: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        """One layer's buffer seen as ``(rows, kv heads, length, head dim)`` (module docstring)."""
        return keys[: rows * self.heads * length * self.head_dim].view(
            rows, self.heads, length, self.head_dim
        )

    def views(self, rows: int, length: int) -> Any:
        """A transformers ``StaticCache`` of ``rows`` x ``length`` slots whose layers' keys and values are
        views of the pool (reserved first), each with its own write position (a tensor, as a static
        layer's is). A forward through it writes straight into the pool."""
        self.reserve(rows, length)
        return self.span(0, rows, length=length)

    def span(
        self,
        start: int,
        stop: int,
        *,
        length: int,
        offset: int = 0,
        width: int | None = None,
        written: int = 0,
    ) -> Any:
        """A ``StaticCache`` over rows ``[start, stop)`` and slots ``[offset, offset + width)`` of the
        ``(rows, length)`` layout (``width`` None: to the layout's end), its first ``written`` slots counted
        as filled: a forward through it writes straight into the pool, at the slots a step of that layout
        reads. The storage must already hold the layout (:meth:`fits`)."""
        import torch
        from transformers import StaticCache

        from .._core import ConfigurationError

        width = length - offset if width is None else width
        if not (
            0 <= start < stop and 0 <= offset and 0 < width and offset + width <= length
        ) or not self.fits(stop, length):
            raise ConfigurationError(
                f"KVPool.span(start={start}, stop={stop}, length={length}, offset={offset}, width={width}): "
                f"not a range of a layout the pool's {self.slots} slots hold; reserve(rows, length) first"
            )
        cache: Any = StaticCache(config=self.config, max_cache_len=width)
        cache.layers = full_length_layers(cache, width)
        for layer, keys, values in zip(cache.layers, self._keys, self._values, strict=True):
            layer.max_cache_len = width
            layer.device = self.device
            layer.batch_size, layer.num_heads = stop - start, self.heads
            layer.k_head_dim = layer.v_head_dim = self.head_dim
            layer.keys = self.shaped(keys, stop, length)[start:stop, :, offset : offset + width]
            layer.values = self.shaped(values, stop, length)[start:stop, :, offset : offset + width]
            layer.cumulative_length = torch.tensor(written, dtype=torch.long, device=self.device)
            layer.is_initialized = True
        return cache

    def holds(self, cache: Any) -> bool:
        """Whether every layer of ``cache`` is a view of this pool's storage."""
        layers = getattr(cache, "layers", None)
        if not self._keys or not layers or len(layers) != self.layers:
            return False
        return all(
            getattr(layer, "keys", None) is not None
            and layer.keys.untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()
            for layer, keys in zip(layers, self._keys, strict=True)
        )
