"""``RunReport`` and ``RunResult``: what a rollout hands back.

With an ``out_dir`` every per-job read goes to the ledger on demand, so a report over a million jobs holds no
million conversations in memory; without one, the results live in memory.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core import BranchError, ConfigurationError, Transcript
from . import _export
from ._usage import UsageReport, conversation_metadata, recorded_metadata, summarize

if TYPE_CHECKING:
    import datasets
    import pandas

    from interlens.scheduler import ErrorInfo, JobOutcome, RunOutcome
    from interlens.store import LedgerReader

    from ..conversation import Conversation

__all__ = ["RunReport", "RunResult"]


@dataclass(frozen=True, repr=False)
class RunResult:
    """One job's result: its finished conversation (``None`` if it failed before finishing) and facts.

    It wraps the scheduler's :class:`~interlens.scheduler.JobOutcome` (one record per job, never copied
    field by field) and adds what only ``interlens`` knows: the live ``conversation`` and the ``transcript``.
    """

    _outcome: JobOutcome
    _recipe: Conversation | None
    _out_dir: Path | None = None  # the ledger a message's token record is read from (issue 40)

    @property
    def job_id(self) -> str:
        return self._outcome.job_id

    @property
    def error(self) -> ErrorInfo | None:
        """``None`` when the job succeeded."""
        return self._outcome.error

    @property
    def analysis(self) -> Any:
        return self._outcome.analysis

    @property
    def device(self) -> str | None:
        return self._outcome.device

    @property
    def tokens_generated(self) -> int:
        return self._outcome.tokens_generated

    @property
    def attempts(self) -> int:
        return self._outcome.attempts

    @property
    def skipped(self) -> bool:
        """Done by an earlier run of the same out_dir, loaded from its ledger."""
        return self._outcome.skipped

    @property
    def row_index(self) -> int | None:
        return self._outcome.row_index

    @property
    def seed(self) -> int:
        return self._outcome.seed

    @property
    def _state(self) -> Mapping[str, Any] | None:
        return self._outcome.conversation

    @functools.cached_property
    def conversation(self) -> Conversation | None:
        """The finished conversation, live: ``sample()`` and ``run()`` work on it."""
        if self._state is None or self._recipe is None:
            return None
        conv = self._recipe.data(None).for_row(self._state.get("row"), index=self.row_index, seed=self.seed)
        conv = conv.with_state(self._state)
        self._attach(list(conv.transcript))
        return conv

    @property
    def transcript(self) -> Transcript | None:
        if self._state is None:
            return None
        transcript = Transcript.from_json(self._state.get("transcript", []))
        self._attach(list(transcript))
        return transcript

    def _attach(self, messages: list[Any]) -> None:
        """Messages whose token record is in the ledger's table read it when asked (``Message.tokens``)."""
        stored = self._state.get("transcript") if self._state is not None else None
        if self._out_dir is not None and isinstance(stored, list) and len(stored) == len(messages):
            from ._ledger_tokens import attach

            attach(messages, stored, out_dir=self._out_dir, job_id=self.job_id)

    def __repr__(self) -> str:
        status = "ok" if self.error is None else f"error={self.error.type}"
        return f"RunResult({self.job_id!r}, {status}, tokens={self.tokens_generated}, device={self.device!r})"


class _Results(Mapping[str, RunResult]):
    """``report.results``: job id → RunResult, read on demand."""

    def __init__(self, report: RunReport) -> None:
        self._report = report

    def __getitem__(self, job_id: str) -> RunResult:
        return self._report._result(self._report._outcome.outcome(job_id))

    def __iter__(self) -> Iterator[str]:
        return iter(self._report._outcome.job_ids)

    def __len__(self) -> int:
        return len(self._report._outcome.job_ids)

    def items(self) -> Iterator[tuple[str, RunResult]]:  # type: ignore[override]
        """One ledger read per job, streamed in job order."""
        for outcome in self._report._outcome.outcomes():
            yield outcome.job_id, self._report._result(outcome)

    def values(self) -> Iterator[RunResult]:  # type: ignore[override]
        for _, result in self.items():
            yield result


class RunReport:
    """Results of ``rollout``/``run``: ``.results``, ``.failed``, ``.skipped`` and bulk accessors."""

    def __init__(
        self,
        outcome: RunOutcome,
        lineups: Mapping[str, Conversation],
        *,
        unrebuilt: Mapping[str, Exception] | None = None,
    ) -> None:
        self._outcome = outcome
        self._lineups = dict(lineups)
        self._unrebuilt = dict(unrebuilt or {})  # RunReport.load: lineups whose recipe could not be rebuilt
        self.results: Mapping[str, RunResult] = _Results(self)

    @classmethod
    def load(
        cls,
        out_dir: str | os.PathLike[str] | LedgerReader,
        *,
        conversations: Mapping[str, Conversation] | Conversation | None = None,
    ) -> RunReport:
        """The report of every finished and failed job in the ledger of ``out_dir`` (or of a
        ``LedgerReader``'s), read on demand, as ``rollout``/``run`` would have returned it.

        Each lineup's recipe is rebuilt from what the ledger recorded, or taken from ``conversations``
        (``{lineup name: Conversation}``, or one Conversation for a one-lineup ledger: needed where the
        recipe holds what JSON cannot bring back, such as a closure analyzer). A given Conversation that is
        not the recipe that wrote the ledger is refused (:class:`BranchError`), naming the lineup.
        """
        from ._loaded import lineup_recipes, load_outcome

        path = Path(getattr(out_dir, "path", None) or out_dir)  # a LedgerReader: its file's directory
        directory = path.parent if path.is_file() else path
        outcome = load_outcome(directory)
        given = conversations
        if given is not None and not isinstance(given, Mapping):  # one Conversation: the only lineup's
            names = {outcome.outcome(job_id).lineup for job_id in outcome.job_ids}
            if len(names) > 1:
                raise ConfigurationError(
                    f"RunReport.load(conversations=conv): the ledger holds the lineups {sorted(names)}; pass "
                    "conversations={name: conv, ...}"
                )
            given = dict.fromkeys(names, given)
        lineups, unrebuilt = lineup_recipes(directory, given)
        return cls(outcome, lineups, unrebuilt=unrebuilt)

    def branch(
        self,
        at_turn: int | str,
        *,
        jobs: Sequence[str] | None = None,
        lineup: str | None = None,
        n: int = 1,
    ) -> Conversation:
        """Each selected job as a branch point: its data row, its seed and its first ``at_turn`` generated
        turns as recorded, on a copy of its lineup's recipe (``.set``, ``.turns``, ``.analyzer``... change
        it). ``rollout(n=...)`` or ``interlens.run([...])`` expands each point into ``n`` continuations
        (default the ``n`` given here); continuation ``s`` of job ``j`` draws from seed ``seed_j + s`` (its
        parent's own stream for ``s = 0``: in deterministic mode, nothing changed, it regenerates the
        recorded turns) unless ``seed=`` is passed. Job ids say where they come from
        (``row_00012@3/s0001``); each result records its parent (out_dir, job id, turn).

        ``jobs=None``: every finished job (of ``lineup``, for a report of several); ``at_turn="end"``: each
        job whole, so that a new ``.analyzer(...)`` measures what was recorded, generating nothing. A turn
        past a job's length, an unknown job or one that failed before the turn is refused
        (:class:`BranchError`) before anything runs. docs/rollouts.md, "Branching a run".
        """
        from ._branching import branch

        return branch(self, at_turn, jobs=jobs, lineup=lineup, n=n)

    # what ``branch`` reads of the report (``_branching``)
    @property
    def _lineup_names(self) -> list[str]:
        return sorted({*self._lineups, *self._unrebuilt})

    def _lineup_of(self, job_id: str) -> str:
        return self._outcome.outcome(job_id).lineup

    def _lineup_recipe(self, name: str) -> Conversation:
        if name in self._unrebuilt:
            raise self._unrebuilt[name]
        recipe = self._lineups.get(name)
        if recipe is None:
            raise BranchError(f"lineup {name!r}: this report holds no recipe for it")
        return recipe

    def _open_reader(self) -> LedgerReader | None:
        if self.out_dir is None:
            return None
        from interlens.store import LedgerReader

        return LedgerReader(self.out_dir)

    def _result(self, outcome: JobOutcome) -> RunResult:
        return RunResult(_outcome=outcome, _recipe=self._lineups.get(outcome.lineup), _out_dir=self.out_dir)

    @property
    def failed(self) -> list[str]:
        """Ids of jobs that failed (their ``RunResult.error`` says why)."""
        return self._outcome.failed

    @property
    def skipped(self) -> list[str]:
        """Ids of jobs found done in the ledger and not run again (their results are loaded)."""
        return self._outcome.skipped

    @property
    def out_dir(self) -> Path | None:
        path = self._outcome.ledger_path
        return path.parent if path is not None else None

    @property
    def counts(self) -> Mapping[str, int]:
        return self._outcome.counts

    @property
    def stopped(self) -> str | None:
        """Why the run ended before every job ran (its API budget was reached: what was spent and how to
        continue), else None; ``counts["pending"]`` is then how many jobs a rerun will finish."""
        return self._outcome.stopped

    @property
    def api_stats(self) -> Mapping[str, Any]:
        """How the run's API calls went: per provider client (``clients``) its in-flight limit, peak, lowest
        limit reached, rate-limited calls, retries, failures; ``batches_submitted``, ``rows_reattached``."""
        return self._outcome.api

    def usage(self, prices: Mapping[str, tuple[float, ...]] | None = None) -> UsageReport:
        """What the run spent: API requests and tokens (input, output, cache read, cache write) per provider,
        model and mode (live or batch), and local tokens per model, from the turns' recorded usage.

        With an ``out_dir``: every message the ledger holds (failed and pending jobs' turns, earlier runs of
        the same ``out_dir`` included: what a spend guard counts); without one: the results in memory.
        ``prices={"model-id": (usd_per_mtok_in, usd_per_mtok_out)}`` (optionally a cache-read and a
        cache-write price after them; otherwise cached tokens are priced as input) gives a cost estimate
        (``.usd``, per row and in total); batch turns get the discount their provider documents: OpenAI's
        and Anthropic's batch APIs cost half the live price. There is no built-in price table.
        """
        if self.out_dir is not None:
            from interlens.store import LedgerReader

            with LedgerReader(self.out_dir) as reader:
                return summarize(recorded_metadata(reader), prices, where="RunReport.usage()")
        metadata = (
            meta
            for outcome in self._outcome.outcomes()
            if outcome.conversation is not None
            for meta in conversation_metadata(outcome.conversation)
        )
        return summarize(metadata, prices, where="RunReport.usage()")

    def to_html(self, path: str | os.PathLike[str], *, max_jobs: int = 1000) -> Path:
        """Write this run's report as one self-contained HTML page (what ``interlens report`` writes) to
        ``path`` and return it; ``max_jobs`` transcripts are embedded. Needs the run's ``out_dir``."""
        from ._html_report import write_report

        if self.out_dir is None:
            raise ConfigurationError(
                "RunReport.to_html(): this run kept no ledger, and the page is read from one: run it with "
                "out_dir=... (e.g. conv.rollout(n, out_dir='runs/x')), then call to_html again"
            )
        return write_report(self.out_dir, path, max_jobs=max_jobs)

    def transcripts(self) -> dict[str, Transcript]:
        """Job id → transcript, for every job that has one."""
        return {jid: r.transcript for jid, r in self.results.items() if r.transcript is not None}

    def analyses(self) -> dict[str, Any]:
        """Job id → analyzer value, for jobs whose analyzer succeeded."""
        return {
            jid: r.analysis for jid, r in self.results.items() if r.error is None and r._state is not None
        }

    def conversations(self) -> dict[str, Conversation]:
        """Job id → finished Conversation (live: ``sample()`` works on it)."""
        out = {}
        for jid, r in self.results.items():
            conv = r.conversation
            if conv is not None:
                out[jid] = conv
        return out

    def to_pandas(self, *, tokens: bool | str = False) -> pandas.DataFrame:
        """One row per job (``job_id``, ``lineup``, ``state``, ``seed``, tokens, error, the transcript as JSON
        text and its final message, ``skipped``...), a dict analysis flattened into ``analysis.<key>``
        columns. For trainers, from the turns that kept their tokens (participants with
        ``record_tokens=True``): ``tokens=True`` (or ``"turns"``) gives one row per generated turn (the
        prompt ids the speaker saw, the completion ids and their log-probabilities), ``tokens="speakers"``
        one row per (job, speaker) (its last turn's whole sequence and a mask of the ids it generated);
        docs/rollouts.md, "Rollouts as training data". Needs pandas (``pip install 'interlens[export]'``)."""
        if tokens is False:
            return _export.to_pandas(_export.outcome_rows(self._outcome.outcomes()))
        per = _token_rows_per(tokens)
        rows = _export.outcome_token_rows(self._outcome.outcomes(), per=per, out_dir=self.out_dir)
        return _export.to_pandas(rows, base=_export.token_columns(per))

    def to_dataset(self, *, tokens: bool | str = False) -> datasets.Dataset:
        """The rows of :meth:`to_pandas` (``tokens=``: a row per generated turn or per (job, speaker)) as a
        ``datasets.Dataset``."""
        if tokens is False:
            return _export.to_dataset(_export.outcome_rows(self._outcome.outcomes()))
        per = _token_rows_per(tokens)
        rows = _export.outcome_token_rows(self._outcome.outcomes(), per=per, out_dir=self.out_dir)
        return _export.to_dataset(rows, base=_export.token_columns(per))

    def _repr_html_(self) -> str:
        return _export.summary_html(self)

    def __repr__(self) -> str:
        c = self._outcome.counts
        where = f" out_dir={str(self.out_dir)!r}" if self.out_dir is not None else ""
        stopped = f" pending={c.get('pending', 0)} (stopped early)" if self.stopped is not None else ""
        return (
            f"<RunReport jobs={len(self.results)} done={c.get('done', 0)} failed={c.get('failed', 0)} "
            f"skipped={c.get('skipped', 0)}{stopped}{where}>"
        )


def _token_rows_per(tokens: bool | str) -> str:
    """``to_pandas(tokens=...)``'s value as the rows it asks for: ``"turn"`` or ``"speaker"``."""
    per = {True: "turn", "turns": "turn", "speakers": "speaker"}.get(tokens)
    if per is None:
        raise ConfigurationError(
            f"tokens={tokens!r}: pass True or 'turns' (a row per generated turn), 'speakers' (a row per job "
            "and speaker) or False (a row per job)"
        )
    return per
