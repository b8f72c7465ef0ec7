"""``APIBudget``: a run that cannot overspend on hosted APIs.

``rollout(..., api_budget=APIBudget(tokens=..., usd=..., prices=...))``, or ambiently
``with APIBudget(...):`` around the calls (like ``TokenBudget``). The run's gateway asks the guard built
here before it sends each request (once the in-flight limiter lets it through) and before it submits each
provider batch:

- a single request goes out while the spend is below the budget, so a run stops after about the budget's
  worth of requests: never more than that plus the requests already in flight, which finish and are
  recorded;
- a provider batch goes out only when the spend, the batches in flight and this batch's bound together stay
  within the budget (a batch is paid for whole). The bound is deliberately high: every byte of the prompt
  counts as a token, plus ``max_tokens`` of output, so a batch that could cross the budget is not submitted.

Once one request or batch is refused the run starts no new job; a job whose request was refused goes back
to pending (not failed, its committed turns kept) and the run ends with a warning saying what was spent and
how to continue. The spend counts what the ledger already recorded (every turn's ``metadata["usage"]``,
earlier runs of the same ``out_dir`` included), so a rerun with the same budget sends nothing and one with a
larger budget resumes exactly there. An analyzer's ``conv.sample`` calls count too: the gateway charges them
as they go, and their usage is stored with the job's result for later runs, the samples of an analyzer that
failed and was rerun included (the ledger keeps a replaced result's state). Not counted: answers lost before
their turn or result was recorded (a crash in between).

``tokens`` counts input (cached or not) plus output tokens as the providers report them; ``usd`` needs a
price for every API model of the run (``prices`` as in ``RunReport.usage``; batch turns at the discount
their provider documents).
"""

from __future__ import annotations

import contextvars
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._core import ConfigurationError
from ..report import check_prices, recorded_metadata, turn_cost

__all__ = ["APIBudget", "ambient_budget", "estimate_tokens"]

_AMBIENT: contextvars.ContextVar[APIBudget | None] = contextvars.ContextVar(
    "interlens_api_budget", default=None
)

_TOKENS_PER_MESSAGE = 8  # role and framing tokens a provider adds around each message (a generous bound)


def ambient_budget() -> APIBudget | None:
    """The budget of the innermost ``with APIBudget(...):`` block, if any."""
    return _AMBIENT.get()


def estimate_tokens(request: Any) -> tuple[int, int]:
    """An upper bound on (input, output) tokens of one request: a token is at least one byte of its text."""
    texts = [request.system or ""] + [content for _, content in request.messages]
    prompt = sum(len(t.encode()) for t in texts) + _TOKENS_PER_MESSAGE * len(texts)
    return prompt, int(request.settings.max_tokens)


class APIBudget:
    """The most a run (and its reruns on the same ``out_dir``) may spend on hosted APIs.

    ``tokens``: input plus output tokens; ``usd``: dollars, estimated from ``prices`` (``{"model-id":
    (usd_per_mtok_in, usd_per_mtok_out[, cache_read, cache_write])}``, required for every API model of the
    run when ``usd`` is set). Give one or both. See the module docstring for what is guaranteed.
    """

    def __init__(
        self,
        *,
        tokens: int | None = None,
        usd: float | None = None,
        prices: Mapping[str, tuple[float, ...]] | None = None,
    ) -> None:
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
            raise ConfigurationError(f"APIBudget(tokens=...) must be an int >= 0 or None, got {tokens!r}")
        usd_ok = (
            isinstance(usd, int | float) and not isinstance(usd, bool) and math.isfinite(usd) and usd >= 0
        )
        if usd is not None and not usd_ok:
            raise ConfigurationError(
                f"APIBudget(usd=...) must be a number of dollars >= 0 or None, got {usd!r}"
            )
        if tokens is None and usd is None:
            raise ConfigurationError(
                "APIBudget needs tokens=, usd= or both, e.g. APIBudget(usd=20.0, prices=...)"
            )
        self.tokens = tokens
        self.usd = None if usd is None else float(usd)
        self.prices = check_prices(prices, where="APIBudget")
        self._tokens: list[contextvars.Token[APIBudget | None]] = []

    def __enter__(self) -> APIBudget:
        self._tokens.append(_AMBIENT.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _AMBIENT.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"APIBudget(tokens={self.tokens!r}, usd={self.usd!r})"

    def check_models(self, models: Iterable[str], *, where: str) -> None:
        """With ``usd``, every API model needs a price: refuse the run before it starts otherwise."""
        if self.usd is None:
            return
        missing = sorted(set(models) - set(self.prices))
        if missing:
            raise ConfigurationError(
                f"{where}: api_budget=APIBudget(usd={self.usd}) needs a price for every API model, and "
                f"{missing[0]!r} has none: pass prices={{{missing[0]!r}: (usd_per_mtok_in, "
                "usd_per_mtok_out)} (or a tokens= budget)"
            )

    def guard(self, out_dir: str | os.PathLike[str] | None, *, resume: bool) -> Spend:
        """The run's spend guard, counting what the ledger in ``out_dir`` already recorded (when resuming)."""
        spend = Spend(self)
        if out_dir is not None and resume:
            from interlens.store import LedgerNotFoundError, LedgerReader

            try:
                reader = LedgerReader(out_dir)
            except LedgerNotFoundError:
                return spend
            with reader:
                for meta in recorded_metadata(reader):  # turns and analyzers' samples
                    usage = meta.get("usage")
                    if isinstance(usage, Mapping):
                        spend.add(usage)
        return spend


class Spend:
    """What a run has spent against its :class:`APIBudget`: the gateway's ``SpendGuard``."""

    def __init__(self, budget: APIBudget) -> None:
        self.budget = budget
        self.tokens = 0
        self.usd = 0.0
        self.reserved_tokens = 0
        self.reserved_usd = 0.0
        self._halted = False

    @property
    def halted(self) -> bool:
        return self._halted

    def add(self, usage: Mapping[str, Any]) -> None:
        """Count one turn's recorded usage."""
        for name in ("input_tokens", "output_tokens"):
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                self.tokens += value
        self.usd += turn_cost(usage, self.budget.prices) or 0.0

    def _reached(self, tokens: int, usd: float) -> bool:
        b = self.budget
        return (b.tokens is not None and tokens > b.tokens) or (b.usd is not None and usd > b.usd)

    def admit(self, requests: Sequence[Any], *, batch: bool) -> tuple[int, float] | None:
        if not batch:  # sent while the spend (and what batches in flight may cost) is below the budget
            b, tokens, usd = self.budget, self.tokens + self.reserved_tokens, self.usd + self.reserved_usd
            if (b.tokens is not None and tokens >= b.tokens) or (b.usd is not None and usd >= b.usd):
                self._halted = True
                return None
            return (0, 0.0)
        tokens, usd = 0, 0.0
        for request in requests:
            prompt, output = estimate_tokens(request)
            tokens += prompt + output
            usd += self._usd(request, prompt, output)
        if self._reached(self.tokens + self.reserved_tokens + tokens, self.usd + self.reserved_usd + usd):
            self._halted = True
            return None
        self.reserved_tokens += tokens
        self.reserved_usd += usd
        return (tokens, usd)

    def _usd(self, request: Any, prompt: int, output: int) -> float:
        usage = {"provider": request.provider, "model": request.model, "mode": "batch"}
        return (
            turn_cost({**usage, "input_tokens": prompt, "output_tokens": output}, self.budget.prices) or 0.0
        )

    def release(self, ticket: tuple[int, float]) -> None:
        self.reserved_tokens -= ticket[0]
        self.reserved_usd -= ticket[1]

    def charge(self, request: Any, result: Any, *, batch: bool) -> None:
        self.add(
            {
                "provider": request.provider,
                "model": request.model,
                "mode": "batch" if batch else "live",
                "input_tokens": result.prompt_tokens or 0,
                "output_tokens": result.output_tokens or 0,
                "cache_read_tokens": result.cache_read_tokens,
                "cache_write_tokens": result.cache_write_tokens,
            }
        )

    def refusal(self) -> str:
        b = self.budget
        parts = []
        if b.tokens is not None:
            parts.append(f"{self.tokens:,} of {b.tokens:,} tokens")
        if b.usd is not None:
            parts.append(f"${self.usd:,.4f} of ${b.usd:,.2f}")
        return (
            f"the API budget is reached: spent {' and '.join(parts)} (counting what the ledger recorded). No "
            "further API request or batch was sent; unfinished jobs stay pending. To continue, run the same "
            "call on the same out_dir with a larger api_budget=APIBudget(...): it resumes where this stopped"
        )
