"""Process-wide cache of loaded local models, keyed by load recipe.

Two participants naming the same model on the same device must share ONE copy of the weights: a debate
between two instances of one 7B model should cost one 7B model of memory, and the scheduler's batcher can
only co-step their turns if they are turns of the same engine. So engines are cached by everything that
changes what gets loaded (path or hub id, device, dtype, revision, trust_remote_code, the GGUF file, the other
``from_pretrained`` options: ``load_kwargs``, checked in ``_load_options``), and loading is guarded
by a lock per recipe: two threads asking at once load once, while different recipes still load in parallel.

Loading never waits on the network unless asked to: a hub id is looked up in the local Hugging Face cache only
(``local_files_only``), because a rollout loads models in worker threads and processes where a download
would stall every conversation, and on an offline machine the hub client retries for most of a minute before
failing. ``allow_download=True`` lets a miss go to the hub (still never when ``HF_HUB_OFFLINE`` is set).
Every failure to load becomes a :class:`~interlens._core._exceptions.ModelLoadError` that says what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from .._core import ConfigurationError, DeviceError, ModelLoadError
from ._device_memory import usable_cuda_bytes
from ._generation import LocalEngine
from ._load_options import (
    check_load_kwargs,
    gguf_error,
    gguf_path,
    load_kwargs_key,
    no_chat_template,
    require_gguf,
    require_transformers,
    tokenizer_load_kwargs,
)

__all__ = [
    "cached_engines",
    "clear_engine_cache",
    "forget_engine",
    "free_device_memory",
    "load_engine",
    "recipe_key",
    "release_kept",
]

_DTYPES = ("float32", "bfloat16", "float16", "auto")
#: The share of a GPU's free memory a model split over a group may take (the rest: activations, KV cache).
_MEMORY_SHARE = 0.85

_log = logging.getLogger("interlens")
_guard = threading.Lock()
_import_lock = threading.Lock()
#: One ``from_pretrained`` at a time per process (see :func:`_loading_alone`).
_from_pretrained_lock = threading.Lock()
#: transformers' own ``PreTrainedModel.tie_weights``, kept at first import (see :func:`_loading_alone`).
_real_tie_weights: Any = None
_engines: dict[tuple[Any, ...], LocalEngine] = {}
_loading: dict[tuple[Any, ...], threading.Lock] = {}


def load_engine(
    path_or_id: str,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    allow_download: bool = False,
    gguf_file: str | None = None,
    load_kwargs: dict[str, Any] | None = None,
) -> LocalEngine:
    """Return the engine for this load recipe, loading model + tokenizer on first use (thread-safe).

    ``dtype`` is one of ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"`` (the checkpoint's dtype) or
    None: bfloat16 on CUDA, transformers' default (float32) elsewhere. The weights load straight onto
    ``device`` (``device_map``, see :func:`load_kwargs`), or split over a group of GPUs written
    ``"cuda:0,cuda:1"``, and the model is put in eval mode. A hub id must already be in the local Hugging
    Face cache unless ``allow_download`` is true. ``gguf_file`` names a GGUF checkpoint in the directory or
    hub repo (dequantized by transformers; needs the ``gguf`` package); ``load_kwargs`` are further
    ``from_pretrained`` options (checked: JSON values, none of the settings above).
    """
    if not isinstance(path_or_id, str) or not path_or_id.strip():
        raise ModelLoadError(
            f"load_engine({path_or_id!r}): pass a local model directory or a Hugging Face hub id "
            "such as 'Qwen/Qwen2.5-0.5B-Instruct'."
        )
    if dtype is not None and dtype not in _DTYPES:
        raise ModelLoadError(
            f"load_engine({path_or_id!r}, dtype={dtype!r}): unknown dtype; use one of {', '.join(_DTYPES)} "
            "or None."
        )
    where = f"load_engine({path_or_id!r})"
    extra = check_load_kwargs(load_kwargs, where=where)
    if "trust_remote_code" in extra:
        if trust_remote_code and extra["trust_remote_code"] is not True:
            raise ConfigurationError(
                f"{where}: trust_remote_code=True and load_kwargs['trust_remote_code']="
                f"{extra['trust_remote_code']!r} disagree; set it in one place"
            )
        trust_remote_code = extra.pop("trust_remote_code") is True
    if gguf_file is not None:
        if not isinstance(gguf_file, str) or not gguf_file:
            raise ModelLoadError(f"{where}: gguf_file must be the name of a .gguf file, got {gguf_file!r}")
        require_gguf(where)
    device = _canonical_device(device)
    local = os.path.isdir(os.path.expanduser(path_or_id))
    source = os.path.realpath(os.path.expanduser(path_or_id)) if local else path_or_id
    if gguf_file is not None and local:
        try:
            gguf_path(source, gguf_file, where=where)
        except ConfigurationError as exc:
            raise ModelLoadError(str(exc)) from None
    key = recipe_key(
        source,
        device=device,
        dtype=dtype,
        revision=revision,
        trust=trust_remote_code,
        gguf_file=gguf_file,
        load_kwargs=extra,
    )
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _guard:
        lock = _loading.setdefault(key, threading.Lock())
    with lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _load(
                source,
                local,
                device=device,
                dtype=dtype,
                revision=revision,
                trust=trust_remote_code,
                download=allow_download,
                gguf_file=gguf_file,
                extra=extra,
            )
            with _guard:
                _engines[key] = engine
    return engine


def clear_engine_cache() -> None:
    """Forget every cached engine (tests; freeing memory between runs). Engines in use stay valid."""
    with _guard:
        _engines.clear()
        _loading.clear()


def recipe_key(
    source: str,
    *,
    device: str,
    dtype: str | None,
    revision: str | None,
    trust: bool,
    gguf_file: str | None = None,
    load_kwargs: dict[str, Any] | None = None,
) -> tuple[Any, ...]:
    """What tells two loads apart: the dtype as loaded (None on CUDA is bfloat16, so asking for None and for
    "bfloat16" shares one copy of the weights instead of holding two); the GGUF file and the load_kwargs
    only when set (canonical JSON)."""
    key: tuple[Any, ...] = (source, device, dtype or _default_dtype(device), revision, bool(trust))
    if gguf_file is not None or load_kwargs:
        key += (gguf_file, load_kwargs_key(load_kwargs or {}))
    return key


def cached_engines() -> list[LocalEngine]:
    """The engines this process holds now (for release, eviction and tests)."""
    with _guard:
        return list(_engines.values())


def release_kept(reuse_keys: Iterable[Hashable]) -> None:
    """Free the KV caches kept under ``reuse_keys`` in every cached engine (a conversation ended)."""
    keys = list(reuse_keys)
    for engine in cached_engines():
        for key in keys:
            engine.release(key)


def forget_engine(engine: LocalEngine) -> None:
    """Drop ``engine`` from the cache (the run no longer needs it) and its kept KV caches: a later
    ``load_engine`` of that recipe loads it afresh; whoever still holds it may keep using it. Drop your own
    reference, then call :func:`free_device_memory`, for the memory to go back to the device."""
    with _guard:
        for key in [k for k, v in _engines.items() if v is engine]:
            del _engines[key]
            _loading.pop(key, None)
    engine.clear_reuse()


def free_device_memory(device: str) -> None:
    """Collect garbage cycles and hand the CUDA allocator's cached blocks back (after an eviction)."""
    import gc

    gc.collect()
    if "cuda" in device:
        import torch

        if torch.cuda.is_available():
            for member in device.split(","):
                with torch.cuda.device(member):
                    torch.cuda.empty_cache()


def _canonical_device(device: str) -> str:
    """Validate ``device`` and name it one way ("cuda" is "cuda:0"), so one device never holds two copies.

    A group of GPUs (one model split over them) is ``"cuda:0,cuda:1"``: each member is checked."""
    if isinstance(device, str) and "," in device:
        members = [_canonical_device(m.strip()) for m in device.split(",")]
        if not all(m.startswith("cuda:") for m in members) or len(set(members)) != len(members):
            raise DeviceError(
                f"device={device!r}: a group of devices lists distinct CUDA GPUs, e.g. 'cuda:0,cuda:1'; "
                "use one device such as 'cpu' otherwise."
            )
        return ",".join(members)
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceError(
            f"device={device!r} is not a device string; use 'cpu', 'cuda', 'cuda:0', ..."
        ) from exc
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = parsed.index or 0
        if index >= count:
            raise DeviceError(
                f"device={device!r} does not exist here ({count} CUDA device(s) visible); "
                "use 'cpu' or one of interlens' available devices."
            )
        return f"cuda:{index}"
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device={device!r}: MPS is not available on this machine; use 'cpu'.")
    return str(parsed)


def load_kwargs(
    device: str, dtype: str | None, *, free_memory: Callable[[int], int] | None = None
) -> dict[str, Any]:
    """What ``from_pretrained`` gets for ``device`` (canonical) and ``dtype``: where the weights go, and how.

    Straight onto the device (``device_map={"": device}``), never host RAM first: eight workers loading a
    70B through host RAM would need a terabyte. A group (``"cuda:0,cuda:1"``) gets ``device_map="auto"``
    limited to its GPUs (``max_memory`` from each one's free memory, ``free_memory(index)`` in bytes). On
    CUDA, ``dtype=None`` means bfloat16: a checkpoint whose config says float32 would otherwise load in
    float32, at twice the memory and a fraction of the speed. Elsewhere None keeps transformers' default.
    """
    kwargs: dict[str, Any] = {}
    dtype = dtype or _default_dtype(device)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if "," in device:
        free = free_memory or usable_cuda_bytes
        indices = [int(m.partition(":")[2]) for m in device.split(",")]
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {i: int(free(i) * _MEMORY_SHARE) for i in indices}
    else:
        kwargs["device_map"] = {"": device}
    return kwargs


def _default_dtype(device: str) -> str | None:
    return "bfloat16" if device.startswith("cuda") else None


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", "\\")) or os.path.isfile(os.path.expanduser(name))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _load(
    source: str,
    local: bool,
    *,
    device: str,
    dtype: str | None,
    revision: str | None,
    trust: bool,
    download: bool,
    gguf_file: str | None = None,
    extra: dict[str, Any] | None = None,
) -> LocalEngine:
    if not local and _looks_like_path(source):
        raise ModelLoadError(
            f"no model directory at {source!r}; check the path (it must be a directory written by "
            "save_pretrained, holding config.json and the weights)."
        )
    kwargs: dict[str, Any] = {**(extra or {}), "revision": revision, "trust_remote_code": trust}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    kwargs.update(load_kwargs(device, dtype))
    if not _have_accelerate():  # transformers places weights by device_map only through accelerate
        placed = kwargs.pop("device_map")
        kwargs.pop("max_memory", None)
        if placed == "auto":
            raise ModelLoadError(
                f"loading {source!r} over the GPU group {device!r} needs the accelerate package (it splits "
                "the model over the GPUs): pip install accelerate (or interlens[local])."
            )
    if local:
        return _from_pretrained(source, device, kwargs, local_files_only=True, where="this directory")
    try:
        return _from_pretrained(source, device, kwargs, local_files_only=True, where="the local HF cache")
    except ModelLoadError as exc:
        if gguf_file is not None and not isinstance(exc.__cause__, OSError):
            raise  # the cached GGUF file was found but cannot be used (no template, an architecture): say so
        if not download or _offline():
            why = (
                "HF_HUB_OFFLINE is set" if download else "downloading was not allowed (allow_download=False)"
            )
            raise ModelLoadError(
                f"{source!r} is not in the local Hugging Face cache and {why}; download it first "
                f"(`hf download {source}`), pass a local directory, or allow the download."
            ) from exc
    return _from_pretrained(source, device, kwargs, local_files_only=False, where="the Hugging Face hub")


def _from_pretrained(
    source: str, device: str, kwargs: dict[str, Any], *, local_files_only: bool, where: str
) -> LocalEngine:
    AutoModelForCausalLM, AutoTokenizer = _transformers()
    gguf_file = kwargs.get("gguf_file")
    try:
        with _loading_alone():
            tokenizer = AutoTokenizer.from_pretrained(
                source, local_files_only=local_files_only, **_tok_kwargs(kwargs)
            )
            if gguf_file is not None and not getattr(tokenizer, "chat_template", None):
                raise no_chat_template(f"loading {source!r}", gguf_file)
            _refuse_empty_tokenizer(source, tokenizer)
            model, info = AutoModelForCausalLM.from_pretrained(
                source, local_files_only=local_files_only, output_loading_info=True, **kwargs
            )
    except (OSError, ValueError, KeyError, ImportError) as exc:
        translated = gguf_error(exc, source, gguf_file) if gguf_file is not None else None
        if translated is not None:
            raise translated from exc
        raise ModelLoadError(
            f"could not load {source!r} from {where}: {exc}. Check the name (a local directory written by "
            "save_pretrained, or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct') and that it is downloaded."
        ) from exc
    _refuse_non_causal(source, model)
    _refuse_missing_weights(source, model, info)
    if "device_map" not in kwargs:  # no accelerate: loaded on the CPU; a GPU gets it from there
        model = model.to(device)
    model.eval()
    # A group's inputs go to its first GPU, where the embedding is; accelerate's hooks bring the logits back
    # there too, so sampling runs on that device.
    embedding = model.get_input_embeddings()
    first = str(embedding.weight.device) if "," in device and embedding is not None else device
    # an attention the user named (even "sdpa") is kept as named: only the default gets interlens' CPU one
    engine = LocalEngine(model, tokenizer, device=first, decode_attention="attn_implementation" not in kwargs)
    engine.placement = {k: kwargs[k] for k in ("device_map", "max_memory", "dtype") if k in kwargs}
    return engine


def _refuse_empty_tokenizer(source: str, tokenizer: Any) -> None:
    """A directory without tokenizer files still gives transformers a tokenizer, of an empty vocabulary, that
    turns every prompt into nothing: say the tokenizer is missing instead of failing on an empty prompt."""
    if len(tokenizer) < 2:
        raise ModelLoadError(
            f"loading {source!r}: it holds no tokenizer (transformers built one with an empty vocabulary); "
            "save the model's tokenizer beside its weights (tokenizer.save_pretrained(the same directory))"
        )


def _refuse_non_causal(source: str, model: Any) -> None:
    """Refuse a checkpoint whose head was trained for something else than the next token (a BERT masked LM,
    a classifier, a bare encoder): the causal class transformers builds for its config would generate from a
    head it was never trained as."""
    architectures = getattr(model.config, "architectures", None) or []
    if not architectures:  # a GGUF file's config, or a hand-built one: nothing to compare
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = {name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for name in _names(names)}
    # A head trained for something else than the next token (a VLM's ForConditionalGeneration is not one:
    # transformers builds its decoder as the causal class)
    other = [a for a in architectures if a not in causal and a.endswith(_NOT_GENERATIVE)]
    if other and not any(name in causal for name in architectures):
        raise ModelLoadError(
            f"loading {source!r}: its checkpoint is {', '.join(architectures)}, not a causal language model "
            f"(transformers would run it as {type(model).__name__} and generate noise); interlens generates "
            "with decoder-only chat models such as Qwen, Llama, Gemma or SmolLM"
        )


_NOT_GENERATIVE = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForPreTraining",
    "ForNextSentencePrediction",
    "Model",  # a bare encoder (BertModel); the causal ones are named ...LMHeadModel or ...ForCausalLM
)


def _names(value: Any) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, list | tuple) else (str(value),)


def _refuse_missing_weights(source: str, model: Any, info: dict[str, Any]) -> None:
    """Refuse a model some of whose weights the checkpoint did not hold: transformers fills them with random
    values and only logs it, and the engine would then generate noise as if it were the model's answer."""
    missing = sorted(info.get("missing_keys") or ())
    if not missing:
        return
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    architecture = type(model).__name__
    raise ModelLoadError(
        f"loading {source!r}: {len(missing)} weight(s) of {architecture} are not in the checkpoint "
        f"({shown}); transformers would fill them with random values and every reply would be noise. "
        "Load a causal language model checkpoint whose files are complete (an encoder such as BERT has no "
        "generation head)."
    )


@contextlib.contextmanager
def _loading_alone() -> Iterator[None]:
    """Hold the process's one loading slot, with transformers' weight tying in place.

    While it builds a model, ``from_pretrained`` swaps ``PreTrainedModel.tie_weights`` for a no-op on the
    class and puts back what it found (transformers 5.24, ``initialization.no_tie_weights``). Two loads in two
    threads interleave that swap, and the later one puts back the no-op for good: from then on no model in
    the process ties its LM head to its embedding, and every tied checkpoint (SmolLM2, Qwen2.5-0.5B, Llama
    3.2, Gemma...) loads with a random LM head and generates noise (measured: three tiny models loaded in
    three threads leave the no-op behind). So loads run one at a time here, and a no-op left by someone else's
    threads is replaced by the real method first."""
    global _real_tie_weights
    from transformers import PreTrainedModel

    with _from_pretrained_lock:
        if _real_tie_weights is None:
            candidate = PreTrainedModel.tie_weights
            if candidate.__name__ == "tie_weights":
                _real_tie_weights = candidate
        if _real_tie_weights is not None and PreTrainedModel.tie_weights is not _real_tie_weights:
            _log.warning(
                "transformers' PreTrainedModel.tie_weights was left replaced (by models loaded at once in "
                "several threads outside interlens); restored before loading, or tied weights would be random"
            )
            PreTrainedModel.tie_weights = _real_tie_weights  # type: ignore[method-assign]
        yield


def _transformers() -> tuple[Any, Any]:
    """``AutoModelForCausalLM`` and ``AutoTokenizer``, imported under a lock.

    transformers resolves its names lazily, and two threads resolving them at once in a fresh process (a
    worker loading two models concurrently) make one of them fail with "cannot import name
    'AutoModelForCausalLM'". The cache classes the engine imports later are resolved here too, so a
    generation starting while another model loads does not race either."""
    with _import_lock:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, StaticCache

        del DynamicCache, StaticCache
    require_transformers(transformers.__version__)  # before a load, not after its minutes
    return AutoModelForCausalLM, AutoTokenizer


def _have_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def _tok_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the tokenizer takes of the model's kwargs: the revision, the GGUF file, and the load_kwargs
    tokenizers read (``trust_remote_code``, ``subfolder`` ...); not placement, dtype or model options."""
    own = {k: kwargs[k] for k in ("revision", "gguf_file") if k in kwargs}
    return own | tokenizer_load_kwargs(kwargs)
