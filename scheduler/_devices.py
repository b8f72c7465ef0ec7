"""Which devices exist here, and an early, clear refusal of one that does not.

torch is imported lazily and only when a non-CPU device has to be checked, so validating ``["cpu"]`` (and
``import interlens``) stays cheap, and a machine without torch still runs CPU/API-only work.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ._errors import DeviceError

__all__ = ["available_devices", "check_ray_devices", "validate_devices"]

_CUDA = re.compile(r"cuda(?::(\d+))?")
_RAY_KINDS = ("cpu", "cuda")


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


def validate_devices(devices: Sequence[str | Sequence[str]]) -> list[str]:
    """Return ``devices`` as a list of strings, or raise :class:`DeviceError` naming the bad one and the fix.

    Accepted: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` for a visible GPU, ``"mps"`` where available. A
    ``torch.device`` is accepted too (it is turned into its string). Repeating a device is allowed: it means
    two workers sharing it. A GROUP of GPUs, one worker holding one model split over them, is a list
    (``["cuda:0", "cuda:1"]``) or the same joined by commas (``"cuda:0,cuda:1"``); it is returned joined.
    """
    if isinstance(devices, str):
        raise DeviceError(
            f"devices must be a list of device strings, got the string {devices!r}; "
            f"write devices=[{devices!r}]"
        )
    out: list[str] = []
    for i, d in enumerate(devices):
        if isinstance(d, list | tuple):
            out.append(_group(i, [_one_string(i, m) for m in d]))
            continue
        d = _one_string(i, d)
        out.append(_group(i, d.split(",")) if "," in d else d)
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


def _one_string(i: int, d: object) -> str:
    if not isinstance(d, str) and type(d).__module__.split(".")[0] == "torch":
        d = str(d)
    if not isinstance(d, str):
        raise DeviceError(
            f"devices[{i}]: a device must be a string such as 'cpu' or 'cuda:0', got {d!r} "
            f"({type(d).__name__}); a group of GPUs for one worker is a list such as ['cuda:0', 'cuda:1']"
        )
    return d.strip()


def _group(i: int, members: list[str]) -> str:
    """A group of GPUs for one worker, checked and named ``"cuda:0,cuda:1"``."""
    if not members:
        raise DeviceError(
            f"devices[{i}] is an empty group; a group lists the GPUs one worker spreads its model over, "
            "e.g. devices=[['cuda:0', 'cuda:1']]"
        )
    names = []
    for m in members:
        match = _CUDA.fullmatch(m)
        if match is None:
            raise DeviceError(
                f"devices[{i}]: a group of devices may hold only CUDA GPUs ('cuda:N'), got {m!r} in "
                f"{members!r}; use a plain entry such as 'cpu' for a worker of its own"
            )
        names.append(f"cuda:{int(match.group(1) or 0)}")
    if len(set(names)) != len(names):
        raise DeviceError(f"devices[{i}]: the group {members!r} names a GPU twice; list each GPU once")
    return ",".join(names)


def _check_one(device: str, torch: Any | None) -> None:
    if "," in device:
        for member in device.split(","):
            _check_one(member, torch)
        return
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


def check_ray_devices(devices: Sequence[Any] | None) -> list[str] | None:
    """``devices`` for ``cluster="ray"``: None (every GPU of the cluster, else one CPU worker) or entries
    ``"cpu"``/``"cuda"``, one actor each; Ray picks the GPUs, so an index or a group is refused."""
    if devices is None:
        return None
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise DeviceError(
            f"devices must be None or a list such as ['cpu', 'cpu'] with cluster='ray', got {devices!r}"
        )
    out = []
    for i, device in enumerate(devices):
        name = str(device).strip() if type(device).__module__.split(".")[0] == "torch" else device
        if name not in _RAY_KINDS:
            raise DeviceError(
                f"devices[{i}] is {device!r}; with cluster='ray' each entry is 'cpu' or 'cuda', one Ray "
                "actor each (Ray chooses the GPU, so no index and no group): devices=['cuda'] * 4 for four "
                "GPU workers, ['cpu', 'cpu'] for two CPU workers, or devices=None for one worker per GPU of "
                "the cluster"
            )
        out.append(name)
    if not out:
        raise DeviceError("devices is empty; with cluster='ray' pass None or entries such as ['cpu', 'cpu']")
    return out
