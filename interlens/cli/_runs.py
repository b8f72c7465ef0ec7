"""``interlens status`` and ``interlens show``: a run directory read for a person at a terminal.

Everything here reads through :class:`interlens.store.LedgerReader` (read-only, no lock taken), so it works
on a finished run and on one that is writing right now, from another terminal. The facts are gathered into
plain data first (``run_status``: also what ``status --json`` prints), then drawn with rich; user text
(transcripts, error messages) always goes in as ``rich.text.Text``, never as markup, so a message holding
``[bold]`` or terminal control characters prints as what it is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

import interlens.store as store
from interlens.store import LEDGER_FILENAME, LedgerReader

from .._core import TOKENS_KEY, ConfigurationError, as_interlens_errors, escape_controls
from ..report import describe_parent, parent_of, recorded_metadata, summarize

__all__ = ["open_reader", "render_messages", "render_show", "render_status", "run_status"]

_FAILURES_SHOWN = 10


def open_reader(out_dir: str | os.PathLike[str]) -> LedgerReader:
    """A reader of ``out_dir``'s ledger, or an ``InterlensError`` that says what is wrong and what to pass."""
    path = Path(out_dir)
    what = (
        f"OUT_DIR is a run's out_dir, the directory holding {LEDGER_FILENAME} (e.g. runs/demo after "
        "`interlens demo`)"
    )
    if not path.exists():
        raise ConfigurationError(f"{path} does not exist. {what}.")
    with as_interlens_errors():
        try:
            return LedgerReader(path)
        except store.LedgerNotFoundError as exc:
            raise ConfigurationError(f"{path} is not a run directory: {exc}. {what}.") from exc


def clean(text: str) -> str:
    """Text safe for a terminal: control characters (other than newline and tab) shown as ``\\xNN``."""
    return escape_controls(text)


def name(text: object) -> str:
    """A name (job id, lineup, author, model, batch id) safe for one line of a terminal: every control
    character, newline and tab included, shown as ``\\xNN``, so a name cannot move the cursor, recolour the
    screen or forge a line of output."""
    return escape_controls(text, breaks=False)


def first_line(text: str | None) -> str:
    return clean((text or "").strip().splitlines()[0]) if (text or "").strip() else ""


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _alive(pid: int | None, host: str | None) -> bool | None:
    """Whether the process that wrote a run is alive (None: it ran on another host, so we cannot tell)."""
    if pid is None or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_status(reader: LedgerReader) -> dict[str, Any]:
    """What ``interlens status`` shows, as plain JSON-able data."""
    summary = reader.summary()
    now = time.time()
    last = summary["last_run"]
    run: dict[str, Any] | None = None
    if last is not None:
        live = _alive(last["pid"], last["host"]) if last["status"] == "running" else False
        if last["status"] == "running" and live is False:
            # its process died: the run ended with its last recorded progress, not now
            now = max(reader.last_write() or last["started_at"], last["started_at"])
        end = last["ended_at"] if last["ended_at"] is not None else now
        run = {
            "run_id": last["run_id"],
            "status": last["status"],
            "live": live,
            "pid": last["pid"],
            "host": last["host"],
            "started_at": last["started_at"],
            "ended_at": last["ended_at"],
            "elapsed_s": max(end - last["started_at"], 0.0),
        }
    running = reader.job_ids(state="running")
    failed_ids = reader.job_ids(state="failed")
    failures = []
    for job_id in failed_ids[:_FAILURES_SHOWN]:
        job = reader.job(job_id)
        if job is not None:
            failures.append(
                {"job_id": job_id, "error_type": job.error_type, "first_line": first_line(job.error_message)}
            )
    return {
        "out_dir": str(reader.path.parent),
        "ledger": str(reader.path),
        "jobs": summary["jobs"],
        "counts": summary["counts"],
        "tokens_generated": summary["tokens_generated"],
        "lineups": {name: entry["counts"] for name, entry in summary["lineups"].items()},
        "runs": summary["runs"],
        "run": run,
        "throughput": _throughput(reader, run, now),
        "running_turns": sum(reader.turn_count(job_id) for job_id in running),
        "failures": failures,
        "failures_total": len(failed_ids),
        "failures_by_type": summary["failures_by_type"],
        # records the file lost (a damaged write): named, left out of every total, run again by a rerun
        "unreadable": [record.describe() for record in reader.unreadable_records()],
        "api_usage": [dataclasses.asdict(u) for u in summarize(recorded_metadata(reader)).api],
        "open_batches": [
            {
                "provider": b.provider,
                "batch_id": b.batch_id,
                "state": b.state,
                "rows": len(b.requests),
                "created_at": b.created_at,
            }
            for b in reader.batches(open_only=True)
        ],
    }


def _throughput(reader: LedgerReader, last: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """Tokens/s and jobs/s of the live run, else of the latest run that finished jobs (a rerun that only
    resumed done jobs finishes none: its throughput says nothing)."""
    if last is None:
        return None
    runs = reader.runs()
    for entry in reversed(runs):
        finished = [reader.job(job_id) for job_id in reader.job_ids(run=entry["run_id"])]
        if finished or (entry["run_id"] == last["run_id"] and entry["status"] == "running"):
            end = entry["ended_at"] if entry["ended_at"] is not None else now
            elapsed = max(end - entry["started_at"], 1e-9)
            tokens = sum(j.tokens_generated for j in finished if j is not None)
            return {
                "run_id": entry["run_id"],
                "jobs_finished": len(finished),
                "tokens": tokens,
                "elapsed_s": elapsed,
                "tokens_per_s": tokens / elapsed,
                "jobs_per_s": len(finished) / elapsed,
            }
    return None


def _run_line(run: dict[str, Any]) -> Text:
    status = run["status"]
    line = Text(f"run #{run['run_id']}: ")
    if status == "running" and run["live"]:
        line.append("running", style="bold yellow")
        line.append(f" (live, pid {run['pid']}), for {duration(run['elapsed_s'])}")
    elif status == "running" and run["live"] is None:
        line.append("running", style="bold yellow")
        line.append(f" on host {run['host']} (pid {run['pid']}; its liveness cannot be checked from here)")
    elif status == "running":
        line.append("stopped", style="bold red")
        line.append(
            f": the ledger says running but its process (pid {run['pid']}) is gone (crashed or killed); "
            "rerun the same call to resume it"
        )
    elif status == "stopped":
        line.append("stopped early", style="bold yellow")
        line.append(
            f" after {duration(run['elapsed_s'])} (API budget spent or a device unusable); the jobs it "
            "did not finish are pending: rerun the same call to continue"
        )
    else:
        line.append(status, style="bold green" if status == "completed" else "bold red")
        line.append(f", took {duration(run['elapsed_s'])}")
    line.append(f"; started {when(run['started_at'])}")
    return line


def render_status(console: Console, data: dict[str, Any]) -> None:
    console.print(Text.assemble(("Run directory ", "bold"), data["out_dir"], f"  ({data['runs']} run(s))"))
    if data["run"] is not None:
        console.print(_run_line(data["run"]))
    counts = data["counts"]
    table = Table(title="Jobs", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("state")
    table.add_column("jobs", justify="right")
    styles = {"done": "green", "failed": "red", "running": "yellow", "pending": "dim"}
    for state in ("done", "failed", "running", "pending"):
        table.add_row(Text(state, style=styles[state]), f"{counts.get(state, 0):,}")
    table.add_row(Text("total", style="bold"), f"{data['jobs']:,}")
    console.print(table)
    if len(data["lineups"]) > 1:
        lineups = Table(title="By lineup", box=box.SIMPLE_HEAD, title_justify="left")
        lineups.add_column("lineup")
        for state in ("done", "failed", "running", "pending"):
            lineups.add_column(state, justify="right")
        for lineup, c in data["lineups"].items():
            lineups.add_row(
                Text(name(lineup)), *(f"{c.get(s, 0):,}" for s in ("done", "failed", "running", "pending"))
            )
        console.print(lineups)
    tokens = Text(f"tokens generated: {data['tokens_generated']:,} (finished jobs, all runs)")
    rate = data["throughput"]
    if rate is not None:
        tokens.append(
            f"\nthroughput, run #{rate['run_id']}: {rate['tokens_per_s']:,.1f} tokens/s, "
            f"{rate['jobs_per_s']:,.2f} jobs/s ({rate['jobs_finished']:,} jobs finished in "
            f"{duration(rate['elapsed_s'])})"
        )
    if counts.get("running"):
        tokens.append(
            f"\nrunning jobs: {counts['running']:,}, {data['running_turns']:,} turns committed so far"
        )
    console.print(tokens)
    if data["failures_total"]:
        fails = Table(
            title=f"Failures ({data['failures_total']:,})", box=box.SIMPLE_HEAD, title_justify="left"
        )
        fails.add_column("job")
        fails.add_column("error")
        fails.add_column("first line", overflow="fold")
        for f in data["failures"]:
            fails.add_row(
                Text(name(f["job_id"])),
                Text(name(f["error_type"] or "?"), style="red"),
                Text(f["first_line"]),
            )
        console.print(fails)
        if data["failures_total"] > len(data["failures"]):
            console.print(
                Text(
                    f"... and {data['failures_total'] - len(data['failures']):,} more "
                    f"(all: interlens export {data['out_dir']} --format csv)",
                    style="dim",
                )
            )
    for what in data.get("unreadable") or []:
        console.print(
            Text(
                f"unreadable: {what} is not valid JSON (the file was damaged there); left out of the figures "
                "above, and run again by a rerun of the same recipe into this out_dir",
                style="bold red",
            )
        )
    usage = data.get("api_usage") or []
    if usage:
        table = Table(title="API usage (tokens)", box=box.SIMPLE_HEAD, title_justify="left")
        for column in ("provider", "model", "mode"):
            table.add_column(column)
        for column in ("requests", "input", "cache read", "cache write", "output"):
            table.add_column(column, justify="right")
        for u in usage:
            counts = (u["requests"], u["input_tokens"], u["cache_read_tokens"], u["cache_write_tokens"])
            table.add_row(
                Text(name(u["provider"])),
                Text(name(u["model"])),
                u["mode"],
                *(f"{n:,}" for n in (*counts, u["output_tokens"])),
            )
        console.print(table)
    batches = data["open_batches"]
    if batches:
        table = Table(title="Provider batches in flight", box=box.SIMPLE_HEAD, title_justify="left")
        for column in ("provider", "batch", "state", "rows", "submitted"):
            table.add_column(column)
        for b in batches:
            table.add_row(
                Text(name(b["provider"])),
                Text(name(b["batch_id"])),
                Text(name(b["state"])),
                str(b["rows"]),
                when(b["created_at"]),
            )
        console.print(table)
    else:
        console.print(Text("provider batches in flight: none", style="dim"))


def render_show(console: Console, reader: LedgerReader, job_id: str, *, metadata: bool) -> None:
    """One job: its facts, then its transcript (the finished one, else the turns committed so far)."""
    job = reader.job(job_id)
    if job is None:
        some = reader.job_ids()[:5]
        raise ConfigurationError(
            f"no job {job_id!r} in {reader.path}. Its jobs are named like {', '.join(some) or '(none yet)'}; "
            f"`interlens status {reader.path.parent}` counts them, `interlens export {reader.path.parent}` "
            "lists every id."
        )
    styles = {"done": "green", "failed": "red", "running": "yellow", "pending": "dim"}
    head = Text.assemble(
        ("job ", "bold"), (name(job.job_id), "bold"), "  ", (job.state, f"bold {styles[job.state]}")
    )
    facts = [
        f"lineup {name(job.lineup)}",
        f"seed {job.seed}",
        *([f"row {job.row_index}"] if job.row_index is not None else []),
        f"{job.tokens_generated:,} tokens",
        f"{job.attempts} attempt(s)",
        *([f"device {name(job.device)}"] if job.device else []),
        *([duration(job.duration_s)] if job.duration_s is not None else []),
    ]
    head.append("  " + " · ".join(facts), style="dim")
    console.print(head)
    if job.error_type is not None:
        console.print(
            Text.assemble((f"{name(job.error_type)}: ", "bold red"), clean(job.error_message or ""))
        )
    result = reader.result(job_id)
    if result is not None:
        conversation = result["conversation"]
        messages = list(conversation.get("transcript") or [])
        if conversation.get("row") is not None:
            console.print(
                Text("row: " + clean(json.dumps(conversation["row"], ensure_ascii=False)), style="dim")
            )
        parent = parent_of(conversation)
        if parent is not None:  # a branch (report.branch): its first turns are its parent's
            console.print(
                Text(
                    f"branched from {clean(describe_parent(parent) or '')}: its first {parent.get('turn')} "
                    "turn(s) are the parent's, recorded there",
                    style="dim",
                )
            )
    else:
        messages = [r.turn for r in reader.turn_records(job_id)]
        console.print(
            Text(
                f"not finished: the {len(messages)} turn(s) committed so far (the shared context is stored "
                "with the finished conversation)",
                style="dim",
            )
        )
    render_messages(console, messages, metadata=metadata)
    if result is not None and result["analysis"] is not None:
        console.print(Rule(Text("analysis", style="bold magenta"), align="left", style="dim"))
        console.print(Text(clean(json.dumps(result["analysis"], indent=2, ensure_ascii=False))))


def render_messages(console: Console, messages: list[dict[str, Any]], *, metadata: bool = False) -> None:
    """Messages (``Message.to_json()`` dicts) as a readable dialogue: a rule naming the author, the text."""
    for message in messages:
        author = name(message.get("author", "?"))
        console.print(Rule(Text(author, style="bold cyan"), align="left", style="dim"))
        console.print(Text(clean(str(message.get("content", "")))))
        meta = message.get("metadata") or {}
        if metadata and meta:
            pairs = ", ".join(f"{k}={_shown(k, v, meta)}" for k, v in meta.items())
            console.print(Text(f"metadata: {pairs}", style="dim italic"))


def _shown(key: str, value: Any, meta: dict[str, Any]) -> str:
    """A metadata value as ``show --metadata`` prints it: a token record (kilobytes of base64) by what it
    holds, the others as JSON."""
    if key == TOKENS_KEY:
        reporter = value.get("reported_by") if isinstance(value, dict) else None
        if reporter is not None:
            count = value["n"] if "n" in value else len(value.get("texts") or ())  # a marker (schema 5): "n"
            return f"<{count} tokens and their log-probabilities, reported by {reporter}>"
        return f"<{meta.get('n_tokens', '?')} token ids and their log-probabilities>"
    return clean(json.dumps(value, ensure_ascii=False))
