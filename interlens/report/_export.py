"""A run as tables, one row per job: ``RunReport.to_pandas()``/``to_dataset()`` and ``interlens export``.

Why one module: a notebook (a ``RunReport`` over its outcomes) and a shell (``interlens export`` over a
ledger) must agree on what a job looks like as a table row, so both flatten a job here. Nested values would
not fit a CSV cell or a typed parquet column, so: the transcript and the data row travel as JSON text (plus
the final message on its own, the usual thing to analyse), and a dict analysis is flattened into
``analysis.<key>.<subkey>`` columns. A column whose values have different types across jobs (an int here, a
string there) becomes JSON text, so Arrow (parquet, ``datasets``) can type it.

pandas, pyarrow and datasets (extra ``export``) are imported inside the functions that need them.
"""

from __future__ import annotations

import csv
import html
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from interlens.store import JOB_STATES, LedgerReader

from .._core import (
    TOKENS_KEY,
    ConfigurationError,
    ConfigurationTypeError,
    TokenRecord,
    common_prefix,
    expand_turns,
    type_name,
)
from ._branching import describe_parent, parent_of
from ._ledger_tokens import with_records

if TYPE_CHECKING:
    import datasets
    import pandas

    from interlens.scheduler import JobOutcome

    from ._report import RunReport

__all__ = [
    "BASE_COLUMNS",
    "EXPORT_FORMATS",
    "SPEAKER_COLUMNS",
    "TOKEN_COLUMNS",
    "ledger_rows",
    "ledger_token_rows",
    "outcome_rows",
    "outcome_token_rows",
    "summary_html",
    "to_dataset",
    "to_pandas",
    "token_columns",
    "write_export",
]

#: Every row has these columns, in this order; ``analysis.*`` columns follow, in first-seen order.
BASE_COLUMNS: tuple[str, ...] = (
    "job_id",
    "lineup",
    "state",
    "row_index",
    "seed",
    "attempts",
    "device",
    "tokens_generated",
    "n_messages",
    "error_type",
    "error",
    "final_author",
    "final_message",
    "transcript",
    "row",
    "parent",
)

EXPORT_FORMATS: tuple[str, ...] = ("jsonl", "csv", "parquet")

_SCALARS = (str, int, float, bool, type(None))


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def flatten_analysis(analysis: Any, prefix: str = "analysis") -> dict[str, Any]:
    """``{"score": {"len": 3}}`` → ``{"analysis.score.len": 3}``; a scalar → ``{"analysis": value}``; lists
    and other values → JSON text. ``None`` (no analyzer, or it failed) gives no columns."""
    if analysis is None and prefix == "analysis":
        return {}
    if isinstance(analysis, Mapping):
        out: dict[str, Any] = {}
        for key, value in analysis.items():
            out.update(flatten_analysis(value, f"{prefix}.{key}"))
        return out
    if isinstance(analysis, _SCALARS):
        return {prefix: analysis}
    return {prefix: _json_text(analysis)}


def job_row(
    *,
    job_id: str,
    lineup: str,
    state: str,
    row_index: int | None,
    seed: int,
    attempts: int,
    device: str | None,
    tokens_generated: int,
    error_type: str | None,
    error: str | None,
    conversation: Mapping[str, Any] | None,
    analysis: Any,
) -> dict[str, Any]:
    """One job as a flat row (see the module docstring for the columns)."""
    transcript = list((conversation or {}).get("transcript") or [])
    final = transcript[-1] if transcript else None
    row: dict[str, Any] = {
        "job_id": job_id,
        "lineup": lineup,
        "state": state,
        "row_index": row_index,
        "seed": seed,
        "attempts": attempts,
        "device": device,
        "tokens_generated": tokens_generated,
        "n_messages": len(transcript),
        "error_type": error_type,
        "error": error,
        "final_author": final.get("author") if final else None,
        "final_message": final.get("content") if final else None,
        "transcript": _json_text(transcript) if conversation is not None else None,
        "row": None
        if conversation is None or conversation.get("row") is None
        else _json_text(conversation["row"]),
        "parent": describe_parent(parent_of(conversation)),  # a branch's: "row_00012@3 in runs/x"
    }
    row.update(flatten_analysis(analysis))
    return row


def outcome_rows(outcomes: Iterable[JobOutcome]) -> Iterator[dict[str, Any]]:
    """Rows of a ``RunReport``'s job outcomes (plus ``skipped``: done by an earlier run of the ledger)."""
    for o in outcomes:
        row = job_row(
            job_id=o.job_id,
            lineup=o.lineup,
            state=o.state,
            row_index=o.row_index,
            seed=o.seed,
            attempts=o.attempts,
            device=o.device,
            tokens_generated=o.tokens_generated,
            error_type=o.error.type if o.error is not None else None,
            error=o.error.message if o.error is not None else None,
            conversation=o.conversation,
            analysis=o.analysis,
        )
        row["skipped"] = o.skipped
        yield row


def ledger_rows(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of every job in a ledger, in job order, any state (pending and running jobs have no result yet).

    Streams page by page (``LedgerReader.iter_results``), read-only: safe while a run is live.
    """
    with LedgerReader(out_dir) as reader:  # a local turn's record marker left out: this export has no records
        for job, result in reader.iter_results(states=JOB_STATES, token_markers=False):
            yield job_row(
                job_id=job.job_id,
                lineup=job.lineup,
                state=job.state,
                row_index=job.row_index,
                seed=job.seed,
                attempts=job.attempts,
                device=job.device,
                tokens_generated=job.tokens_generated,
                error_type=job.error_type,
                error=job.error_message,
                conversation=result["conversation"] if result else None,
                analysis=result["analysis"] if result else None,
            )


#: The columns of a token export (``tokens=True``): one row per generated turn that kept its tokens.
TOKEN_COLUMNS: tuple[str, ...] = (
    "job_id",
    "lineup",
    "row_index",
    "seed",
    "turn",
    "speaker",
    "prompt_ids",
    "completion_ids",
    "completion_model_logprobs",
    "completion_sampling_logprobs",
    "completion_tokens",
    "logprobs_source",
    "completion",
    "finish_reason",
)


def turn_token_rows(
    *, job_id: str, lineup: str, row_index: int | None, seed: int, conversation: Mapping[str, Any] | None
) -> Iterator[dict[str, Any]]:
    """One job's generated turns that kept their tokens (``record_tokens=True``), a row each: the ids the
    speaker saw, the ids it generated and their log-probabilities (``TOKEN_COLUMNS``; docs/rollouts.md
    maps them to TRL's and verifiers' names). ``turn`` is the message's index in the transcript (0: the
    shared context). ``logprobs_source``: "local" (computed by interlens from the local model), else the
    provider that reported them; a hosted model's turn has its tokens as text (``completion_tokens``) and
    no ids or sampling log-probabilities (None)."""
    for index, message in enumerate(expand_turns((conversation or {}).get("transcript") or [])):
        data = (message.get("metadata") or {}).get(TOKENS_KEY)
        if data is None:
            continue
        record = TokenRecord.from_json(data)
        provided = record.reported_by is not None
        yield {
            "job_id": job_id,
            "lineup": lineup,
            "row_index": row_index,
            "seed": seed,
            "turn": index,
            "speaker": message.get("author"),
            "prompt_ids": None if provided else list(record.prompt_ids),
            "completion_ids": None if provided else list(record.ids),
            "completion_model_logprobs": list(record.model_logprobs),
            "completion_sampling_logprobs": _listed(record.sampling_logprobs),
            "completion_tokens": _listed(record.texts),
            "logprobs_source": record.reported_by or "local",
            "completion": message.get("content"),
            "finish_reason": (message.get("metadata") or {}).get("finish_reason"),
        }


#: The columns of a per-speaker token export (``tokens="speakers"``): one row per (job, speaker).
SPEAKER_COLUMNS: tuple[str, ...] = (
    "job_id",
    "lineup",
    "row_index",
    "seed",
    "speaker",
    "turns",
    "input_ids",
    "generated_mask",
    "model_logprobs",
    "sampling_logprobs",
)


def speaker_token_rows(
    *, job_id: str, lineup: str, row_index: int | None, seed: int, conversation: Mapping[str, Any] | None
) -> Iterator[dict[str, Any]]:
    """One job as a row per speaker that kept its tokens: its last turn's prompt and generated ids as one
    sequence (``input_ids``), with ``generated_mask`` 1 where the speaker generated that very id, in this
    turn or an earlier one whose ids its later prompts kept verbatim (a chat template that re-renders an
    earlier answer differently leaves those positions 0), and each such position's two log-probabilities
    (0.0 elsewhere). A hosted model's turns have no ids, so they make no row here (they are in the rows per
    turn)."""
    turns: dict[Any, list[tuple[int, TokenRecord]]] = {}
    for index, message in enumerate(expand_turns((conversation or {}).get("transcript") or [])):
        data = (message.get("metadata") or {}).get(TOKENS_KEY)
        if data is None:
            continue
        record = TokenRecord.from_json(data)
        if record.reported_by is None:
            turns.setdefault(message.get("author"), []).append((index, record))
    for speaker, records in turns.items():
        sequences = [(*r.prompt_ids, *r.ids) for _, r in records]
        final = sequences[-1]
        mask, model, sampling = [0] * len(final), [0.0] * len(final), [0.0] * len(final)
        survives = len(final)  # positions below this are the same in every later prompt
        for t in range(len(records) - 1, -1, -1):
            record = records[t][1]
            start = len(record.prompt_ids)
            for k in range(len(record.ids)):
                if start + k < survives:
                    mask[start + k] = 1
                    model[start + k] = record.model_logprobs[k]
                    sampling[start + k] = (record.sampling_logprobs or ())[k]
            if t:  # how much of the previous turn's sequence this turn's prompt kept
                survives = min(survives, common_prefix(sequences[t - 1], record.prompt_ids))
        yield {
            "job_id": job_id,
            "lineup": lineup,
            "row_index": row_index,
            "seed": seed,
            "speaker": speaker,
            "turns": [index for index, _ in records],
            "input_ids": list(final),
            "generated_mask": mask,
            "model_logprobs": model,
            "sampling_logprobs": sampling,
        }


def _listed(values: Sequence[Any] | None) -> list[Any] | None:
    return None if values is None else list(values)


def outcome_token_rows(
    outcomes: Iterable[JobOutcome], *, per: str = "turn", out_dir: Path | None = None
) -> Iterator[dict[str, Any]]:
    """:func:`turn_token_rows` (``per="turn"``) or :func:`speaker_token_rows` (``per="speaker"``) of a
    ``RunReport``'s job outcomes; ``out_dir``: the run's ledger, whose table holds their records."""
    rows = _TOKEN_ROWS[per][0]
    reader = LedgerReader(out_dir) if out_dir is not None else None
    try:
        for o in outcomes:
            conversation = (
                o.conversation if reader is None else with_records(reader, o.job_id, o.conversation)
            )
            yield from rows(
                job_id=o.job_id,
                lineup=o.lineup,
                row_index=o.row_index,
                seed=o.seed,
                conversation=conversation,
            )
    finally:
        if reader is not None:
            reader.close()


def ledger_token_rows(out_dir: str | Path, *, per: str = "turn") -> Iterator[dict[str, Any]]:
    """:func:`outcome_token_rows` of every finished job in a ledger, streamed page by page, read-only."""
    rows = _TOKEN_ROWS[per][0]
    with LedgerReader(out_dir) as reader:
        for job, result in reader.iter_results(states=JOB_STATES):
            yield from rows(
                job_id=job.job_id,
                lineup=job.lineup,
                row_index=job.row_index,
                seed=job.seed,
                conversation=with_records(reader, job.job_id, result["conversation"] if result else None),
            )


#: ``per``: the rows of a token export and their columns.
_TOKEN_ROWS: dict[str, tuple[Callable[..., Iterator[dict[str, Any]]], tuple[str, ...]]] = {
    "turn": (turn_token_rows, TOKEN_COLUMNS),
    "speaker": (speaker_token_rows, SPEAKER_COLUMNS),
}


def token_columns(per: str) -> tuple[str, ...]:
    """The columns of a token export with rows ``per`` turn or speaker."""
    return _TOKEN_ROWS[per][1]


def _columns(rows: Iterable[Mapping[str, Any]], base: Sequence[str]) -> list[str]:
    seen: dict[str, None] = dict.fromkeys(base)
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _uniform(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Make every column hold one type (ints and floats mix): other mixtures become JSON text, in place."""
    for column in columns:
        kinds = {type(r[column]) for r in rows if r.get(column) is not None}
        if len(kinds) > 1 and not kinds <= {int, float}:
            for r in rows:
                if r.get(column) is not None:
                    r[column] = _json_text(r[column])


def to_pandas(rows: Iterable[dict[str, Any]], *, base: Sequence[str] = BASE_COLUMNS) -> pandas.DataFrame:
    """A DataFrame of ``rows``: one row per job, ``BASE_COLUMNS`` then the ``analysis.*`` columns (or one row
    per generated turn: ``base=TOKEN_COLUMNS``)."""
    try:
        import pandas as pd
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "to_pandas() needs pandas: pip install 'interlens[export]' (pandas, pyarrow, datasets)"
        ) from exc
    materialised = list(rows)
    columns = _columns(materialised, base)
    _uniform(materialised, columns)
    return pd.DataFrame.from_records(materialised, columns=columns)


def to_dataset(rows: Iterable[dict[str, Any]], *, base: Sequence[str] = BASE_COLUMNS) -> datasets.Dataset:
    """A ``datasets.Dataset`` of ``rows`` (the same columns as :func:`to_pandas`)."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "to_dataset() needs datasets: pip install 'interlens[export]' (pandas, pyarrow, datasets)"
        ) from exc
    return datasets.Dataset.from_pandas(to_pandas(rows, base=base), preserve_index=False)


def write_export(
    rows: Callable[[], Iterator[dict[str, Any]]],
    *,
    fmt: str,
    output: str | Path | None,
    stdout: IO[str],
    base: Sequence[str] = BASE_COLUMNS,
) -> int:
    """Write the rows as ``fmt`` to ``output`` (a path) or ``stdout``; returns the number of rows.

    ``rows`` is called afresh for each pass: CSV needs every column before its header (two passes, memory
    flat), JSONL streams in one, parquet is built in memory (pandas + pyarrow) and needs a file.
    """
    if fmt not in EXPORT_FORMATS:
        raise ConfigurationError(f"format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
    if output is not None:
        output = output_file(output, where="export", example=f"runs.{fmt}")
    if fmt == "parquet":
        if output is None:
            raise ConfigurationError(
                "--format parquet needs a file: parquet is binary, so it is not written to the terminal; "
                "pass -o FILE.parquet"
            )
        frame = to_pandas(rows(), base=base)
        frame.to_parquet(Path(output), index=False)
        return len(frame)
    handle: IO[str] = stdout if output is None else Path(output).open("w", encoding="utf-8", newline="")
    try:
        if fmt == "jsonl":
            count = 0
            for row in rows():
                handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
                count += 1
            return count
        writer = csv.DictWriter(handle, fieldnames=_columns(rows(), base), lineterminator="\n")
        writer.writeheader()
        count = 0
        for row in rows():
            writer.writerow(row)
            count += 1
        return count
    finally:
        if output is not None:
            handle.close()


def summary_html(report: RunReport) -> str:
    """The small table a notebook shows for a ``RunReport`` (``_repr_html_``): counts, tokens, where the
    ledger is, and the first failures with their error type and first line.

    Cheap on any run size: counts come with the report, tokens from one ledger query (or the in-memory
    outcomes), and only the first few failures are read.
    """
    counts = report.counts
    out_dir = report.out_dir
    if out_dir is not None:
        with LedgerReader(out_dir) as reader:
            tokens = f"{reader.summary()['tokens_generated']:,} (whole ledger)"
    else:
        tokens = f"{sum(r.tokens_generated for r in report.results.values()):,}"
    cells = [
        ("jobs", f"{len(report.results):,}"),
        ("done", f"{counts.get('done', 0):,}"),
        ("failed", f"{counts.get('failed', 0):,}"),
        ("skipped (resumed)", f"{counts.get('skipped', 0):,}"),
        ("tokens generated", tokens),
        ("ledger", str(out_dir) if out_dir is not None else "in memory (no out_dir)"),
    ]
    body = "".join(f"<tr><th style='text-align:left'>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in cells)
    failed = report.failed
    fail_rows = ""
    for job_id in failed[:5]:
        error = report.results[job_id].error
        first = (error.message.splitlines() or [""])[0] if error is not None else ""
        kind = error.type if error is not None else "?"
        fail_rows += f"<tr><td>{_e(job_id)}</td><td>{_e(kind)}</td><td>{_e(first[:200])}</td></tr>"
    failures = ""
    if failed:
        more = (
            f"<p>… and {len(failed) - 5:,} more in <code>report.failed</code></p>" if len(failed) > 5 else ""
        )
        failures = (
            "<table><tr><th>failed job</th><th>error</th><th>first line</th></tr>"
            + fail_rows
            + "</table>"
            + more
        )
    return f"<div><strong>RunReport</strong><table>{body}</table>{failures}</div>"


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def output_file(output: Any, *, where: str, example: str) -> Path:
    """``output`` as the path of a file to write, or a refusal saying why: not a path, a directory, or a
    folder that does not exist (checked before anything is read or written)."""
    if not isinstance(output, str | os.PathLike):
        raise ConfigurationTypeError(
            f"{where}: output must be the file to write (str or Path), got {type_name(output)}"
        )
    path = Path(output)
    if path.is_dir():
        raise ConfigurationError(
            f"{where}: output {str(path)!r} is a directory: name the file to write, e.g. "
            f"{str(path / example)!r}"
        )
    if not path.parent.is_dir():
        raise ConfigurationError(
            f"{where}: the folder of output {str(path)!r} does not exist: create "
            f"{str(path.parent)!r} first or write the file elsewhere"
        )
    return path
