"""What a load recipe may add to transformers' ``from_pretrained``: checked ``load_kwargs`` and GGUF files.

``load_kwargs`` are transformers' other loading options (``attn_implementation``, ``trust_remote_code``,
``quantization_config``, ``low_cpu_mem_usage`` ...). They are part of the load recipe (two participants share
one model only if theirs are equal) and of the recipe's fingerprint, so each value must be JSON; and they
never override what interlens sets itself (placement, dtype, the GGUF file, the revision, the download
policy): such a key is refused, naming the setting that sets it.

A GGUF checkpoint (``gguf_file=`` inside a local directory or a hub repo) is read by transformers, which
dequantizes it (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``); reading it needs the ``gguf``
package. Its header (architecture, chat template) is read here without touching the tensors, so a participant
on a local file is checked when it is built and its weights still load only on first use.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._core import ConfigurationError, ConfigurationTypeError, ModelLoadError

__all__ = [
    "TRANSFORMERS_FLOOR",
    "GGUFHeader",
    "check_load_kwargs",
    "gguf_error",
    "gguf_path",
    "load_kwargs_key",
    "no_chat_template",
    "read_gguf_header",
    "require_gguf",
    "require_transformers",
    "tokenizer_load_kwargs",
]

#: from_pretrained options interlens sets itself -> the setting to use instead.
_RESERVED = {
    "device_map": "device= (a rollout places each job on its devices=)",
    "device": "device= (a rollout places each job on its devices=)",
    "max_memory": "device= (a GPU group such as 'cuda:0,cuda:1' is split by each GPU's free memory)",
    "dtype": "dtype=",
    "torch_dtype": "dtype=",
    "gguf_file": "gguf_file=",
    "revision": "revision=",
    "local_files_only": "the environment variable HF_HUB_OFFLINE=1 (interlens decides when to download)",
    "token": "the environment variable HF_TOKEN (a credential never goes into a recipe)",
    "use_auth_token": "the environment variable HF_TOKEN (a credential never goes into a recipe)",
    "output_loading_info": "nothing: interlens needs the model itself, drop it",
    "return_unused_kwargs": "nothing: interlens needs the model itself, drop it",
}
#: The load_kwargs the tokenizer gets too (the rest are the model's own).
_TOKENIZER_KEYS = ("trust_remote_code", "subfolder", "cache_dir", "force_download", "code_revision")
_INSTALL_GGUF = "pip install gguf (or pip install 'interlens[gguf]')"


#: The oldest transformers the engine works with: it passes ``cache=`` to the model's forward, which
#: transformers takes only from 5.24 (5.17, measured: greedy tokens silently stop matching HF ``generate``
#: after the first token, and shared-prefix batches raise). pyproject's ``local`` extra says the same.
TRANSFORMERS_FLOOR = (5, 24)


def require_transformers(version: str) -> None:
    """Refuse a transformers older than :data:`TRANSFORMERS_FLOOR`, naming both versions and the fix."""
    numbers = re.match(r"(\d+)\.(\d+)", version)
    found = (int(numbers.group(1)), int(numbers.group(2))) if numbers else (0, 0)
    if found < TRANSFORMERS_FLOOR:
        floor = ".".join(map(str, TRANSFORMERS_FLOOR))
        raise ModelLoadError(
            f"the local engine needs transformers >= {floor}, and {version} is installed (older releases "
            f"take no cache= in a model's forward: tokens would silently differ); pip install -U "
            f"'transformers>={floor}' (or pip install -U 'interlens[local]')"
        )


def check_load_kwargs(load_kwargs: Any, *, where: str) -> dict[str, Any]:
    """``load_kwargs`` checked and normalized (its JSON round trip, so a recipe read back is equal), or a
    refusal naming the key and why: not a dict of str keys, a key interlens sets itself, a value not JSON."""
    if load_kwargs is None:
        return {}
    if not isinstance(load_kwargs, Mapping):
        raise ConfigurationTypeError(
            f"{where}: load_kwargs must be a dict of transformers from_pretrained options, e.g. "
            f"{{'attn_implementation': 'eager'}}, got {load_kwargs!r} ({type(load_kwargs).__name__})"
        )
    out: dict[str, Any] = {}
    for key, value in load_kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigurationTypeError(
                f"{where}: load_kwargs key {key!r} is not a keyword name; its keys are from_pretrained's "
                "keyword arguments, e.g. 'attn_implementation'"
            )
        if key in _RESERVED:
            raise ConfigurationError(
                f"{where}: load_kwargs[{key!r}] is set by interlens itself and may not be overridden; "
                f"use {_RESERVED[key]}"
            )
        if key == "trust_remote_code" and not isinstance(value, bool):
            raise ConfigurationTypeError(
                f"{where}: load_kwargs['trust_remote_code'] must be True or False, got {value!r}"
            )
        problem = _not_json(value)
        if problem is not None:
            fix = ""
            if callable(getattr(value, "to_dict", None)):
                fix = f"; pass its dict instead: {type(value).__name__}(...).to_dict()"
            raise ConfigurationTypeError(
                f"{where}: load_kwargs[{key!r}] is not a JSON value ({problem}); load_kwargs "
                "are part of the recipe's fingerprint, so each value must be a str, a finite number, a "
                f"bool, None, or a list or dict of them{fix}"
            )
        out[key] = json.loads(json.dumps(value))
    return out


def _not_json(value: Any) -> str | None:
    """Why ``value`` is not plain JSON (None when it is)."""
    if value is None or isinstance(value, str | bool | int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not finite"
    if isinstance(value, list | tuple):
        for item in value:
            problem = _not_json(item)
            if problem is not None:
                return problem
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"the dict key {k!r} is not a str"
            problem = _not_json(v)
            if problem is not None:
                return problem
        return None
    return f"a {type(value).__name__}"


def load_kwargs_key(load_kwargs: Mapping[str, Any]) -> str:
    """``load_kwargs`` as one canonical string, for load recipes and engine keys."""
    return json.dumps(load_kwargs, sort_keys=True, separators=(",", ":"))


def tokenizer_load_kwargs(load_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The load_kwargs the tokenizer takes too."""
    return {k: v for k, v in load_kwargs.items() if k in _TOKENIZER_KEYS}


# ---------------------------------------------------------------------------------------------- GGUF
@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's metadata says, read without its tensors."""

    architecture: str | None
    """``general.architecture`` (``"llama"``, ``"qwen2"``, ...)."""
    model_type: str | None
    """The transformers ``config.model_type`` it dequantizes to (``"qwen2moe"`` is ``"qwen2_moe"``)."""
    has_chat_template: bool


def require_gguf(where: str) -> None:
    """Refuse, naming the install, when the ``gguf`` package is missing (transformers reads GGUF with it).
    Found, not imported: a participant is built without paying for the import."""
    import importlib.util

    try:
        found = importlib.util.find_spec("gguf") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ModelLoadError(
            f"{where}: reading a GGUF checkpoint needs the gguf package, which is not installed: "
            f"{_INSTALL_GGUF}"
        )


def gguf_path(directory: str, gguf_file: str, *, where: str) -> str:
    """The path of ``gguf_file`` in the local ``directory``, or a refusal naming both and what is there."""
    path = os.path.join(directory, gguf_file)
    if os.path.isfile(path):
        return path
    present = sorted(name for name in os.listdir(directory) if name.endswith(".gguf"))
    there = f"it holds {', '.join(map(repr, present))}" if present else "it holds no .gguf file"
    raise ConfigurationError(
        f"{where}: gguf_file={gguf_file!r} is not a file in {directory} (the directory searched; {there}); "
        "pass the name of a .gguf file in that directory"
    )


def read_gguf_header(path: str, *, where: str) -> GGUFHeader:
    """Architecture and chat template of the GGUF file at ``path``, from its key-value header alone.

    Read here rather than with ``gguf.GGUFReader``, which parses every field and tensor entry (seconds for
    a 49k-token vocabulary): the header is walked, arrays skipped by their size, and reading stops at the
    tensors. The ``gguf`` package is still required, since loading the file needs it."""
    require_gguf(where)
    try:
        fields = _header_fields(path, wanted=("general.architecture", "general.name"))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(
            f"{where}: {path} could not be read as a GGUF file ({type(exc).__name__}: {exc}); is it a "
            "complete GGUF checkpoint?"
        ) from None
    architecture, name = fields.get("general.architecture"), fields.get("general.name")
    return GGUFHeader(
        architecture=architecture if isinstance(architecture, str) else None,
        model_type=_model_type(architecture if isinstance(architecture, str) else None, str(name or "")),
        has_chat_template="tokenizer.chat_template" in fields,
    )


#: GGUF value types -> struct format of one item (8: string, 9: array are read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _header_fields(path: str, *, wanted: tuple[str, ...]) -> dict[str, Any]:
    """Every key of the GGUF header at ``path``: the values of ``wanted`` (str or scalar), None for others."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("no GGUF magic number at its start")
        raw = f.read(4)
        order = "<" if struct.unpack("<I", raw)[0] < 65536 else ">"  # big-endian: the version reads swapped
        (version,) = struct.unpack(order + "I", raw)
        if version < 2:
            raise ValueError(f"GGUF version {version} predates the one transformers reads")
        _tensors, n_kv = struct.unpack(order + "QQ", f.read(16))

        def read(fmt: str) -> Any:
            return struct.unpack(order + fmt, f.read(struct.calcsize(fmt)))[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(read("Q"), 1)
            elif kind == 9:
                item, count = read("I"), read("Q")
                if item in _SCALARS:
                    f.seek(count * struct.calcsize(_SCALARS[item]), 1)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _SCALARS:
                f.seek(struct.calcsize(_SCALARS[kind]), 1)
            else:
                raise ValueError(f"unknown GGUF value type {kind}")

        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string().decode("utf-8", errors="replace")
            kind = read("I")
            if key in wanted and kind == 8:
                out[key] = string().decode("utf-8", errors="replace")
            elif key in wanted and kind in _SCALARS:
                out[key] = read(_SCALARS[kind])
            else:
                out[key] = None
                skip(kind)
        return out


def _model_type(architecture: str | None, name: str) -> str | None:
    """transformers' model_type for a GGUF architecture: its renames, as ``load_gguf_checkpoint`` makes them
    (llama.cpp writes Mistral as llama, Qwen2-MoE as qwen2moe ...)."""
    if architecture is None:
        return None
    if "llama" in architecture and "mistral" in name:
        return "mistral"
    if "t5" in architecture:
        return "umt5" if "umt5" in name.lower() else "t5"
    for marker, model_type in (
        ("qwen2moe", "qwen2_moe"),
        ("gpt_oss", "gpt_oss"),
        ("gpt-oss", "gpt_oss"),
        ("qwen3moe", "qwen3_moe"),
        ("minimax-m2", "minimax_m2"),
    ):
        if marker in architecture:
            return model_type
    return architecture


def no_chat_template(where: str, gguf_file: str) -> ModelLoadError:
    """The refusal of a GGUF file without a chat template (interlens renders every view with one)."""
    return ModelLoadError(
        f"{where}: gguf_file={gguf_file!r} embeds no chat template (no tokenizer.chat_template in its "
        "metadata), and interlens renders each speaker's view with the model's chat template; use a GGUF "
        "export of a chat (instruct) model, which embeds its template, or the original checkpoint's "
        "directory or hub id without gguf_file"
    )


_UNSUPPORTED = re.compile(r"architecture\s+(\S+?)\s+is not supported", re.IGNORECASE)


def gguf_error(exc: BaseException, source: str, gguf_file: str) -> ModelLoadError | None:
    """The ModelLoadError for a failure of transformers reading ``gguf_file`` (None: not a GGUF problem)."""
    text = str(exc)
    where = f"loading gguf_file={gguf_file!r} of {source!r}"
    if isinstance(exc, ImportError) and "gguf" in text.lower():
        return ModelLoadError(f"{where}: transformers needs the gguf package to read it: {_INSTALL_GGUF}")
    match = _UNSUPPORTED.search(text)
    if isinstance(exc, ValueError) and match:
        try:
            from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

            supported = f"it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}"
        except ImportError:
            supported = f"it says: {text}"
        return ModelLoadError(
            f"{where}: transformers cannot dequantize GGUF architecture {match.group(1).strip(',.')!r} "
            f"({supported}); use the original checkpoint's directory or hub id without gguf_file, or a GGUF "
            "export of a supported architecture"
        )
    return None
