"""The run report as one self-contained HTML page: ``write_report(out_dir, "report.html")``.

A researcher would rather look at a run than read it, and would rather open one file than start a server, so
the page carries everything itself: CSS and JS inline, charts as inline SVG drawn here (no chart library, no
CDN, nothing fetched at view time), and the transcripts as JSON in a ``<script type="application/json">``
tag that the page's own small script turns into a searchable transcript browser. Transcripts are untrusted
text (a model may well write ``</script>``): the JSON is HTML-escaped (jinja2's ``tojson``: ``<``, ``>``,
``&`` and ``'`` as ``\\u`` escapes) and the script puts it into the page with ``textContent`` only, never as
markup.

The ledger is read through :class:`interlens.store.LedgerReader` only, in one streaming pass (jobs page by
page, each job's turns by an indexed lookup), so a report over a large run holds its aggregates, not its
conversations: the statistics cover every job, and only the first ``max_jobs`` transcripts are embedded
(the page says so). Safe on a live run: the reader is read-only.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from interlens.store import JOB_STATES, LEDGER_FILENAME, LedgerReader

from .._core import (
    ConfigurationTypeError,
    LedgerError,
    as_interlens_errors,
    check_int,
    type_name,
)
from ._branching import describe_parent, parent_of
from ._export import output_file

__all__ = ["write_report"]

_TEMPLATE = "report.html.j2"
_HIST_BINS = 40  # most bars in the tokens-per-turn histogram
_TIME_BUCKETS = 60  # most bars in a throughput chart
_TIME_KEYS = 20_000  # distinct time keys kept while streaming before the resolution is coarsened
_FAILURE_LINES = 20  # distinct first lines shown per error type
_FAILURE_IDS = 50  # job ids shown per first line
_FAILURE_KEPT = 1000  # distinct first lines counted per error type; later ones count as one "other" line
_OTHER_LINES = "(other messages)"
_SPEAKERS = 50  # rows of the per-speaker table
_EMBED_CHARS = 20_000_000  # characters of transcript the page embeds at most, whatever max_jobs says
# Bucket widths a reader can take in at a glance (seconds).
_NICE_WIDTHS = (
    *(m * 10.0**k for k in range(-3, 1) for m in (1, 2, 5)),
    *(10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200),
    *(86400 * d for d in (1, 2, 7, 14, 28, 56)),
)


def write_report(
    out_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    max_jobs: int = 1000,
    max_chars: int = 20_000,
) -> Path:
    """Write the HTML report of the run in ``out_dir`` to ``output``; return the file's path.

    ``max_jobs``: how many transcripts (in job order) the transcript browser embeds; the counts, charts and
    failure groups always cover every job. ``max_chars``: longer messages are cut to this many characters
    (marked as cut). Works on a live run (read-only) as on a finished one.
    """
    run_dir = _run_dir(out_dir)
    out = _output_path(output)
    check_int(max_jobs, what="write_report(): max_jobs", low=0, fix="e.g. max_jobs=1000")
    check_int(max_chars, what="write_report(): max_chars", low=1, fix="e.g. max_chars=20000")
    with as_interlens_errors(), LedgerReader(run_dir) as reader:
        facts = _collect(reader, max_jobs=max_jobs, max_chars=max_chars)
    html = _render_html(facts, run_dir=run_dir)
    out.write_text(html, encoding="utf-8")
    return out


def _run_dir(out_dir: Any) -> Path:
    if not isinstance(out_dir, str | os.PathLike):
        raise ConfigurationTypeError(
            f"write_report(): out_dir must be a run's directory (str or Path), got {type_name(out_dir)}"
        )
    path = Path(out_dir)
    if path.is_file() and path.name == LEDGER_FILENAME:
        path = path.parent
    if not path.is_dir():
        raise LedgerError(
            f"write_report(): out_dir {str(path)!r} is not a directory: pass the out_dir a rollout wrote "
            f"(the folder that holds {LEDGER_FILENAME}), e.g. runs/demo"
        )
    if not (path / LEDGER_FILENAME).is_file():
        raise LedgerError(
            f"write_report(): {str(path)!r} holds no {LEDGER_FILENAME}, so it is not a run directory: pass "
            f"the out_dir given to rollout()/run() (the folder that holds {LEDGER_FILENAME})"
        )
    return path


def _output_path(output: Any) -> Path:
    return output_file(output, where="write_report()", example="report.html")


# ------------------------------------------------------------------------------------------ reading the run


@dataclass
class _Times:
    """Counts per time key, at a resolution coarsened as needed so memory stays bounded on long runs."""

    resolution: float = 0.001
    keys: dict[int, list[int]] = field(default_factory=dict)  # key -> [turns, tokens, done, failed]

    def add(self, at: float | None, slot: int, amount: int = 1) -> None:
        if at is None or not math.isfinite(at):
            return
        row = self.keys.setdefault(math.floor(at / self.resolution), [0, 0, 0, 0])
        row[slot] += amount
        if len(self.keys) > _TIME_KEYS:
            self.resolution *= 10
            coarse: dict[int, list[int]] = {}
            for key, values in self.keys.items():
                merged = coarse.setdefault(math.floor(key / 10), [0, 0, 0, 0])
                for i, v in enumerate(values):
                    merged[i] += v
            self.keys = coarse

    def buckets(self) -> tuple[float, float, list[list[int]]]:
        """``(start, width, rows)``: at most ``_TIME_BUCKETS`` buckets of a nice width from ``start``."""
        if not self.keys:
            return 0.0, 1.0, []
        low, high = min(self.keys), max(self.keys)
        span = (high - low + 1) * self.resolution
        width = next(
            (w for w in _NICE_WIDTHS if w >= self.resolution * 0.999 and w * _TIME_BUCKETS >= span),
            span / _TIME_BUCKETS,
        )
        start = math.floor(low * self.resolution / width) * width
        count = max(1, math.floor(((high + 1) * self.resolution - start) / width - 1e-9) + 1)
        rows = [[0, 0, 0, 0] for _ in range(count)]
        for key, values in self.keys.items():
            index = min(count - 1, max(0, math.floor((key * self.resolution - start) / width + 1e-9)))
            for i, v in enumerate(values):
                rows[index][i] += v
        return start, width, rows


@dataclass
class _Facts:
    summary: dict[str, Any]
    tokens_per_turn: Counter[int] = field(default_factory=Counter)
    speakers: dict[str, Counter[str]] = field(default_factory=dict)  # turns, tokens, finish:<reason>
    times: _Times = field(default_factory=_Times)
    # error type -> first line -> [count, the first _FAILURE_IDS job ids]: bounded however many jobs fail
    failures: dict[str, dict[str, tuple[list[int], list[str]]]] = field(default_factory=dict)
    failure_counts: Counter[str] = field(default_factory=Counter)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    total_jobs: int = 0
    turns: int = 0
    first_at: float | None = None
    last_at: float | None = None
    embedded_chars: int = 0
    size_capped: bool = False  # _EMBED_CHARS stopped the embedding before max_jobs did

    def saw(self, at: float | None) -> None:
        if at is None:
            return
        self.first_at = at if self.first_at is None else min(self.first_at, at)
        self.last_at = at if self.last_at is None else max(self.last_at, at)


def _collect(reader: LedgerReader, *, max_jobs: int, max_chars: int) -> _Facts:
    facts = _Facts(summary=reader.summary())
    for job, result in reader.iter_results(states=JOB_STATES):
        facts.total_jobs += 1
        facts.saw(job.started_at)
        turns = reader.turn_records(job.job_id)
        for record in turns:
            metadata = record.turn.get("metadata") or {}
            if "n_tokens" not in metadata:  # the shared context and other turns nobody generated
                continue
            n_tokens = int(metadata["n_tokens"])
            facts.turns += 1
            facts.tokens_per_turn[n_tokens] += 1
            speaker = facts.speakers.setdefault(str(record.turn.get("author", "?")), Counter())
            speaker.update(
                {"turns": 1, "tokens": n_tokens, f"finish:{metadata.get('finish_reason') or '—'}": 1}
            )
            facts.times.add(record.committed_at, 0)
            facts.times.add(record.committed_at, 1, n_tokens)
            facts.saw(record.committed_at)
        if job.state in ("done", "failed"):
            facts.times.add(job.finished_at, 2 if job.state == "done" else 3)
            facts.saw(job.finished_at)
        if job.state == "failed":
            kind = job.error_type or "unknown error"
            first = _first_line(job.error_message)
            facts.failure_counts[kind] += 1
            lines = facts.failures.setdefault(kind, {})
            if first not in lines and len(lines) >= _FAILURE_KEPT:
                first = _OTHER_LINES
            count, ids = lines.setdefault(first, ([0], []))
            count[0] += 1
            if len(ids) < _FAILURE_IDS:
                ids.append(job.job_id)
        if len(facts.jobs) < max_jobs and not facts.size_capped:
            entry = _job_entry(job, result, turns, max_chars=max_chars)
            size = sum(len(t["content"]) for t in entry["turns"]) + len(entry["error"] or "")
            if facts.jobs and facts.embedded_chars + size > _EMBED_CHARS:
                facts.size_capped = True
            else:
                facts.jobs.append(entry)
                facts.embedded_chars += size
    return facts


def _first_line(message: str | None) -> str:
    for line in (message or "").splitlines():
        if line.strip():
            return line.strip()
    return "(no message)"


def _job_entry(job: Any, result: Mapping[str, Any] | None, turns: Sequence[Any], *, max_chars: int) -> dict:
    """One job as the transcript browser gets it: facts, then its messages (the stored transcript when
    there is a result, else the committed turns, so a failed or running job shows how far it got)."""
    messages: list[Any] = []
    if result is not None:
        messages = list((result.get("conversation") or {}).get("transcript") or [])
    if not messages:
        messages = [record.turn for record in turns]
    out_turns = []
    for message in messages:
        content = str(message.get("content", ""))
        metadata = message.get("metadata") or {}
        cut = len(content) > max_chars
        out_turns.append(
            {
                "author": str(message.get("author", "?")),
                "content": content[:max_chars],
                "cut": len(content) if cut else 0,
                "n_tokens": metadata.get("n_tokens"),
                "finish_reason": metadata.get("finish_reason"),
            }
        )
    analysis = None if result is None else result.get("analysis")
    return {
        "id": job.job_id,
        "lineup": job.lineup,
        "state": job.state,
        "seed": job.seed,
        "row": job.row_index,
        "attempts": job.attempts,
        "device": job.device,
        "tokens": job.tokens_generated,
        "duration": job.duration_s,
        "error_type": job.error_type,
        "error": (job.error_message or "")[:max_chars] if job.state == "failed" else None,
        "analysis": None if analysis is None else _json_text(analysis)[:max_chars],
        "turns": out_turns,
        "parent": describe_parent(parent_of(None if result is None else result.get("conversation"))),
    }


# ------------------------------------------------------------------------------------------------- charts


def _chart(
    series: Sequence[tuple[str, Sequence[float]]],
    titles: Sequence[str],
    *,
    x_labels: tuple[str, str],
    width: int = 560,
    height: int = 200,
) -> dict[str, Any]:
    """Stacked bar chart geometry for the template: ``series`` is ``(css class, values)`` per layer and
    ``titles`` the tooltip of each bar position. Values are drawn to the chart's largest stacked total."""
    left, right, top, bottom = 48, 8, 10, 24
    n = max((len(values) for _, values in series), default=0)
    totals = [sum(values[i] for _, values in series) for i in range(n)]
    peak = max(totals, default=0) or 1
    plot_w, plot_h = width - left - right, height - top - bottom
    step = plot_w / max(n, 1)
    gap = min(2.0, step * 0.15)
    bars = []
    for i in range(n):
        base = 0.0
        for css, values in series:
            value = values[i]
            if value <= 0:
                continue
            h = plot_h * value / peak
            y = top + plot_h - plot_h * (base + value) / peak
            bars.append(
                {
                    "x": round(left + i * step + gap / 2, 2),
                    "y": round(y, 2),
                    "w": round(max(step - gap, 0.5), 2),
                    "h": round(max(h, 0.5), 2),
                    "cls": css,
                    "value": _number(value),
                    "title": titles[i],
                }
            )
            base += value
    ticks = [{"y": round(top + plot_h - plot_h * f, 2), "label": _number(peak * f)} for f in (0.0, 0.5, 1.0)]
    return {
        "width": width,
        "height": height,
        "left": left,
        "top": top,
        "plot_w": plot_w,
        "plot_h": plot_h,
        "bottom": top + plot_h,
        "bars": bars,
        "ticks": ticks,
        "x_labels": x_labels,
        "empty": n == 0,
    }


def _histogram(counts: Counter[int]) -> dict[str, Any]:
    if not counts:
        return _chart([("bar", [])], [], x_labels=("", ""))
    low, high = min(counts), max(counts)
    width = 1
    for w in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10_000):
        width = w
        if (high // w - low // w + 1) <= _HIST_BINS:
            break
    first = (low // width) * width
    n = high // width - low // width + 1
    values = [0] * n
    for tokens, count in counts.items():
        values[tokens // width - low // width] += count
    titles = []
    for i, v in enumerate(values):
        lo = first + i * width
        span = f"{lo}" if width == 1 else f"{lo}–{lo + width - 1}"
        titles.append(f"{span} tokens: {v} turn{'s' if v != 1 else ''}")
    last = first + n * width - 1
    return _chart([("bar", values)], titles, x_labels=(f"{first}", f"{last} tokens"))


def _throughput(facts: _Facts) -> dict[str, Any]:
    start, width, rows = facts.times.buckets()
    origin = facts.first_at if facts.first_at is not None else start
    titles = []
    for i, (turns, tokens, done, failed) in enumerate(rows):
        at = start + i * width - origin
        titles.append(
            f"+{_duration(max(at, 0.0))} … +{_duration(at + width)}: {tokens} tokens, {turns} turns, "
            f"{done} jobs done, {failed} failed"
        )
    end = start + len(rows) * width - origin
    labels = (f"+{_duration(max(start - origin, 0.0))}", f"+{_duration(max(end, 0.0))}")
    return {
        "width_label": _duration(width),
        "tokens": _chart([("bar tokens", [r[1] for r in rows])], titles, x_labels=labels),
        "turns": _chart([("bar turns", [r[0] for r in rows])], titles, x_labels=labels),
        "jobs": _chart(
            [("bar done", [r[2] for r in rows]), ("bar failed", [r[3] for r in rows])],
            titles,
            x_labels=labels,
        ),
    }


def _speakers(speakers: Mapping[str, Counter[str]]) -> list[dict[str, Any]]:
    """One row per author of generated turns, most tokens first: turns, tokens, mean and how turns ended."""
    rows = []
    for author, c in sorted(speakers.items(), key=lambda item: (-item[1]["tokens"], item[0]))[:_SPEAKERS]:
        finishes = sorted(
            ((k.removeprefix("finish:"), n) for k, n in c.items() if k.startswith("finish:")),
            key=lambda item: (-item[1], item[0]),
        )
        rows.append(
            {
                "author": author,
                "turns": c["turns"],
                "tokens": c["tokens"],
                "mean": f"{c['tokens'] / c['turns']:.1f}" if c["turns"] else "—",
                "finishes": " · ".join(f"{reason} {n}" for reason, n in finishes),
            }
        )
    return rows


def _json_text(value: Any) -> str:
    """An analyzer value as text: on one line when short, indented when not."""
    flat = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return flat if len(flat) <= 100 else json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False)


def _number(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k" if value < 1e6 else f"{value / 1e6:.1f}M"
    return f"{value:.0f}" if float(value).is_integer() or value >= 100 else f"{value:.1f}"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.4g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} d"


def _utc(at: float | None) -> str:
    if at is None:
        return "—"
    return datetime.datetime.fromtimestamp(at, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# ------------------------------------------------------------------------------------------------ the page


def _render_html(facts: _Facts, *, run_dir: Path) -> str:
    """The page for ``facts`` (jinja2, autoescaped; imported here so ``import interlens`` stays cheap)."""
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True)
    source = resources.files("interlens.report").joinpath("templates", _TEMPLATE).read_text(encoding="utf-8")
    template = env.from_string(source)
    summary = facts.summary
    span = (
        (facts.last_at - facts.first_at) if facts.first_at is not None and facts.last_at is not None else None
    )
    tokens = int(summary["tokens_generated"])
    failures = []
    for kind, count in facts.failure_counts.most_common():
        lines = sorted(facts.failures[kind].items(), key=lambda item: -item[1][0][0])
        failures.append(
            {
                "type": kind,
                "count": count,
                "lines": [
                    {"line": line, "count": n[0], "ids": ids, "more": n[0] - len(ids)}
                    for line, (n, ids) in lines[:_FAILURE_LINES]
                ],
                "more_lines": max(0, len(lines) - _FAILURE_LINES),
            }
        )
    last_run = summary.get("last_run") or {}
    data = {"jobs": facts.jobs, "total_jobs": facts.total_jobs, "embedded": len(facts.jobs)}
    return template.render(
        title=f"interlens run · {run_dir.resolve().name}",
        run_dir=str(run_dir.resolve()),
        generated=_utc(datetime.datetime.now(tz=datetime.UTC).timestamp()),
        counts=[(state, summary["counts"].get(state, 0)) for state in JOB_STATES],
        jobs_total=summary["jobs"],
        tokens=tokens,
        turns=facts.turns,
        tokens_per_s=(f"{tokens / span:.1f}" if span else "—"),
        span=(_duration(span) if span else "—"),
        first_at=_utc(facts.first_at),
        last_at=_utc(facts.last_at),
        lineups=summary["lineups"],
        runs=summary["runs"],
        last_run=last_run,
        open_batches=summary["open_batches"],
        histogram=_histogram(facts.tokens_per_turn),
        speakers=_speakers(facts.speakers),
        more_speakers=max(0, len(facts.speakers) - _SPEAKERS),
        throughput=_throughput(facts),
        failures=failures,
        failed_total=sum(facts.failure_counts.values()),
        embedded=len(facts.jobs),
        size_capped=facts.size_capped,
        embed_chars=f"{_EMBED_CHARS:,}",
        total_jobs=facts.total_jobs,
        data=data,
    )
