"""From conversations to scheduler jobs and back: ``rollout``, ``run`` and their async twins.

A lineup (one Conversation) expands lazily into jobs: one per sample (``rollout_0000``...) or per data row
(``row_00000``...), each an independent copy with its templates resolved for its row and its own seed. The
scheduler runs them; this module only translates between the two worlds.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Unpack

from ._analyzers import check_analyzer, check_shippable, run_analyzer, worker_hooks
from ._exceptions import ConfigurationError, ConfigurationTypeError, InterlensError, TemplateError, translate
from ._model_participant import CURRENT_JOB
from ._options import Options, RunOptions, check_n, parse_options, prepare_out_dir
from ._participant import Participant
from ._stop import ambient_conditions
from ._templating import DatasetField, is_templated, resolve

if TYPE_CHECKING:
    from interlens.scheduler import JobContext, JobResult, JobSpec, LineupSpec

    from ._conversation import Conversation
    from ._report import RunReport

__all__ = ["arollout", "arun", "rollout", "run", "turn_seed"]

log = logging.getLogger("interlens")


def _mix(*parts: int) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def turn_seed(conv: Conversation, participant: Participant) -> int | None:
    """The sampling seed of the next turn of ``participant``, or None for the shared RNG.

    Deterministic mode, or a participant with a pinned ``seed=``, seeds every turn from (participant seed,
    rollout seed, turn index): the turn is then token-identical whatever else is generated beside it.
    """
    from interlens.scheduler import ExecutionMode

    job = CURRENT_JOB.get()
    pinned = getattr(participant, "seed", None)
    deterministic = job is not None and job.mode is ExecutionMode.DETERMINISTIC
    if pinned is None and not deterministic:
        return None
    return _mix(pinned or 0, conv.seed or 0, conv.generated_turns)


@dataclass
class ConversationJob:
    """One expanded conversation, run by the scheduler (satisfies ``interlens.scheduler.Job``)."""

    conversation: Conversation
    needs_device: bool
    error: BaseException | None = None  # a row that could not be expanded fails its own job only

    async def run(self, ctx: JobContext) -> JobResult:
        from interlens.scheduler import JobResult

        from ._message import Message

        if self.error is not None:
            raise self.error
        conv = self.conversation._copy()
        conv._stream_id = ctx.job_id
        for turn in ctx.committed_turns:  # resume: replay what an earlier attempt already committed
            conv.transcript.append(Message.from_json(turn))
        token = CURRENT_JOB.set(ctx)
        try:
            conditions = conv._conditions()
            while not conv._should_stop(conditions):
                participant = conv.next_speaker()
                message = await participant.agenerate(
                    conv.view(participant), conv._options(conditions, participant)
                )
                conv.transcript.append(message)
                await ctx.record_turn(conv.generated_turns - 1, message.to_json())
            analysis, analysis_error = None, None
            if conv.analyzer_fn is not None:
                try:
                    analysis = await run_analyzer(conv.analyzer_fn, conv)
                except Exception as exc:
                    analysis_error = exc
        finally:
            CURRENT_JOB.reset(token)
        return JobResult(
            conversation=conv.to_json(),
            tokens_generated=conv.tokens_generated,
            analysis=analysis,
            analysis_error=analysis_error,
        )

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError | TimeoutError) or bool(getattr(exc, "transient", False))


def _rows(data: Any, n: int | None) -> tuple[Iterator[Any], int | None]:
    """A lazy iterator over at most ``n`` rows of ``data`` and its length when known."""
    try:
        total: int | None = len(data)
    except TypeError:
        total = None
    if n is not None:
        total = n if total is None else min(n, total)
    return itertools.islice(iter(data), n), total


def _template_columns(conv: Conversation) -> set[str]:
    columns: set[str] = set()

    def visit(value: Any) -> None:
        if isinstance(value, DatasetField):
            columns.add(value.column)
        elif isinstance(value, tuple):
            for part in value:
                visit(part)
        elif hasattr(value, "interpolations") and not isinstance(value, str):
            for interp in value.interpolations:
                visit(interp.value)

    for value in (
        conv.shared_context,
        conv.shared_system_prompt,
        *(p.system_prompt for p in conv.participants),
    ):
        visit(value)
    return columns


def _expand_one(base: Conversation, row: Any, index: int | None, seed: int) -> Conversation:
    """The job's own copy of ``base``: its row attached, its templates resolved, its seed set."""
    if row is not None and not hasattr(row, "keys"):
        raise TemplateError(f"data row {index} is a {type(row).__name__}, not a mapping of column -> value")
    row_dict = dict(row) if row is not None else None
    participants = tuple(
        p.replace(system_prompt=resolve(p.system_prompt, row_dict, field=f"{p.name}.system_prompt"))
        if is_templated(p.system_prompt)
        else p
        for p in base.participants
    )
    system = resolve(base.shared_system_prompt, row_dict, field="shared_system_prompt")
    conv = base.set(participants=participants, shared_system_prompt=system)
    conv.row, conv.seed = row_dict, seed
    conv._seed_transcript()
    return conv


def lineup_spec(
    conv: Conversation,
    n: int | None,
    *,
    seed: int,
    prefix: str | None,
    single_job_id: str | None,
    lineup: str,
) -> LineupSpec:
    """Expand ``conv`` into a lazily generated stream of jobs."""
    from interlens.scheduler import JobSpec, LineupSpec

    ambient = ambient_conditions()
    if ambient:
        conv = conv.run_until(*ambient)
    if not conv._conditions():
        raise ConfigurationError(
            f"lineup {lineup!r} would never stop: set .turns(n) or add a stop condition with .run_until(...)"
        )
    check_analyzer(conv.analyzer_fn)
    needs_device = any(p.needs_device for p in conv.participants)
    data = conv.data_source
    if data is not None:
        columns = getattr(data, "column_names", None)
        missing = sorted(_template_columns(conv) - set(columns)) if isinstance(columns, list) else []
        if missing:
            from ._exceptions import MissingColumnError

            raise MissingColumnError(
                f"lineup {lineup!r} uses dataset_field({missing[0]!r}) but the data has no column "
                f"{missing[0]!r}; available columns: {sorted(columns or [])}"
            )
        rows, total = _rows(data, n)
        base = conv.data(None)

        def jobs() -> Iterator[JobSpec]:
            for i, row in enumerate(rows):
                job_id = f"{prefix}row_{i:05d}"
                try:
                    job = ConversationJob(_expand_one(base, row, i, seed + i), needs_device)
                except InterlensError as exc:
                    job = ConversationJob(base, needs_device, error=exc)
                yield JobSpec(job_id=job_id, lineup=lineup, seed=seed + i, job=job, row_index=i)

        return LineupSpec(
            name=lineup,
            fingerprint=conv.fingerprint(),
            jobs=jobs(),
            n_jobs=total,
            describe=conv.recipe_json(strict=False),
        )
    if any(
        is_templated(v)
        for v in (
            conv.shared_context,
            conv.shared_system_prompt,
            *(p.system_prompt for p in conv.participants),
        )
    ):
        raise TemplateError(
            f"lineup {lineup!r} is templated with dataset_field/callables but has no data: "
            "attach rows with .data(...)"
        )
    count = 1 if n is None else n
    if not isinstance(count, int) or count < 0:
        raise ConfigurationError(f"n must be a non-negative int, got {n!r}")

    def samples() -> Iterator[JobSpec]:
        for i in range(count):
            job_id = single_job_id if single_job_id is not None and count == 1 else f"{prefix}rollout_{i:04d}"
            yield JobSpec(
                job_id=job_id,
                lineup=lineup,
                seed=seed + i,
                job=ConversationJob(_expand_one(conv, None, None, seed + i), needs_device),
            )

    return LineupSpec(
        name=lineup,
        fingerprint=conv.fingerprint(),
        jobs=samples(),
        n_jobs=count,
        describe=conv.recipe_json(strict=False),
    )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("interlens", "torch", "transformers", "datasets", "openai", "anthropic"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


async def _execute(lineups: Sequence[tuple[Conversation, LineupSpec]], options: Options) -> RunReport:
    """Run the expanded lineups; every option was checked by ``parse_options`` in the user's call."""
    from interlens.scheduler import available_devices, run_jobs, validate_devices

    from ._report import RunReport

    devices = options.devices
    if devices is None:  # only local models need a device: don't import torch to run scripted or API jobs
        local = any(p.needs_device for conv, _ in lineups for p in conv.participants)
        devices = available_devices() if local else ["cpu"]
    try:
        devices = validate_devices(devices)  # before out_dir is created: a refused call leaves nothing
    except Exception as exc:
        raise translate(exc) from None
    if len(devices) > 1:  # local-model jobs run in worker processes
        for conv, spec in lineups:
            if any(p.needs_device for p in conv.participants):
                check_shippable(conv.analyzer_fn, lineup=spec.name)
    prepare_out_dir(options)
    try:
        outcome = await run_jobs(
            [spec for _, spec in lineups],
            devices=devices,
            out_dir=options.out_dir,
            resume=options.resume,
            mode=options.mode,
            progress=options.progress,
            versions=_versions(),
            worker_init=worker_hooks(conv.analyzer_fn for conv, _ in lineups),
            **options.scheduler,
        )
    except Exception as exc:
        raise translate(exc) from exc.__cause__
    report = RunReport(outcome, {spec.name: conv for conv, spec in lineups})
    _warn_failures(report, options.caller)
    return report


def _warn_failures(report: RunReport, caller: str) -> None:
    """Say at the end of a run that jobs failed: a run whose every job failed must not look like success."""
    failed = report.failed
    if not failed:
        return
    total = len(report.results)
    first = report.results[failed[0]].error
    why = f"{first.type}: {first.message}" if first is not None else "no error recorded"
    if total == 1:
        how_many = "its only job"
    elif len(failed) == total:
        how_many = f"all {total} jobs"
    else:
        how_many = f"{len(failed)} of {total} jobs"
    where = f"; they are kept in the ledger in {report.out_dir}" if report.out_dir is not None else ""
    log.warning(
        "%s() finished but %s failed. The first, %s, failed with %s. The failed ids are in report.failed and "
        "each error in report.results[job_id].error%s",
        caller,
        how_many,
        failed[0],
        _shorten(why),
        where,
    )


def _shorten(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _lineups(conversations: Iterable[Conversation], seed: int) -> list[tuple[Conversation, LineupSpec]]:
    from ._conversation import Conversation

    convs = list(conversations) if not isinstance(conversations, Conversation) else [conversations]
    if not convs:
        raise ConfigurationError("run() needs at least one Conversation")
    out = []
    for i, conv in enumerate(convs):
        if not isinstance(conv, Conversation):
            raise ConfigurationError(
                f"run() takes Conversation objects, got {type(conv).__name__} at index {i}"
            )
        name = conv.name() or f"conv{i}"
        single = name if conv.data_source is None else None
        out.append(
            (conv, lineup_spec(conv, None, seed=seed, prefix=f"{name}/", single_job_id=single, lineup=name))
        )
    names = [spec.name for _, spec in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(
            f"two lineups share the name(s) {duplicates}: give each a distinct .name(...)"
        )
    return out


async def _arun(conversations: Iterable[Conversation], options: Options) -> RunReport:
    from ._conversation import Conversation

    if not isinstance(conversations, Conversation) and (
        isinstance(conversations, str | bytes | Mapping) or not isinstance(conversations, Iterable)
    ):
        raise ConfigurationTypeError(
            f"{options.caller}() takes a list of Conversation objects (one per lineup), got "
            f"{type(conversations).__name__}; e.g. {options.caller}([pair, solo], out_dir='runs/x')"
        )
    return await _execute(_lineups(conversations, options.seed), options)


async def arun(conversations: Iterable[Conversation], **options: Unpack[RunOptions]) -> RunReport:
    """Async twin of :func:`run` (works under top-level await)."""
    return await _arun(conversations, parse_options("arun", options))


def run(conversations: Iterable[Conversation], **options: Unpack[RunOptions]) -> RunReport:
    """Run many lineups in one pool under one ``out_dir``/resume namespace.

    Each conversation expands to its own jobs (one per ``.data()`` row, else a single job), namespaced by its
    ``.name()``: ``pair_7b``, ``gpqa/row_00000``... (unnamed lineups are ``conv0``, ``conv1``...).

    Options (keyword only; checked before anything runs, an unknown one is refused):
    ``devices`` (None: every visible GPU, or the CPU when no local model; else a list such as
    ``["cuda:0", "cuda:1"]``), ``out_dir`` (None: in memory; a directory: checkpointed and resumable),
    ``seed`` (0; per-job seeds are seed, seed+1, ...), ``resume`` (True; False moves an old ledger aside and
    starts fresh), ``batched`` (True) or ``mode`` (``ExecutionMode.BATCHED``; ``DETERMINISTIC`` is
    ``batched=False``), ``max_batch_size`` (64), ``max_concurrency`` (256), ``max_attempts`` (3), ``progress``
    (None: a bar when interactive), ``max_batch_wait`` (0.05 s), ``worker_start_timeout`` (300 s).
    Failed jobs do not raise: they are in ``report.failed``, and a warning on the ``interlens`` logger says
    how many failed and why the first did.
    """
    from interlens.scheduler import run_sync

    return run_sync(_arun, conversations, parse_options("run", options))


async def _arollout(conv: Conversation, n: int | None, options: Options) -> RunReport:
    from ._conversation import Conversation

    if not isinstance(conv, Conversation):
        raise ConfigurationTypeError(
            f"{options.caller}() rolls out a Conversation, got {type(conv).__name__}; call "
            f"conv.{options.caller}(n=...) on a Conversation"
        )
    lineup = conv.name() or "rollout"
    spec = lineup_spec(conv, n, seed=options.seed, prefix="", single_job_id=None, lineup=lineup)
    return await _execute([(conv, spec)], options)


async def arollout(conv: Conversation, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
    """Async twin of :func:`rollout` (works under top-level await)."""
    return await _arollout(conv, check_n("arollout", n), parse_options("arollout", options))


def rollout(conv: Conversation, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
    """Run ``n`` independent copies of ``conv`` (default one, or one per data row); options as :func:`run`."""
    from interlens.scheduler import run_sync

    return run_sync(_arollout, conv, check_n("rollout", n), parse_options("rollout", options))
