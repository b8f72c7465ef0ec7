"""The batch-invariance self-test's verdicts kept on disk, so only the first process on a machine pays for it.

The self-test (``_batch_invariance``) is what a deterministic user pays first: measured on an AMD EPYC CPU
(SmolLM2-135M, bfloat16, 16 debates x 4 turns), a fresh process's first deterministic rollout took 29.3 s,
the same rollout again 12.3 s. Its answer depends only on which kernels run, and those are picked by what
is in the key below, so each verdict is written to a small JSON file under the user's cache directory
(``$INTERLENS_CACHE_DIR``, else ``$XDG_CACHE_HOME/interlens``, else ``~/.cache/interlens``; in its
``batch-invariance`` folder), named by a digest of everything it depends on:

* the probe: which test (the self-test, or a batch probed at its own size with stock or fixed-row linear
  kernels), the test's own definition (its probe shapes, the layout's blocks) and interlens' version;
* the model: its class, its config (less its path), its attention implementation, and its weights'
  identity (:func:`_weights_identity`: every tensor's name, dtype and shape plus a strided sample of its
  bytes: a few milliseconds, no file needed, and it changes with any fine-tune or another checkpoint);
* the device: ``cpu`` with the CPU's model name, the instruction-set flags its kernels dispatch on
  (AVX-512 BF16, AMX, ...) and torch's CPU capability; or each GPU's name and compute capability, the CUDA
  version and the cuBLAS workspace settings;
* torch's and transformers' versions and torch's thread count (the rows each thread gets pick kernels too).

A file stores the key's parts whole and is used only when they are equal to this process's, part for part,
so a verdict never serves a key that differs anywhere (a digest collision or a truncated name included). A
read that fails (no file, unreadable, corrupt, another format) is a miss: the self-test runs and the verdict
is written anew. Writes go to a temporary file in the same folder, renamed into place, so a reader never sees
half a file and processes racing on one key each write a whole, equal verdict. Nothing here raises: a cache
that cannot be read or written only costs the self-test.

Only what a verdict cannot see is refused: a model with forward hooks (or a replaced ``forward``) computes
what its weights do not say, so it is neither read nor written, and its self-test runs every time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["VERDICT_FORMAT", "VerdictKey", "Verdicts", "verdict_dir"]

log = logging.getLogger("interlens")

#: Raised when what a verdict file holds changes; files of another format are misses.
VERDICT_FORMAT = 1
#: CPU flags that pick kernels (oneDNN/MKL/ATen dispatch on them): a verdict from a CPU without one is not
#: this CPU's.
_CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "asimd",
    "sve",
    "sve2",
)
#: Environment settings that change which kernels run.
_KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
)
#: Elements sampled from each tensor for the weights' identity (evenly spaced, the last one included).
_SAMPLE = 64


def verdict_dir() -> Path:
    """Where verdicts live: ``$INTERLENS_CACHE_DIR/batch-invariance`` (the root defaults to
    ``$XDG_CACHE_HOME/interlens``, else ``~/.cache/interlens``). Deleting the folder clears them all."""
    root = os.environ.get("INTERLENS_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "interlens") if xdg else os.path.join(Path.home(), ".cache", "interlens")
    return Path(root) / "batch-invariance"


class VerdictKey:
    """Everything one verdict depends on (JSON-native parts) and the file named by their digest."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts: dict[str, Any] = json.loads(json.dumps(parts, sort_keys=True))  # as a file holds them
        digest = hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()
        self.path = verdict_dir() / f"{digest[:40]}.json"


class Verdicts:
    """One engine's reads and writes of its verdicts. The key is computed at each lookup (a few per engine:
    the self-test, then each larger batch size), so weights edited or threads changed in between count."""

    def __init__(self, model: Any, *, device: str) -> None:
        self._model = model
        self._device = device

    def lookup(self, probe: Mapping[str, Any], fields: tuple[str, ...]) -> tuple[VerdictKey | None, Any]:
        """``(key, verdict)``: the verdict on disk for ``probe`` (a dict of ``fields``, each a bool), or
        None on any miss; key None where this model's verdicts are not kept (hooks, an unreadable model)."""
        try:
            key = self._key(probe)
        except Exception as exc:  # the key's parts could not be read: no verdicts kept, the test runs
            log.debug("no batch-invariance verdict key for %r (%r)", self._model, exc)
            return None, None
        if key is None:
            return None, None
        try:
            stored = json.loads(key.path.read_text())
        except (OSError, ValueError):
            return key, None
        if not isinstance(stored, dict) or stored.get("format") != VERDICT_FORMAT:
            return key, None
        verdict = stored.get("verdict")
        if stored.get("parts") != key.parts or not isinstance(verdict, dict) or set(verdict) != set(fields):
            return key, None
        if not all(isinstance(value, bool) for value in verdict.values()):
            return key, None
        log.debug("batch-invariance verdict %s read from %s", verdict, key.path)
        return key, verdict

    def store(self, key: VerdictKey | None, verdict: Mapping[str, bool]) -> None:
        """Write ``verdict``, computed in this process, under ``key`` (atomically; a failure is logged)."""
        if key is None:
            return
        body = json.dumps({"format": VERDICT_FORMAT, "parts": key.parts, "verdict": dict(verdict)}, indent=1)
        folder = key.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key.path.stem}.", suffix=".tmp", dir=folder)
            try:
                with os.fdopen(fd, "w") as out:
                    out.write(body + "\n")
                os.replace(tmp, key.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.debug("could not keep the batch-invariance verdict in %s: %r", folder, exc)

    def _key(self, probe: Mapping[str, Any]) -> VerdictKey | None:
        import torch

        if _hooked(self._model):
            return None
        try:
            identity = _model_identity(self._model)
        except Exception as exc:  # meta or offloaded tensors, an odd config: no verdicts kept
            log.debug("no identity for %r's weights (%r): its verdicts are not kept", self._model, exc)
            return None
        import transformers

        parts = {
            "probe": dict(probe),
            "model": identity,
            "device": _device_identity(self._device),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "env": {name: os.environ[name] for name in _KERNEL_ENV if name in os.environ},
        }
        return VerdictKey(parts)


def _hooked(model: Any) -> bool:
    """Whether a forward hook or a replaced ``forward`` may change what the model computes (accelerate's
    device hooks only move tensors: they are allowed)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return True
        if "forward" in vars(module) and not hasattr(module, "_hf_hook"):
            return True
    return False


def _model_identity(model: Any) -> dict[str, Any]:
    config = model.config
    settings = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "_commit_hash")}
    attention = [getattr(config, "_attn_implementation", None)]
    for name in ("text_config", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None:
            attention.append(getattr(sub, "_attn_implementation", None))
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest(),
        "attention": [str(a) for a in attention],
        "dtype": str(getattr(model, "dtype", None)),
        "weights": _weights_identity(model),
    }


def _weights_identity(model: Any) -> str:
    """A digest of every parameter's and buffer's name, dtype, shape and :data:`_SAMPLE` evenly spaced
    elements' bytes. Cheap (a few thousand elements whatever the model's size, no file read, no full copy off
    a GPU) and robust: it needs no checkpoint file (a model built or edited in memory has an identity too),
    and a fine-tune or another checkpoint of the same shape changes essentially every element. The verdict
    itself depends on the kernels, which shapes, dtypes and devices pick (all in the key whole); the sample is
    what tells two models of one architecture apart, for safety."""
    import torch

    digest = hashlib.sha256()
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in tensors:
        flat = tensor.detach().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|{flat.device.type}|".encode())
        if flat.numel() == 0:
            continue
        step = max(1, flat.numel() // _SAMPLE)
        sample = torch.cat([flat[::step][:_SAMPLE], flat[-1:]]).contiguous()
        digest.update(sample.view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _device_identity(device: str) -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {"kind": device.split(":")[0], "cpu": _cpu_identity()}
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    found["cpu_capability"] = capability() if callable(capability) else None
    if device.startswith("cuda"):
        members = [torch.device(d.strip()) for d in device.split(",")]
        found["gpus"] = [
            [torch.cuda.get_device_name(d), list(torch.cuda.get_device_capability(d))] for d in members
        ]
        found["cuda"] = torch.version.cuda
    return found


@functools.cache
def _cpu_identity() -> dict[str, Any]:
    """The CPU's model name and its kernel-relevant flags (``/proc/cpuinfo``; elsewhere what ``platform``
    says)."""
    names: list[str] = []
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                field, _, value = line.partition(":")
                field = field.strip()
                if field in ("model name", "Hardware", "CPU part"):
                    names.append(value.strip())
                elif field in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    name = names[0] if names else platform.processor()
    return {"name": name, "machine": platform.machine(), "flags": sorted(flags.intersection(_CPU_FLAGS))}
