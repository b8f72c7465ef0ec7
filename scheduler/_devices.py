"""Which devices exist here, and an early, clear refusal of one that does not.

torch is imported lazily and only when a non-CPU device has to be checked, so validating ``["cpu"]`` (and
``import interlens``) stays cheap, and a machine without torch still runs CPU/API-only work.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ._errors import DeviceError

__all__ = ["available_devices", "validate_devices"]

_CUDA = re.compile(r"cuda(?::(\d+))?")


def _torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cuda_count(torch: Any | None) -> int:
    if torch is None:
        return 0
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken driver means "no usable GPU", not a crash in device discovery
        return 0


def _mps_available(torch: Any | None) -> bool:
    if torch is None:
        return False
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    try:
        return bool(mps is not None and mps.is_available())
    except Exception:
        return False


def available_devices() -> list[str]:
    """Every visible CUDA device (``["cuda:0", ...]``), else ``["mps"]`` where available, else ``["cpu"]``."""
    torch = _torch()
    n = _cuda_count(torch)
    if n:
        return [f"cuda:{i}" for i in range(n)]
    if _mps_available(torch):
        return ["mps"]
    return ["cpu"]


def validate_devices(devices: Sequence[str]) -> list[str]:
    """Return ``devices`` as a list of strings, or raise :class:`DeviceError` naming the bad one and the fix.

    Accepted: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` for a visible GPU, ``"mps"`` where available. A
    ``torch.device`` is accepted too (it is turned into its string). Repeating a device is allowed: it means
    two workers sharing it.
    """
    if isinstance(devices, str):
        raise DeviceError(
            f"devices must be a list of device strings, got the string {devices!r}; "
            f"write devices=[{devices!r}]"
        )
    out: list[str] = []
    for d in devices:
        if not isinstance(d, str) and type(d).__module__.split(".")[0] == "torch":
            d = str(d)
        if not isinstance(d, str):
            raise DeviceError(
                f"a device must be a string such as 'cpu' or 'cuda:0', got {d!r} ({type(d).__name__})"
            )
        out.append(d)
    if not out:
        raise DeviceError(
            f"devices is empty; pass at least one device, e.g. devices={available_devices()!r} "
            "(see available_devices())"
        )
    torch: Any | None = None
    if any(d != "cpu" for d in out):
        torch = _torch()
    for d in out:
        _check_one(d, torch)
    return out


def _check_one(device: str, torch: Any | None) -> None:
    if device == "cpu":
        return
    here = f"devices available here: {available_devices()!r} (see available_devices())"
    if device == "mps":
        if not _mps_available(torch):
            raise DeviceError(f"device 'mps' is not available on this machine; {here}")
        return
    m = _CUDA.fullmatch(device)
    if m is None:
        raise DeviceError(f"unknown device {device!r}: use 'cpu', 'cuda:N' or 'mps'; {here}")
    n = _cuda_count(torch)
    if n == 0:
        why = "torch is not installed" if torch is None else "no CUDA GPU is visible"
        raise DeviceError(f"device {device!r} does not exist: {why}; {here}")
    index = int(m.group(1) or 0)
    if index >= n:
        raise DeviceError(
            f"device {device!r} does not exist: {n} CUDA device(s) are visible (cuda:0..cuda:{n - 1}); {here}"
        )
