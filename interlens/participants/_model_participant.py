"""Local HuggingFace models as participants.

A :class:`ModelParticipant` is a lazy load recipe: building one reads at most the model's ``config.json``
(to record its family and refuse a directory that is no model), or for a GGUF checkpoint (``gguf_file=``)
its metadata header; weights load on first use, through a
process-wide cache keyed by the load recipe, so two participants naming one model share one model
object, and pickling ships no weights.

In a rollout the participant is the scheduler's ``EngineSpec``: its turns go to the coalescing batcher of
the engine on the job's device (one batched generate for many conversations). Live, it calls the engine
directly with a batch of one.

There are no per-family classes: every family's chat template is probed from its tokenizer
(``_chat_template``). The old empty subclasses (``Qwen2Participant`` ...) and ``register_family`` remain
importable from this module as deprecated aliases (see ``__getattr__``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
import warnings
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._core import (
    CURRENT_JOB,
    TOKENS_KEY,
    ConfigurationError,
    ConfigurationTypeError,
    GenerationOptions,
    InterpModeError,
    Message,
    ModelLoadError,
    Template,
    TokenRecord,
    View,
    check_int,
    closest_name,
    template_from_json,
)
from ..engine import (
    ChatEngine,
    ChatRequest,
    ChatScoreRequest,
    SamplingSettings,
    check_load_kwargs,
    gguf_path,
    load_kwargs_key,
    no_chat_template,
    read_gguf_header,
)
from ..interp import CaptureSpec, Logprobs, SteeringSpec, steering_from
from ._participant import Participant, register_participant_kind

__all__ = ["AutoModelParticipant", "ModelParticipant"]

#: Removed names -> what replaces them; reached through the module ``__getattr__`` with a warning.
_DEPRECATED_CLASSES = ("Qwen2Participant", "LlamaParticipant", "Gemma2Participant", "Gemma3Participant")


def _register_family(model_type: str) -> Any:
    """The deprecated ``register_family`` decorator: a no-op, chat templates are probed per tokenizer."""

    def decorate(cls: type[ModelParticipant]) -> type[ModelParticipant]:
        return cls

    return decorate


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED_CLASSES:
        warnings.warn(
            f"{__name__}.{name} is deprecated: every family is a ModelParticipant (chat "
            "templates are probed from the tokenizer); use AutoModelParticipant.from_pretrained or "
            "ModelParticipant",
            DeprecationWarning,
            stacklevel=2,
        )
        return ModelParticipant
    if name == "register_family":
        warnings.warn(
            "register_family is deprecated and does nothing: chat templates are probed from the tokenizer, "
            "so no per-family participant class is needed; drop the decorator",
            DeprecationWarning,
            stacklevel=2,
        )
        return _register_family
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ModelParticipant(Participant):
    """A local HuggingFace causal LM. Prefer :meth:`AutoModelParticipant.from_pretrained`."""

    kind = "model"
    needs_device = True

    def __init__(
        self,
        model_id: str,
        *,
        name: str,
        system_prompt: Template = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        stop: Sequence[str] = (),
        seed: int | None = None,
        kv_reuse: bool | str = True,
        device: str | None = None,
        dtype: str | None = None,
        revision: str | None = None,
        steering: SteeringSpec | Sequence[SteeringSpec] | None = None,
        gguf_file: str | None = None,
        load_kwargs: Mapping[str, Any] | None = None,
        record_tokens: bool = False,
    ) -> None:
        super().__init__(name=name, system_prompt=system_prompt)
        who = f"{type(self).__name__}({name!r})"
        if not isinstance(model_id, str) or not model_id:
            raise ConfigurationError(f"{who}: model_id must be a hub id or a local path, got {model_id!r}")
        if isinstance(stop, str):
            stop = (stop,)  # one stop string is a list of one
        # the sampling settings' rules live in the record (SamplingSettings.check), named as this call
        sampling = SamplingSettings(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,  # type: ignore[arg-type]  # any sequence: the record stores a tuple
        )
        sampling.check(f"{type(self).__name__}(name={name!r})", one_stop_string=True)
        if kv_reuse == "auto":
            warnings.warn(
                f"{who}: kv_reuse='auto' is deprecated; it always meant True (keep the KV cache between "
                "turns in batched mode; deterministic mode never reuses it): pass kv_reuse=True or omit it",
                DeprecationWarning,
                stacklevel=2,
            )
            kv_reuse = True
        if not isinstance(kv_reuse, bool):
            raise ConfigurationError(
                f"{who}: kv_reuse must be True or False, got {kv_reuse!r}; True (the default) keeps each "
                "participant's KV cache between its turns in batched mode"
            )
        if seed is not None:  # the participant's own stream, not a setting of the record (whose is per turn)
            check_int(seed, what=f"{who}: seed", low=0, fix="or None for the run's per-rollout seeds")
        if not isinstance(record_tokens, bool):
            raise ConfigurationTypeError(
                f"{who}: record_tokens must be True or False, got {record_tokens!r}; True keeps each turn's "
                "token ids and their log-probabilities (message.tokens)"
            )
        for setting, value in (("device", device), ("dtype", dtype), ("revision", revision)):
            if value is not None and not isinstance(value, str):
                raise ConfigurationTypeError(
                    f"{who}: {setting} must be a str or None, got {value!r} ({type(value).__name__})"
                )
        if gguf_file is not None:
            if not isinstance(gguf_file, str) or not gguf_file.endswith(".gguf"):
                raise ConfigurationTypeError(
                    f"{who}: gguf_file must be the name of a .gguf file in {model_id!r}, got {gguf_file!r}"
                )
            if Path(model_id).expanduser().is_dir():  # a local directory: the file must be there now
                gguf_path(str(Path(model_id).expanduser()), gguf_file, where=who)
        self.model_id = model_id
        self.sampling = sampling
        """How each turn is sampled (the turn's cap and seed are set per turn, in :meth:`request`)."""
        self.seed = seed
        self.kv_reuse = kv_reuse
        self.family: str | None = None
        """``config.model_type`` as ``from_pretrained`` read it (None if unknown): recorded, not used."""
        self.device = device
        self.dtype = dtype
        self.revision = revision
        self.steering: tuple[SteeringSpec, ...] = steering_from(steering, where=f"{who}")
        """Applied to every turn of this participant (needs ``batched=False`` in a rollout); ``()``: none."""
        self.gguf_file = gguf_file
        """A GGUF checkpoint in ``model_id`` (a local directory or hub repo), dequantized at load; or None."""
        self.load_kwargs: dict[str, Any] = check_load_kwargs(load_kwargs, where=who)
        """transformers' other ``from_pretrained`` options (JSON values), part of the load recipe."""
        self.record_tokens = record_tokens
        """Each turn keeps its token ids and their log-probabilities (``message.tokens``)."""

    # Read-only views of the record, for code that read these attributes before it existed; a setting added
    # since is read from the record (``participant.sampling.min_p``).
    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop

    def set(self, **settings: Any) -> ModelParticipant:
        """A copy with some settings changed and validated like the constructor's, e.g.
        ``debater.set(steering=spec)`` or ``debater.set(temperature=0)``; this participant is unchanged."""
        unknown = _unknown_setting(settings, allowed=(*_SETTINGS, "name"))
        if unknown is not None:
            raise ConfigurationTypeError(
                f"{self!r}.set(): no setting {unknown}; its settings are: {', '.join(_SETTINGS)}"
            )
        sampling = self.sampling.settings()
        current = {key: getattr(self, key) for key in _SETTINGS if key not in sampling}
        current |= sampling | {"name": self.name}
        clone = type(self)(self.model_id, **(current | settings))
        clone.family = self.family
        return clone

    # ---------------------------------------------------------------- scheduler EngineSpec
    @property
    def engine_key(self) -> Hashable:
        key: tuple[Any, ...] = ("hf", self.model_id, self.dtype, self.revision)
        if self.gguf_file is not None or self.load_kwargs:  # only when set: older keys keep their shape
            key += (self.gguf_file, load_kwargs_key(self.load_kwargs))
        return key

    def load_engine(self, device: str) -> ChatEngine:
        from ..engine import load_engine

        engine = load_engine(
            self.model_id,
            device=device,
            dtype=self.dtype,
            revision=self.revision,
            allow_download=True,
            gguf_file=self.gguf_file,
            load_kwargs=self.load_kwargs,
        )
        return ChatEngine(engine)

    def live_engine(self) -> ChatEngine:
        """The engine used outside rollouts: on ``device=`` or the first available device."""
        from interlens.scheduler import available_devices

        return self.load_engine(self.device or available_devices()[0])

    # ---------------------------------------------------------------- generation
    def request(self, view: View, options: GenerationOptions) -> ChatRequest:
        cap = self.sampling.max_new_tokens
        if options.max_new_tokens is not None:
            cap = min(cap, options.max_new_tokens)
        capture, steering = self._interp(options, generating=True)
        reuse = None
        if self.kv_reuse and not options.ephemeral and options.stream_id is not None and not steering:
            reuse = self._reuse_key(options.stream_id)  # (the engine runs captured/steered rows from scratch)
        sampling = dataclasses.replace(self.sampling, max_new_tokens=cap, seed=options.seed)
        return ChatRequest(
            view=view,
            sampling=sampling,
            reuse_key=reuse,
            capture=capture,
            steering=steering,
            record_tokens=self.record_tokens,
        )

    def _reuse_key(self, stream_id: str) -> Hashable:
        """The key of this participant's KV cache kept between its turns of conversation ``stream_id``."""
        return (stream_id, self.name)

    async def end_conversation(self, stream_id: str) -> None:
        """Free the KV cache this participant kept for ``stream_id`` in every engine of this process (in a
        thread: the engine's lock may be held by another job's batch)."""
        if not self.kv_reuse:
            return
        import anyio

        from ..engine import release_kept

        await anyio.to_thread.run_sync(release_kept, [self._reuse_key(stream_id)])

    def _interp(
        self, options: GenerationOptions, *, generating: bool
    ) -> tuple[CaptureSpec | None, tuple[SteeringSpec, ...]]:
        """This turn's capture spec and steering. A generated turn is refused them on the batched path of a
        rollout: that path exists to generate many conversations in one batch, and a hooked row must run
        alone. A scored row (logprobs, turn_activations) is one exact forward pass in either mode."""
        from interlens.scheduler import ExecutionMode

        capture = options.capture.spec if options.capture is not None else None
        steering = self.steering if options.steering is None else options.steering
        job = CURRENT_JOB.get()
        batched = job is not None and job.mode is not ExecutionMode.DETERMINISTIC
        if generating and (capture is not None or steering) and batched:
            asked = "activation capture" if capture is not None else "steering"
            raise InterpModeError(
                f"{self.name!r}: {asked} needs the deterministic path, but this rollout runs batched (it "
                "generates many conversations in one forward pass, which a hooked turn cannot share); rerun "
                "with batched=False (mode=ExecutionMode.DETERMINISTIC)"
            )
        return capture, steering

    async def agenerate(self, view: View, options: GenerationOptions | None = None) -> Message:

        options = options or GenerationOptions()
        request = self.request(view, options)
        if request.sampling.max_new_tokens <= 0:  # a spent budget: an empty turn, nothing generated
            return Message(self.name, "", {"n_tokens": 0, "finish_reason": "length", "model": self.model_id})
        result = await self._send(request, options)
        message = self.message(result)
        if options.seed is not None:
            message.metadata["seed"] = options.seed  # the stream the turn drew from (see recorded_seed)
        if request.steering:
            message.metadata["steering"] = [spec.summary() for spec in request.steering]
        return message

    def recorded_seed(self, seed: int) -> int:
        return seed

    async def ascore(
        self, view: View, continuation: str, options: GenerationOptions | None = None
    ) -> Logprobs:
        """The log-probability of ``continuation`` as this speaker's next message after ``view``
        (teacher-forced: one forward pass, no sampling), under this participant's steering unless
        ``options.steering`` overrides it. Inside ``conv.capture()`` its activations are recorded."""

        options = options or GenerationOptions()
        capture, steering = self._interp(options, generating=False)
        request = ChatScoreRequest(view=view, continuation=continuation, capture=capture, steering=steering)
        result = await self._send(request, options)
        return Logprobs(self.name, continuation, result.token_ids, result.tokens, result.logprobs)

    async def _send(self, request: ChatRequest | ChatScoreRequest, options: GenerationOptions) -> Any:
        """One request to this model: inside a rollout job through the job's batcher, live straight to the
        engine (a batch of one, in a thread). A row's error is raised here; its capture is filed."""
        import anyio

        job = CURRENT_JOB.get()
        if job is not None:
            result = await job.generate(self, request)
        else:
            from interlens.scheduler import release_openmp_pool

            release_openmp_pool()  # this thread's OpenMP pool would slow the generating thread's
            engine = await anyio.to_thread.run_sync(self.live_engine)
            [result] = await anyio.to_thread.run_sync(lambda: engine.generate_batch([request]))
        if isinstance(result, BaseException):
            raise result
        if options.capture is not None:
            options.capture.add(self.name, result.captured)
        return result

    def message(self, result: Any) -> Message:
        message = Message(
            self.name,
            result.text,
            {
                "n_tokens": result.n_tokens,
                "finish_reason": result.finish_reason,
                "prompt_tokens": result.prompt_tokens,
                "batched": result.batch_dependent,  # the spec's marker: tokens may depend on the batch
                "batch_size": result.batch_size,
                "batch_invariant": getattr(result, "batch_invariant", None),
                "shared_prefill": result.shared_prefill,
                "shared_prefix_tokens": result.shared_prefix_tokens,
                "kv_reused_tokens": result.kv_reused_tokens,
                "seconds": round(result.seconds, 6),
                "model": self.model_id,
                "at": time.time(),
            },
        )
        if result.model_logprobs is not None:
            record = TokenRecord.build(
                result.token_ids, result.model_logprobs, result.sampling_logprobs, result.prompt_ids
            )
            message.metadata[TOKENS_KEY] = record.to_json()
        return message

    # ---------------------------------------------------------------- JSON / pickling
    def to_json(self) -> dict[str, Any]:
        from .._core import template_to_json

        return {
            "kind": self.kind,
            "family": self.family,
            "model_id": self.model_id,
            "name": self.name,
            "system_prompt": template_to_json(self.system_prompt, field=f"{self.name}.system_prompt"),
            **self.sampling.to_json(),
            "seed": self.seed,
            "kv_reuse": self.kv_reuse,
            "device": self.device,
            "dtype": self.dtype,
            "revision": self.revision,
            "steering": [spec.to_json() for spec in self.steering],
            # written only when set, so a recipe that does not use them keeps its fingerprint
            **({"gguf_file": self.gguf_file} if self.gguf_file is not None else {}),
            **({"load_kwargs": dict(self.load_kwargs)} if self.load_kwargs else {}),
            **({"record_tokens": True} if self.record_tokens else {}),
        }

    def token_record_problem(self) -> str | None:
        return None  # the engine computes every token's log-probabilities

    def describe(self) -> dict[str, Any]:
        from .._core import describe_template

        data = self.to_json() | {"system_prompt": describe_template(self.system_prompt)}
        data["steering"] = [spec.summary() for spec in self.steering]  # the direction by its sha256
        data.pop("device")  # where it runs is not part of the recipe
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelParticipant:
        kwargs = {k: v for k, v in data.items() if k not in ("kind", "family", "model_id", "system_prompt")}
        kwargs["steering"] = [SteeringSpec.from_json(spec) for spec in data.get("steering") or ()]
        if kwargs.get("kv_reuse") == "auto":  # written before 'auto' was deprecated: the same as True
            kwargs["kv_reuse"] = True
        out = cls(data["model_id"], system_prompt=template_from_json(data.get("system_prompt")), **kwargs)
        out.family = data.get("family")
        return out

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)  # holds no weights: engines live in the process-wide cache

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_id!r}, name={self.name!r})"


register_participant_kind(ModelParticipant.kind, ModelParticipant.from_json)


def _read_model_type(id_or_path: str, revision: str | None, gguf_file: str | None = None) -> str | None:
    """``config.model_type`` without loading weights: the JSON file for a local dir, else AutoConfig; for a
    local GGUF file its metadata header (which also says whether it embeds a chat template, which it must);
    for a GGUF file on the hub None (reading its header would download the whole file; the family is
    recorded, not used)."""
    local = Path(id_or_path).expanduser()
    if gguf_file is not None:
        if not local.is_dir():
            return None
        where = f"AutoModelParticipant.from_pretrained({id_or_path!r}, gguf_file={gguf_file!r})"
        header = read_gguf_header(gguf_path(str(local), gguf_file, where=where), where=where)
        if not header.has_chat_template:
            raise no_chat_template(where, gguf_file)
        return header.model_type
    if local.is_dir():
        config = local / "config.json"
        if not config.exists():
            raise ModelLoadError(f"{id_or_path} is a directory without config.json; is it a saved model?")
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(
                f"{config} is not valid JSON ({exc}), so {id_or_path} cannot be read as a model; fix or "
                "regenerate it (model.save_pretrained(dir) writes it)"
            ) from None
        if not isinstance(data, dict):
            raise ModelLoadError(
                f"{config} holds a JSON {type(data).__name__}, not the object of a model config; fix or "
                "regenerate it (model.save_pretrained(dir) writes it)"
            )
        model_type = data.get("model_type")
        return model_type if isinstance(model_type, str) else None
    try:
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(id_or_path, revision=revision), "model_type", None)
    except Exception:
        return None  # offline or not yet downloaded: resolve the family at load time instead


#: The keyword settings of ModelParticipant (and so of from_pretrained), in the order messages list them:
#: read from the constructor, so a new setting is listed (and accepted by ``set``) where it is added.
_SETTINGS = tuple(inspect.signature(ModelParticipant.__init__).parameters)[3:]  # after self, model_id, name


def _unknown_setting(settings: Mapping[str, Any], *, allowed: Sequence[str]) -> str | None:
    """The first setting of ``settings`` not in ``allowed``, quoted, with the closest real one as a hint
    (``'temprature' (did you mean temperature=?)``); None when all are known."""
    unknown = sorted(set(settings) - set(allowed))
    if not unknown:
        return None
    close = closest_name(unknown[0], _SETTINGS)
    return repr(unknown[0]) + (f" (did you mean {close}=?)" if close else "")


class AutoModelParticipant:
    """Factory: ``AutoModelParticipant.from_pretrained(id_or_path, name=...)`` builds a ModelParticipant."""

    def __init__(self) -> None:
        raise TypeError("use AutoModelParticipant.from_pretrained(id_or_path, name=...)")

    @staticmethod
    def from_pretrained(id_or_path: str | Path, *, name: str, **settings: Any) -> ModelParticipant:
        """A lazy participant for ``id_or_path``; reads only the config, never the weights.

        Weights load on first use (a hub id downloads then, as with transformers; set ``HF_HUB_OFFLINE=1``
        to forbid it), once per process and device, shared by every participant with the same load recipe.

        Settings: ``system_prompt``, ``temperature``, ``top_p``, ``max_new_tokens``, ``stop``, ``seed``,
        ``kv_reuse`` (True | False), ``device``, ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``,
        ``"auto"``: the checkpoint's; None: bfloat16 on CUDA, float32 elsewhere), ``revision``, ``steering``
        (a :class:`SteeringSpec` or a list of them, applied to every turn; needs ``batched=False`` in
        rollouts), ``gguf_file`` (a GGUF checkpoint in ``id_or_path``, dequantized by transformers at load;
        needs the ``gguf`` package), ``load_kwargs`` (a dict of transformers' other ``from_pretrained``
        options, JSON values, e.g. ``{"attn_implementation": "eager"}``; the settings above are refused
        there, named).
        """
        unknown = _unknown_setting(settings, allowed=_SETTINGS)
        if unknown is not None:
            raise ConfigurationTypeError(
                f"AutoModelParticipant.from_pretrained(name={name!r}) has no setting {unknown}; "
                f"its settings are: {', '.join(_SETTINGS)}"
            )
        if not isinstance(id_or_path, str | Path) or not str(id_or_path):
            raise ConfigurationTypeError(
                f"AutoModelParticipant.from_pretrained(name={name!r}) needs a hub id or a local directory, "
                f"got {id_or_path!r}"
            )
        model_id = str(id_or_path)
        if model_id.endswith(".gguf") and Path(model_id).expanduser().is_file():
            path = Path(model_id)
            raise ConfigurationError(
                f"AutoModelParticipant.from_pretrained(name={name!r}): {model_id!r} is a GGUF file; pass its "
                f"directory and the file's name: from_pretrained({str(path.parent)!r}, "
                f"gguf_file={path.name!r}, ...)"
            )
        participant = ModelParticipant(model_id, name=name, **settings)  # the settings checked first
        participant.family = _read_model_type(model_id, participant.revision, participant.gguf_file)
        return participant
