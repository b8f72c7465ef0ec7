"""From conversations to scheduler jobs and back: ``rollout``, ``run`` and their async twins.

A lineup (one Conversation) expands lazily into jobs: one per sample (``rollout_0000``...) or per data row
(``row_00000``...), each an independent copy with its templates resolved for its row and its own seed, and
with the fingerprint of what it is asked (``_inputs``), which a rerun compares. The scheduler runs them; this
module only translates between the two worlds.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Unpack

from ._analyzers import check_analyzer, check_shippable, run_analyzer, worker_hooks
from ._exceptions import ConfigurationError, ConfigurationTypeError, InterlensError, TemplateError, translate
from ._inputs import explain_change, input_fingerprint
from ._model_participant import CURRENT_JOB
from ._options import Options, RunOptions, check_n, parse_options, prepare_out_dir
from ._participant import Participant
from ._stop import ambient_conditions
from ._templating import DatasetField, is_templated, resolve

if TYPE_CHECKING:
    from interlens.scheduler import ExecutionMode, JobContext, JobResult, JobSpec, LineupSpec

    from ._conversation import Conversation
    from ._report import RunReport

__all__ = ["arollout", "arun", "rollout", "run", "turn_seed"]

log = logging.getLogger("interlens")


def _mix(*parts: int | str) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def turn_seed(conv: Conversation, participant: Participant, *, sample: int | None = None) -> int | None:
    """The sampling seed of the next turn of ``participant``, or None for torch's global RNG.

    Inside a rollout EVERY local turn is seeded, in both execution modes, from (participant ``seed=`` or 0,
    the rollout seed of this job, the job's id, the turn index): two jobs, two lineups of one ``run`` or two
    turns never share a random stream, and rerunning the same recipe with the same ``seed=`` draws the same
    random numbers for every turn. What that buys depends on the mode:

    * ``batched=False`` (deterministic): each turn is generated alone, so a rollout is token-identical on
      the same hardware and software, whatever else runs beside it.
    * batched (the default): the turn's random draws are the same, but its logits come from a batched
      forward pass whose other rows (and their padding) depend on timing, and a turn that happens to run
      alone may continue its stream's kept KV cache (logits a few ulps off a fresh prefill). The tokens
      are reproducible only where the forward pass is batch-invariant, i.e. gives each row bitwise the same
      logits whatever its batch mates; it is for the tiny test models on CPU, it generally is NOT on GPUs
      (kernels pick different reduction orders for different batch shapes). Otherwise a rerun is
      reproducible in distribution only: same seeds, same sampling law, possibly different tokens.

    ``sample`` numbers the ``conv.sample()`` calls made on this conversation object (1, 2, ...): each gets a
    stream of its own, so an analyzer that samples five times gets five draws, the same five on a rerun,
    and a sample never shifts the seed of a turn. Outside a rollout (``conv.run()``, ``conv.sample()`` on a
    result) a participant with ``seed=`` is seeded the same way without a job id; one without a seed draws
    from torch's global RNG.
    """
    job = CURRENT_JOB.get()
    pinned = getattr(participant, "seed", None)
    if job is None and pinned is None:
        return None
    parts: list[int | str] = [pinned or 0, conv.seed or 0, job.job_id if job is not None else ""]
    parts.append(conv.generated_turns)
    if sample is not None:
        parts += ["sample", sample]
    return _mix(*parts)


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


def _rows(data: Any, n: int | None, lineup: str) -> tuple[Callable[[], Iterator[Any]], bool, int | None]:
    """How to read at most ``n`` rows of ``data``: a function that starts a fresh read, whether a second
    read is possible (not for a one-shot iterator), and the number of rows when known."""
    from ._conversation import OnceRows

    if isinstance(data, OnceRows):
        if data.read:
            raise OnceRows.consumed_error(lineup)
        return lambda: itertools.islice(iter(data), n), False, n
    if callable(data) and not isinstance(data, Iterable):
        return lambda: itertools.islice(iter(_call_rows(data, lineup)), n), True, n
    try:
        total: int | None = len(data)
    except TypeError:
        total = None
    if n is not None:
        total = n if total is None else min(n, total)
    return lambda: itertools.islice(iter(data), n), True, total


def _call_rows(make: Callable[[], Any], lineup: str) -> Iterable[Any]:
    rows = make()
    if rows is None or isinstance(rows, str | bytes) or not isinstance(rows, Iterable):
        raise ConfigurationError(
            f"lineup {lineup!r}: the callable given to .data() must return an iterable of rows (a list, a "
            f"generator, a Dataset), got {type(rows).__name__}"
        )
    return rows


class _Jobs:
    """A lineup's jobs, expanded afresh on every iteration.

    On a resumed run the scheduler reads a lineup twice: once before anything starts, to compare what the
    jobs already in the ledger are asked now with what they were asked, then to run. Rows from a one-shot
    iterator cannot be read twice; their lineup hands the scheduler a plain generator instead.
    """

    def __init__(self, expand: Callable[[], Iterator[JobSpec]]) -> None:
        self._expand = expand

    def __iter__(self) -> Iterator[JobSpec]:
        return self._expand()


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
    mode: ExecutionMode,
    prefix: str | None,
    single_job_id: str | None,
    lineup: str,
) -> LineupSpec:
    """Expand ``conv`` into a lazily generated stream of jobs, each fingerprinted with what it is asked."""
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
    settings = conv.fingerprint()

    def job_spec(base: Conversation, job_id: str, i: int, row: Any, row_index: int | None) -> JobSpec:
        expanded: Conversation | None = None
        try:
            expanded = _expand_one(base, row, row_index, seed + i)
            job = ConversationJob(expanded, needs_device)
        except InterlensError as exc:  # a row that cannot be expanded fails its own job only
            job = ConversationJob(base, needs_device, error=exc)
        fingerprint = input_fingerprint(expanded, row=row, seed=seed + i, mode=mode.value, settings=settings)
        return JobSpec(
            job_id=job_id, lineup=lineup, seed=seed + i, job=job, row_index=row_index, input_fp=fingerprint
        )

    data = conv._recipe.data
    if data is not None:
        columns = getattr(data, "column_names", None)
        missing = sorted(_template_columns(conv) - set(columns)) if isinstance(columns, list) else []
        if missing:
            from ._exceptions import MissingColumnError

            raise MissingColumnError(
                f"lineup {lineup!r} uses dataset_field({missing[0]!r}) but the data has no column "
                f"{missing[0]!r}; available columns: {sorted(columns or [])}"
            )
        read, again, total = _rows(data, n, lineup)
        base = conv.data(None)

        def jobs() -> Iterator[JobSpec]:
            for i, row in enumerate(read()):
                yield job_spec(base, f"{prefix}row_{i:05d}", i, row, i)

        return LineupSpec(
            name=lineup,
            fingerprint=settings,
            jobs=_Jobs(jobs) if again else jobs(),
            n_jobs=total,
            describe=conv.recipe_json(strict=False),
            explain_input=explain_change,
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
            yield job_spec(conv, job_id, i, None, None)

    return LineupSpec(
        name=lineup,
        fingerprint=settings,
        jobs=_Jobs(samples),
        n_jobs=count,
        describe=conv.recipe_json(strict=False),
        explain_input=explain_change,
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


def _lineups(
    conversations: Iterable[Conversation], seed: int, mode: ExecutionMode
) -> list[tuple[Conversation, LineupSpec]]:
    from ._conversation import Conversation, OnceRows

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
        spec = lineup_spec(
            conv, None, seed=seed, mode=mode, prefix=f"{name}/", single_job_id=single, lineup=name
        )
        out.append((conv, spec))
    once = [conv._recipe.data for conv, _ in out if isinstance(conv._recipe.data, OnceRows)]
    if len({id(rows) for rows in once}) < len(once):  # the second lineup would get what the first left
        raise OnceRows.consumed_error()
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
    return await _execute(_lineups(conversations, options.seed, options.mode), options)


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
    spec = lineup_spec(
        conv, n, seed=options.seed, mode=options.mode, prefix="", single_job_id=None, lineup=lineup
    )
    return await _execute([(conv, spec)], options)


async def arollout(conv: Conversation, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
    """Async twin of :func:`rollout` (works under top-level await)."""
    return await _arollout(conv, check_n("arollout", n), parse_options("arollout", options))


def rollout(conv: Conversation, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
    """Run ``n`` independent copies of ``conv`` (default one, or one per data row); options as :func:`run`."""
    from interlens.scheduler import run_sync

    return run_sync(_arollout, conv, check_n("rollout", n), parse_options("rollout", options))
