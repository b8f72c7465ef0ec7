"""What a run spent: API usage per provider and model (live vs batch), local tokens per model, and a cost
estimate from the prices the user passes.

Every API turn carries its usage in ``metadata["usage"]`` (``APIParticipant.message``: the provider's own
counts, never re-tokenized), and every turn is stored in the ledger as it ends, so the ledger is the account:
the totals here are read from it (every stored message, whichever job, state or run it belongs to, earlier
runs of the same ``out_dir`` included), and so is what a spend guard
(:mod:`interlens.rollouts._api_budget`) counts as already spent when a run resumes. Without an ``out_dir``
the totals come from the results held in memory.
An analyzer's ``conv.sample`` calls are no turns: their metadata is kept with the job's result (under
:data:`SAMPLES_KEY` of its conversation state) and counted with the turns (:func:`recorded_metadata`). When
the analyzer fails, the job's conversation is kept with its samples; a rerun's result replaces it, and the
ledger keeps the replaced state, which ``LedgerReader.result_values`` still reads: every attempt's samples
were paid for, and every one is counted.

There is no price table (one would go stale): a cost is estimated only for models whose prices are passed,
``prices={"model-id": (usd_per_mtok_in, usd_per_mtok_out)}``, optionally with cache-read and cache-write
prices as a third and fourth entry (without them cached tokens are priced as input). Batch turns get the
discount their provider documents (``Provider.batch_price``: OpenAI and Anthropic batches cost half).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from .._core import REPLAYED_KEY, TOKENS_KEY, ConfigurationError, ConfigurationTypeError

__all__ = [
    "SAMPLES_KEY",
    "APIUsage",
    "LocalUsage",
    "Prices",
    "UsageReport",
    "check_prices",
    "conversation_metadata",
    "recorded_metadata",
    "summarize",
    "turn_cost",
]

#: The key of a result's conversation state holding the metadata of its analyzer's samples (``_rollout``).
SAMPLES_KEY: Final = "sample_metadata"


def recorded_metadata(reader: Any) -> Iterator[Mapping[str, Any]]:
    """The metadata of every message a ledger (a ``LedgerReader``) holds: turns, then analyzers' samples. A
    branch's recorded turns (``REPLAYED_KEY``) were spent by its parent's run, and are not counted again."""
    for meta in reader.turn_values("$.metadata", without=(f"$.{TOKENS_KEY}",)):  # no total needs a record
        if not (isinstance(meta, Mapping) and REPLAYED_KEY in meta):
            yield meta
    for samples in reader.result_values(f"$.{SAMPLES_KEY}"):
        yield from (meta for meta in samples if isinstance(meta, Mapping))


def conversation_metadata(conversation: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The same for one finished job's conversation state held in memory."""
    for message in conversation.get("transcript", []):
        if isinstance(message, Mapping) and REPLAYED_KEY not in (message.get("metadata") or {}):
            yield message.get("metadata") or {}
    yield from (meta for meta in conversation.get(SAMPLES_KEY, []) if isinstance(meta, Mapping))


Prices = Mapping[str, tuple[float, ...]]
"""model id -> (usd per million input tokens, per million output tokens[, cache read[, cache write]])."""

_USAGE_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


@dataclass
class APIUsage:
    """API totals of one (provider, model, mode): ``mode`` is "live" or "batch"; ``usd`` is None unpriced."""

    provider: str
    model: str
    mode: str
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    usd: float | None = None

    @property
    def tokens(self) -> int:
        """Input (cached or not) plus output tokens: what a token budget counts."""
        return self.input_tokens + self.output_tokens


@dataclass
class LocalUsage:
    """Tokens of one local model (in-process), generated and read as prompts."""

    model: str
    turns: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class UsageReport:
    """``RunReport.usage()``: ``api`` rows per (provider, model, mode), ``local`` rows per model, and ``usd``
    (the estimate over the priced rows; None when no price was passed) with ``unpriced`` model ids."""

    api: list[APIUsage] = field(default_factory=list)
    local: list[LocalUsage] = field(default_factory=list)
    usd: float | None = None
    unpriced: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        """API requests and tokens over every provider, model and mode."""
        out = {"requests": sum(u.requests for u in self.api)}
        for name in _USAGE_FIELDS:
            out[name] = sum(getattr(u, name) for u in self.api)
        return out

    def __str__(self) -> str:
        lines = []
        for u in self.api:
            cost = "" if u.usd is None else f"  ${u.usd:,.4f}"
            lines.append(
                f"{u.provider}/{u.model} ({u.mode}): {u.requests} requests, {u.input_tokens:,} in "
                f"({u.cache_read_tokens:,} cache read, {u.cache_write_tokens:,} cache write), "
                f"{u.output_tokens:,} out{cost}"
            )
        for loc in self.local:
            lines.append(f"local {loc.model}: {loc.turns} turns, {loc.output_tokens:,} tokens generated")
        if self.usd is not None:
            unpriced = f" (unpriced: {', '.join(self.unpriced)})" if self.unpriced else ""
            lines.append(f"estimated cost: ${self.usd:,.4f}{unpriced}")
        return "\n".join(lines) or "no turns recorded"


def check_prices(prices: Any, *, where: str) -> dict[str, tuple[float, float, float, float]]:
    """``prices`` checked, completed to (in, out, cache read, cache write) per model; or raise naming it."""
    if prices is None:
        return {}
    if not isinstance(prices, Mapping):
        raise ConfigurationTypeError(
            f"{where}: prices must be a dict {{model_id: (usd_per_mtok_in, usd_per_mtok_out)}}, got "
            f"{type(prices).__name__}"
        )
    out = {}
    for model, entry in prices.items():
        ok = isinstance(model, str) and isinstance(entry, tuple | list) and len(entry) in (2, 3, 4)
        numbers = ok and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in entry
        )
        if not numbers:
            raise ConfigurationError(
                f"{where}: prices[{model!r}] must be (usd_per_mtok_in, usd_per_mtok_out) with an optional "
                f"cache-read and cache-write price, numbers >= 0, got {entry!r}; e.g. prices={{'gpt-5': "
                "(1.25, 10.0)}"
            )
        usd_in, usd_out, *cache = (float(v) for v in entry)
        read = cache[0] if cache else usd_in
        write = cache[1] if len(cache) > 1 else usd_in
        out[model] = (usd_in, usd_out, read, write)
    return out


def turn_cost(
    usage: Mapping[str, Any], prices: Mapping[str, tuple[float, float, float, float]]
) -> float | None:
    """USD of one API turn's usage, or None when its model has no price."""
    from ..providers import PROVIDERS, provider

    price = prices.get(str(usage.get("model")))
    if price is None:
        return None
    usd_in, usd_out, usd_read, usd_write = price
    read, write = _count(usage.get("cache_read_tokens")), _count(usage.get("cache_write_tokens"))
    fresh = max(_count(usage.get("input_tokens")) - read - write, 0)
    usd = (
        fresh * usd_in + read * usd_read + write * usd_write + _count(usage.get("output_tokens")) * usd_out
    ) / 1e6
    name = usage.get("provider")
    if usage.get("mode") == "batch" and name in PROVIDERS:
        usd *= provider(str(name)).batch_price
    return usd


def summarize(
    metadata: Iterable[Mapping[str, Any]], prices: Any = None, *, where: str = "usage()"
) -> UsageReport:
    """Totals over turns' metadata: API turns by their ``usage``, local turns (``model``, no ``provider``)."""
    checked = check_prices(prices, where=where)
    api: dict[tuple[str, str, str], APIUsage] = {}
    local: dict[str, LocalUsage] = {}
    for meta in metadata:
        if not isinstance(meta, Mapping):
            continue
        usage = meta.get("usage")
        if isinstance(usage, Mapping):
            key = (str(usage.get("provider")), str(usage.get("model")), str(usage.get("mode", "live")))
            row = api.get(key)
            if row is None:
                row = api[key] = APIUsage(*key)
            row.requests += 1
            for name in _USAGE_FIELDS:
                setattr(row, name, getattr(row, name) + _count(usage.get(name)))
            cost = turn_cost(usage, checked)
            if cost is not None:
                row.usd = (row.usd or 0.0) + cost
        elif "model" in meta and "provider" not in meta:
            model = str(meta["model"])
            entry = local.get(model)
            if entry is None:
                entry = local[model] = LocalUsage(model)
            entry.turns += 1
            entry.output_tokens += _count(meta.get("n_tokens"))
            entry.prompt_tokens += _count(meta.get("prompt_tokens"))
    rows = sorted(api.values(), key=lambda u: (u.provider, u.model, u.mode))
    report = UsageReport(api=rows, local=sorted(local.values(), key=lambda u: u.model))
    if checked:
        report.usd = sum(u.usd for u in rows if u.usd is not None)
        report.unpriced = sorted({u.model for u in rows if u.usd is None})
    return report


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
