"""Hosted models as participants: OpenAI, Anthropic and OpenRouter through their official async SDKs.

An :class:`APIParticipant` is plain settings (it pickles to a worker with no key inside): the speaker's view
becomes a provider-neutral :class:`~interlens.providers._base.APIRequest` where the job runs (folded to what
the provider accepts), and the request goes to the API gateway in the parent, which holds the one client per
provider configuration, bounds the requests in flight, retries, and, with ``batch=True``, gathers a round's
turns from every live conversation into ONE provider batch that a crashed run re-attaches to instead of
paying for twice. What each provider wants on the wire lives in its own module, found by name through
``_providers``.

Routing: a rollout job whose context offers ``call_gateway`` sends the request there (the run's gateway);
otherwise the running event loop's gateway serves it (live use, and jobs in the parent's own loop).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, cast

from interlens.scheduler.gateway import (
    BatchPolicy,
    BatchRowError,
    ProviderCallError,
    ProviderClient,
    RetryPolicy,
)

from .._core import (
    CURRENT_JOB,
    MODERATOR,
    TOKENS_KEY,
    ConfigurationError,
    GenerationError,
    GenerationOptions,
    InterpModeError,
    Message,
    Template,
    TokenRecord,
    View,
    count_tokens,
    template_from_json,
)
from ..providers import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TIMEOUT,
    PROVIDERS,
    APIRequest,
    APIResult,
    APISettings,
    fold_view,
    open_client,
    resolve_base_url,
)
from ..providers import provider as provider_named
from ._participant import Participant, register_participant_kind

log = logging.getLogger("interlens")

#: Participants (by name) already warned in this process that their answers came without log-probabilities.
_WARNED_MISSING: set[str] = set()

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "DEFAULT_MAX_TOKENS", "DEFAULT_TIMEOUT", "APIParticipant"]

DEFAULT_MAX_IN_FLIGHT = 64
"""Requests in flight at once per provider configuration, unless ``max_in_flight=`` says otherwise. Providers'
rate limits are per account and model; 64 keeps a typical tier busy without tripping it, and the adaptive
limiter halves the window on sustained 429s anyway."""

#: A request's seed is the turn's seed in 31 bits: OpenAI takes any integer, but vLLM and other servers
#: built on int32 refuse larger ones.
_SEED_MASK = 2**31 - 1

# Interp needs the weights: a hosted model offers none of it through interlens. Refused, never ignored.
_INTERP_SETTINGS = (
    "capture",
    "steering",
    "steer",
    "probes",
    "logprobs",
    "top_logprobs",
    "output_hidden_states",
    "activations",
)


def _interp_error(name: str, setting: str) -> InterpModeError:
    if setting in ("logprobs", "top_logprobs"):
        return InterpModeError(
            f"APIParticipant({name!r}) cannot do interp ({setting}=): a hosted model exposes no activations, "
            "steering or scoring of given text through interlens. For the log-probability of each token it "
            "generates, pass record_tokens=True (message.tokens; providers that report them: "
            f"{', '.join(p for p in PROVIDERS if provider_named(p).token_logprobs)}). Score text with a "
            "local participant (AutoModelParticipant.from_pretrained(...)) and conv.logprobs()."
        )
    return InterpModeError(
        f"APIParticipant({name!r}) cannot do interp ({setting}=): a hosted model exposes no activations, "
        "steering or logprobs through interlens. Use a local participant "
        "(AutoModelParticipant.from_pretrained(...), with batched=False in rollouts) for interp, and run "
        "hosted turns outside a conv.capture() block."
    )


def _no_logprobs(provider: str) -> str:
    return f"{provider_named(provider).title} reports no token log-probabilities"


def _check_for_provider(name: str, provider: str, settings: APISettings) -> None:
    """Refuse what ``provider`` cannot take of ``settings`` (what no provider can take is the record's own
    :meth:`APISettings.check`)."""
    who = f"APIParticipant({name!r}, provider={provider!r})"
    if settings.record_tokens and not provider_named(provider).token_logprobs:
        reporting = " or ".join(f"{p!r}" for p in PROVIDERS if provider_named(p).token_logprobs)
        raise ConfigurationError(
            f"{who}: record_tokens=True cannot work: {_no_logprobs(provider)}, "
            f"so every turn would keep none. Hosted turns record their tokens with provider={reporting} (an "
            "OpenAI-compatible server such as vLLM included); local models record theirs "
            "(AutoModelParticipant.from_pretrained(..., record_tokens=True))"
        )
    problem = provider_named(provider).settings_problem(settings)
    if problem is not None:
        raise ConfigurationError(f"{who}: {problem}")


class APIParticipant(Participant):
    """A hosted chat model. Keys and endpoints come from the environment (see below), at first use.

    ``provider``: "openai" | "anthropic" | "openrouter". ``model_id``: the provider's model name.
    ``max_tokens`` (default 1024) is the output cap per turn, lowered per turn by a TokenBudget.
    ``temperature``/``top_p``/``stop``: sent when set, else the provider's defaults. These, ``timeout``,
    ``prompt_cache`` and ``record_tokens`` are held as one record, ``settings`` (an :class:`APISettings`,
    checked and written by itself), which every request carries whole. ``batch=True`` (openai,
    anthropic) routes each round through the provider's batch API (about half the price, minutes to hours
    of latency).

    Credentials: ``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``, ``OPENROUTER_API_KEY``; endpoints
    ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``, ``OPENROUTER_BASE_URL`` unless ``base_url=`` is given. A
    recipe builds offline; a missing key fails the first turn with an error naming the variable. Keys never
    reach a pickle, the ledger, a checkpoint or a log line.

    OpenAI-compatible servers (vLLM, SGLang, llama.cpp): ``provider="openai", base_url="http://host:8000/v1"``.
    ``auth``: None (default) sends the key when ``OPENAI_API_KEY`` is set; when it is not, an endpoint on a
    local or private host (localhost, 127.0.0.0/8, ::1, 10/8, 172.16/12, 192.168/16) is called without
    one, and any other endpoint is refused for want of a key. ``auth=False`` never sends a key (a server
    elsewhere without auth; provider "openai" only); ``auth=True`` always requires one.

    Prompt caching (``prompt_cache``, default True): a multi-turn conversation resends its growing history,
    and the provider's cache makes the repeated prefix cost a fraction. Anthropic caches only where asked:
    the system block and the last message get cache breakpoints (writes cost 25% over the input price,
    reads 10% of it, so a speaker's second turn already repays the first; False for one-turn rollouts).
    OpenAI caches long prefixes by itself, for free: the body keeps the history as a stable prefix (system
    first, then the messages as they were), nothing is sent. Cache reads and writes are in the turn's usage.

    Token records (``record_tokens=True``; openai and openrouter): each request asks for ``logprobs`` and the
    turn keeps its tokens' texts and log-probabilities as the provider reported them (``message.tokens``,
    ``reported_by`` the provider); an answer that came without them says so in ``metadata["tokens_missing"]``.
    Anthropic reports none: refused. docs/rollouts.md says which distribution the values come from.

    Scheduling: ``max_in_flight`` (default 64) bounds concurrent requests per (provider, endpoint, limit),
    shared by every participant with the same three; ``timeout`` (120 s) per request; ``retry`` a
    :class:`RetryPolicy` (429/5xx/timeouts, honouring retry-after); ``batch_policy`` a :class:`BatchPolicy`.
    """

    kind = "api"
    needs_device = False

    def __init__(
        self,
        *,
        name: str,
        provider: str,
        model_id: str,
        system_prompt: Template = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: Sequence[str] | str = (),
        batch: bool = False,
        base_url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        retry: RetryPolicy | None = None,
        batch_policy: BatchPolicy | None = None,
        auth: bool | None = None,
        prompt_cache: bool = True,
        record_tokens: bool = False,
        **unsupported: Any,
    ) -> None:
        super().__init__(name=name, system_prompt=system_prompt)
        who = f"APIParticipant({name!r})"
        for setting in unsupported:
            if setting in _INTERP_SETTINGS:
                raise _interp_error(name, setting)
        if unsupported:
            raise ConfigurationError(
                f"{who} has no setting(s) {sorted(unsupported)}; its settings are: {', '.join(_SETTINGS)}"
            )
        if provider not in PROVIDERS:
            raise ConfigurationError(
                f"{name}: provider must be one of {', '.join(PROVIDERS)}, got {provider!r}"
            )
        settings = APISettings(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stop=cast(tuple[str, ...], stop),  # one string or a list: the record makes it a tuple
            timeout=timeout,
            prompt_cache=prompt_cache,
            record_tokens=record_tokens,
        )
        settings.check(who)
        _check_for_provider(name, provider, settings)
        if not isinstance(model_id, str) or not model_id.strip():
            raise ConfigurationError(f"{name}: model_id must be the provider's model name, got {model_id!r}")
        if not isinstance(batch, bool):
            raise ConfigurationError(f"{name}: batch must be True or False, got {batch!r}")
        if batch and not provider_named(provider).batch:
            batching = "/".join(p for p in PROVIDERS if provider_named(p).batch)
            raise ConfigurationError(
                f"{name}: {provider_named(provider).title} has no batch API, so batch=True cannot work "
                f"with provider={provider!r} (interlens never falls back to serial calls silently). Use "
                f"batch=False, or {batching}."
            )
        if base_url is not None and not (
            isinstance(base_url, str) and base_url.startswith(("http://", "https://"))
        ):
            raise ConfigurationError(f"{name}: base_url must be an http(s) URL or None, got {base_url!r}")
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ConfigurationError(f"{name}: max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigurationError(f"{name}: retry must be a RetryPolicy, got {type(retry).__name__}")
        if batch_policy is not None and not isinstance(batch_policy, BatchPolicy):
            raise ConfigurationError(
                f"{name}: batch_policy must be a BatchPolicy, got {type(batch_policy).__name__}"
            )
        if auth is not None and not isinstance(auth, bool):
            raise ConfigurationError(
                f"{name}: auth must be None (a key when one is set; none needed by a local server), True or "
                f"False, got {auth!r}"
            )
        if auth is False and not provider_named(provider).keyless_local:
            keyless = " or ".join(f"provider={p!r}" for p in PROVIDERS if provider_named(p).keyless_local)
            raise ConfigurationError(
                f"{name}: auth=False is for OpenAI-compatible servers without a key ({keyless} with "
                f"their base_url); {provider_named(provider).title} always needs a key"
            )
        self.settings = settings
        self.auth = auth
        self.provider = provider
        self.model_id = model_id
        self.batch = batch
        self.base_url = base_url
        self.max_in_flight = max_in_flight
        self.retry_policy = retry or RetryPolicy()
        self.batch_policy = batch_policy or BatchPolicy()

    # ---------------------------------------------------------------- the gateway's APISpec
    @property
    def client_key(self) -> Hashable:
        url = resolve_base_url(self.provider, self.base_url)
        return ("api", self.provider, url, self.max_in_flight, self.auth)

    @property
    def batch_key(self) -> Hashable | None:
        if not self.batch:
            return None
        return (self.client_key, self.model_id, self.settings, self.batch_policy)

    def open_client(self) -> ProviderClient:
        """The provider's client for the gateway; reads the key from the environment (parent, first use)."""
        return open_client(
            self.provider,
            base_url=self.base_url,
            max_in_flight=self.max_in_flight,
            who=f"APIParticipant({self.name!r})",
            auth=self.auth,
        )

    # ---------------------------------------------------------------- generation
    def request(self, view: View, options: GenerationOptions) -> APIRequest:
        """The provider request for ``view``: the output cap lowered to the turn's budget, the turn index."""
        cap = self.settings.max_tokens
        if options.max_new_tokens is not None:
            cap = min(cap, options.max_new_tokens)
        turn = None if options.ephemeral else sum(1 for m in view.messages if m.author != MODERATOR)
        # the turn's own seed (as a local turn's: the same on a rerun, another per job and turn), in the 31
        # bits every OpenAI-compatible server takes
        seed = self.recorded_seed(options.seed) if options.seed is not None else None
        return APIRequest(
            provider=self.provider,
            model=self.model_id,
            system=view.system,
            messages=fold_view(view, self.provider),
            settings=self.settings.for_request(max_tokens=cap, seed=seed),
            turn=turn,
        )

    async def agenerate(self, view: View, options: GenerationOptions | None = None) -> Message:
        options = options or GenerationOptions()
        for setting in _INTERP_SETTINGS:
            if getattr(options, setting, None):
                raise _interp_error(self.name, setting)
        request = self.request(view, options)
        if request.settings.max_tokens <= 0:  # a spent budget: an empty turn, no request sent
            return Message(
                self.name,
                "",
                {"n_tokens": 0, "finish_reason": "length", "provider": self.provider, "model": self.model_id},
            )
        job = CURRENT_JOB.get()
        hook = getattr(job, "call_gateway", None) if job is not None else None
        start = time.perf_counter()
        try:
            if hook is not None:
                result = await hook(self, request)
            else:
                from ._api_loop import loop_gateway

                gateway = await loop_gateway()
                result = await gateway.call(self, request, owner=getattr(job, "job_id", None))
            if isinstance(result, BaseException):
                raise result
        except (ProviderCallError, BatchRowError) as exc:
            hint = self._refused_without_key(exc) or self._refused_logprobs(exc) or self._no_answer(exc)
            said = str(exc).rstrip(".") if hint else str(exc)
            raise GenerationError(
                f"{self.name} ({self.provider} model {self.model_id!r}): {said}{hint}"
            ) from exc
        return self.message(result, time.perf_counter() - start, seed=request.settings.seed)

    def _refused_without_key(self, exc: BaseException) -> str:
        """The fix, when an endpoint refused a request that carried no key (401/403): a local or private
        server reached keyless because the key variable is unset, or ``auth=False``."""
        if getattr(exc, "status", None) not in (401, 403):
            return ""
        variable = provider_named(self.provider).key_variable
        if self.auth is False:
            return (
                f". No key was sent (auth=False) and the server wants one: drop auth=False and set {variable}"
            )
        if self.auth is None and not os.environ.get(variable):
            return (
                f". No key was sent ({variable} is not set, so this local endpoint was called without one) "
                f"and the server wants one: set {variable} to the server's key"
            )
        return ""

    def _no_answer(self, exc: BaseException) -> str:
        """Where it called, when no answer came at all (a server down, a wrong host or port, a firewall):
        every job fails the same way, and the URL is what to check."""
        if not isinstance(exc, ProviderCallError) or exc.status is not None:
            return ""
        variable = provider_named(self.provider).url_variable
        return (
            f". No answer came from {resolve_base_url(self.provider, self.base_url)}: check that the server "
            f"is up and that the URL is right (base_url=, or the {variable} variable)"
        )

    def _refused_logprobs(self, exc: BaseException) -> str:
        """The fix, when a request that asked for log-probabilities (``record_tokens``) was refused for
        them: OpenAI's reasoning models and some servers answer 400 naming logprobs; OpenRouter answers 404
        when no host of the model honours every parameter sent."""
        text = str(exc).lower()
        refused = getattr(exc, "status", None) in (400, 404, 422) and (
            "logprob" in text or "requested parameters" in text
        )
        if not (self.settings.record_tokens and refused):
            return ""
        return (
            ". The request asked for each token's log-probability (record_tokens=True), which this model or "
            "server refuses: set record_tokens=False for this participant, or use a model that reports them"
        )

    def recorded_seed(self, seed: int) -> int | None:
        """The request's ``seed`` field: the turn's seed in 31 bits, where the provider takes one."""
        return seed & _SEED_MASK if provider_named(self.provider).accepts_seed else None

    def message(self, result: APIResult, seconds: float, *, seed: int | None = None) -> Message:
        """The turn, with what the provider reported about it (usage, finish reason, ids) as metadata.

        ``metadata["usage"]`` is what the turn cost, from the provider's usage fields (never re-tokenized):
        provider, model, ``mode`` ("live" or "batch"), input tokens (all of them, cached or not), output,
        cache-read and cache-write tokens. It is stored with the turn, so the ledger is the account.
        """
        n_tokens = result.output_tokens if result.output_tokens is not None else count_tokens(result.text)
        metadata: dict[str, Any] = {
            "n_tokens": n_tokens,
            "prompt_tokens": result.prompt_tokens,
            "finish_reason": result.finish_reason,
            "provider": self.provider,
            "model": self.model_id,
            "seconds": round(seconds, 6),
            "at": time.time(),
        }
        metadata["usage"] = {
            "provider": self.provider,
            "model": self.model_id,
            "mode": "batch" if result.batch_id else "live",
            "input_tokens": result.prompt_tokens or 0,
            "output_tokens": result.output_tokens if result.output_tokens is not None else n_tokens,
            "cache_read_tokens": result.cache_read_tokens,
            "cache_write_tokens": result.cache_write_tokens,
        }
        if result.model and result.model != self.model_id:
            metadata["provider_model"] = result.model
        if result.request_id:
            metadata["request_id"] = result.request_id
        if result.batch_id:
            metadata["batch_id"] = result.batch_id
        if seed is not None:
            metadata["seed"] = seed  # what the request carried
        if self.settings.record_tokens:
            self._record_tokens(result, metadata)
        return Message(self.name, result.text, metadata)

    def _record_tokens(self, result: APIResult, metadata: dict[str, Any]) -> None:
        """The turn's token record from the answer's log-probabilities; an answer without them (a server that
        ignores the field, a model whose host gives none) keeps its text, paid for, and says why it has no
        record (``metadata["tokens_missing"]``), warned once per participant and process."""
        if result.token_logprobs is not None:
            texts = [token for token, _ in result.token_logprobs]
            values = [value for _, value in result.token_logprobs]
            metadata[TOKENS_KEY] = TokenRecord.reported(self.provider, texts, values).to_json()
            return
        where = self.base_url or provider_named(self.provider).title
        metadata["tokens_missing"] = (
            f"asked for log-probabilities (record_tokens=True), {where} answered without them"
        )
        if self.name not in _WARNED_MISSING:
            _WARNED_MISSING.add(self.name)
            log.warning(
                "%s (%s model %r): %s, so its turns keep no token record (message.tokens is None; "
                "metadata['tokens_missing'] says so). A server that ignores logprobs (transformers serve) "
                "never gives them: use one that does (vLLM, SGLang, OpenAI) or record_tokens=False.",
                self.name,
                self.provider,
                self.model_id,
                metadata["tokens_missing"],
            )

    # ---------------------------------------------------------------- JSON / pickling
    def to_json(self) -> dict[str, Any]:
        from .._core import template_to_json

        settings = self.settings.to_json() | {
            "batch": self.batch,
            "base_url": self.base_url,
            "max_in_flight": self.max_in_flight,
            "retry": dataclasses.asdict(self.retry_policy),
            "batch_policy": dataclasses.asdict(self.batch_policy),
            "auth": self.auth,
        }
        return {
            "kind": self.kind,
            "name": self.name,
            "provider": self.provider,
            "model_id": self.model_id,
            "system_prompt": template_to_json(self.system_prompt, field=f"{self.name}.system_prompt"),
            **{key: settings[key] for key in _RECIPE_ORDER},
            **settings,  # a setting added since, when set (APISettings.to_json): after them
        }

    def token_record_problem(self) -> str | None:
        return None if provider_named(self.provider).token_logprobs else _no_logprobs(self.provider)

    def describe(self) -> dict[str, Any]:
        """What shapes the outputs, not how they are fetched (endpoint, batching, limits, retries)."""
        from .._core import describe_template

        return {
            "kind": self.kind,
            "name": self.name,
            "provider": self.provider,
            "model_id": self.model_id,
            "system_prompt": describe_template(self.system_prompt),
            **self.settings.describe(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> APIParticipant:
        settings = {
            k: v for k, v in data.items() if k not in ("kind", "system_prompt", "retry", "batch_policy")
        }
        retry = data.get("retry")
        policy = data.get("batch_policy")
        return cls(
            system_prompt=template_from_json(data.get("system_prompt")),
            retry=RetryPolicy(**retry) if retry else None,
            batch_policy=BatchPolicy(**policy) if policy else None,
            **settings,
        )

    def replace(self, **changes: Any) -> APIParticipant:
        """A copy with some settings changed: those of :class:`APISettings` go into a new record, checked
        like the constructor's (``run(record_tokens=True)`` sets one); the others as the base class does."""
        settings = {key: changes.pop(key) for key in list(changes) if key in APISettings.names()}
        clone = super().replace(**changes)
        assert isinstance(clone, APIParticipant)
        if settings:
            clone.settings = dataclasses.replace(self.settings, **settings)
            clone.settings.check(f"APIParticipant({self.name!r})")
            _check_for_provider(self.name, self.provider, clone.settings)
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)  # settings only: the key lives in the parent's environment and SDK client

    def __repr__(self) -> str:
        batch = ", batch=True" if self.batch else ""
        settings = f"name={self.name!r}, provider={self.provider!r}, model_id={self.model_id!r}{batch}"
        return f"APIParticipant({settings})"


#: The constructor's settings, in its order (what an unknown setting's error lists).
_SETTINGS = tuple(
    name
    for name, parameter in inspect.signature(APIParticipant.__init__).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "name"
)

#: The order a participant's recipe JSON has always had its settings in: saved recipes, and the recipes a
#: ledger stores once per lineup, stay byte-identical. A setting added to APISettings since goes after them.
_RECIPE_ORDER = (
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "batch",
    "base_url",
    "timeout",
    "max_in_flight",
    "retry",
    "batch_policy",
    "auth",
    "prompt_cache",
)

register_participant_kind(APIParticipant.kind, APIParticipant.from_json)
