"""How much memory of a CUDA device THIS process may still use: what every budget of the engine starts from.

The driver's free memory (``mem_get_info``) is the whole device's: where workers share a GPU, each would read
the other's headroom as its own, plan a batch or a kept cache the cap set by the scheduler then refuses
(``set_per_process_memory_fraction``: each worker's share), and learn that out-of-memory as its own limit.
So the figure is the smaller of the device's free memory and what is left of this process's share, counting
the allocator's cached-but-unused blocks as usable (they are this process's already).
"""

from __future__ import annotations

from typing import Any

__all__ = ["model_cuda_devices", "usable_cuda_bytes"]


def usable_cuda_bytes(device: str | int) -> int:
    """Bytes this process may still allocate on CUDA ``device``: a name like ``"cuda:1"``, an index, or a
    group (``"cuda:0,cuda:1"``: the sum over its members, each holding its own layers' KV)."""
    import torch

    if isinstance(device, str) and "," in device:
        return sum(usable_cuda_bytes(member) for member in device.split(","))
    index = torch.device(device).index if isinstance(device, str) else device
    index = torch.cuda.current_device() if index is None else index
    free, total = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    allocated = torch.cuda.memory_allocated(index)
    share = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _index: 1.0)(index)
    return max(0, min(free + reserved - allocated, int(share * total) - allocated))


def model_cuda_devices(model: Any) -> str:
    """The CUDA devices holding ``model``'s weights, as one name (``"cuda:0"``; ``"cuda:0,cuda:1"`` for a
    model split over a group, in index order); ``""`` when none is on CUDA. A group's budgets (its first
    batch, its kept caches) count the memory of every member: each holds its own layers' KV."""
    found = {p.device for p in model.parameters() if p.device.type == "cuda"}
    return ",".join(str(d) for d in sorted(found, key=lambda d: d.index or 0))
