"""From conversations to scheduler jobs and back: ``Conversation.rollout`` and the pool ``run`` shares.

A lineup (one Conversation) expands lazily into jobs: one per sample (``rollout_0000``...) or per data row
(``row_00000``...), each an independent copy made by ``Conversation.for_row`` (templates resolved for its row,
its own seed), with the fingerprint of what it is asked (``_inputs``), which a rerun compares. The scheduler
runs them (:class:`ConversationJob`); :func:`execute` runs a run's lineups and wraps the outcome in a
``RunReport``. This module only translates between the two worlds.

It imports ``Conversation`` for type checking only: ``Conversation.rollout`` imports this module (the one lazy
import of the package), so imports run one way, rollout → report → conversation → context.
``interlens.run``, which must check it was given Conversations, lives in ``_run_lineups``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Unpack

from .._core import (
    NO_TIME_LIMITS,
    TIME_LIMITS,
    TOKENS_KEY,
    ConfigurationError,
    DatasetField,
    DataSourceError,
    GenerationError,
    InterlensError,
    InterpModeError,
    Message,
    MissingColumnError,
    TemplateError,
    TimeLimits,
    ambient_conditions,
    as_interlens_errors,
    collecting_samples,
    escape_controls,
    in_job,
    is_templated,
    warn_no_rows,
)
from ..report import PARENT_KEY, SAMPLES_KEY, RunReport
from ._analyzers import check_analyzer, check_shippable, run_analyzer, worker_hooks
from ._inputs import explain_change, input_fingerprint
from ._options import SEED_LIMIT, Options, RunOptions, check_n, parse_options, prepare_out_dir

if TYPE_CHECKING:
    from interlens.scheduler import ExecutionMode, JobContext, JobResult, JobSpec, LineupSpec

    from .._core import BranchPoint
    from ..conversation import Conversation

__all__ = ["arollout", "execute", "lineup_spec", "rollout"]

log = logging.getLogger("interlens")


@dataclass
class ConversationJob:
    """One expanded conversation, run by the scheduler (satisfies ``interlens.scheduler.Job``).

    A thin adapter: it replays what an earlier attempt committed, runs the conversation's own turn loop
    (``Conversation.advance``, the one live ``run`` uses) as this job, recording each turn as it ends, then
    runs the analyzer while the models are still resident.

    Its result is ``conversation.to_json()`` with the LINEUP's recipe (``recipe``, templates as written, the
    object every job of the lineup shares) in place of the expanded one: the job's row and seed are in the
    result, and ``for_row`` resolves the templates from them (as ``RunResult.conversation`` does), so the
    ledger stores the recipe once per lineup instead of once per job (it is the lineup's ``describe``).
    """

    conversation: Conversation
    needs_device: bool
    recipe: Mapping[str, Any] | None = None  # the lineup's recipe JSON; None: the expanded conversation's
    error: BaseException | None = None  # a row that could not be expanded fails its own job only
    #: ``run(record_tokens=True)``: the speakers that cannot record, by name, and why (their turns say so)
    tokens_missing: Mapping[str, str] | None = None
    limits: TimeLimits = NO_TIME_LIMITS  # turn_timeout / analyzer_timeout: a job that hangs fails, named
    parent: Mapping[str, Any] | None = None  # a branch's parent (out_dir, job id, turn), kept in its result

    async def run(self, ctx: JobContext) -> JobResult:
        from interlens.scheduler import JobResult

        if self.error is not None:
            raise self.error
        start_tokens = self.conversation.tokens_generated  # a branch's recorded turns: not this job's
        conv = self.conversation.replay(ctx.committed_turns, stream_id=ctx.job_id)

        async def record(index: int, message: Message) -> None:
            why = (self.tokens_missing or {}).get(message.author)
            if why is not None and TOKENS_KEY not in message.metadata:
                message.metadata.setdefault("tokens_missing", f"asked for (record_tokens=True): {why}")
            # a token record's prompt as a difference from its speaker's previous turn, as the result's
            # transcript will hold it (``Transcript.to_json``), so the result refers to this very turn
            recorded = conv.transcript.to_json()[-1] if TOKENS_KEY in message.metadata else message.to_json()
            await ctx.record_turn(index, recorded)

        limits = TIME_LIMITS.set(self.limits)  # read by the turn loop's TurnWatch and by run_analyzer
        try:
            with in_job(ctx):
                try:
                    await conv.advance(on_turn=record)
                except SystemExit as exc:  # sys.exit in a participant's code: its job fails, the run goes on
                    raise GenerationError(
                        f"a participant raised SystemExit({exc.code!r}) (sys.exit, or an argument parser it "
                        "called): a participant returns its turn; raise an exception to fail the job"
                    ) from exc
                # What was generated is what is stored: the record is taken before the analyzer runs, so an
                # analyzer that edits the conversation it reads (a message's text, its metadata) cannot
                # rewrite what the model said or what it spent.
                state = copy.deepcopy(conv.to_json())
                tokens_generated, generated = conv.tokens_generated - start_tokens, len(conv.transcript)
                analysis, analysis_error = None, None
                with collecting_samples() as samples:
                    if conv.analyzer_fn is not None:
                        try:
                            analysis = await run_analyzer(conv.analyzer_fn, conv)
                        except Exception as exc:
                            analysis_error = exc
        except Exception:
            await _end_conversation(conv, ctx.job_id)
            raise
        finally:
            TIME_LIMITS.reset(limits)
        await _end_conversation(conv, ctx.job_id)  # what the participants kept for it (KV caches) can go
        # messages the analyzer appended (a moderator's note) are kept, after what was generated
        state["transcript"].extend(conv.transcript.to_json()[generated:])
        if samples:  # the analyzer's samples are no turns: their metadata (usage) is kept with the result
            state[SAMPLES_KEY] = samples
        if self.recipe is not None:
            state["recipe"] = self.recipe
        if self.parent is not None:
            state[PARENT_KEY] = dict(self.parent)
        return JobResult(
            conversation=state,
            tokens_generated=tokens_generated,
            analysis=analysis,
            analysis_error=analysis_error,
        )

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError | TimeoutError) or bool(getattr(exc, "transient", False))


async def _end_conversation(conv: Conversation, stream_id: str) -> None:
    """Tell each participant that conversation ``stream_id`` is over, so it frees what it kept for it."""
    for participant in conv.participants:
        await participant.end_conversation(stream_id)


def _rows_read(rows: Iterator[Any], lineup: str) -> Iterator[tuple[int, Any]]:
    """The rows of a lineup's data with their index; a data source that fails mid-stream (a dropped
    connection, a file read error) is named with the row it reached. The jobs of the rows before it are kept
    (done ones in the ledger), and a rerun into the same out_dir resumes them and reads the data again."""
    i = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except InterlensError:
            raise
        except Exception as exc:
            raise DataSourceError(
                f"lineup {lineup!r}: reading the rows given to .data() failed at row {i} (after {i} row(s) "
                f"read) with {type(exc).__name__}: {exc}. The jobs of the rows read before it are kept: fix "
                "the data source and rerun into the same out_dir to resume them and go on"
            ) from exc
        yield i, row
        i += 1


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


def _check_job_seed(lineup: str, seed: int, i: int) -> None:
    """Job ``i`` draws from ``seed + i``; refuse a seed that would pass the ledger's 64-bit integers."""
    if seed + i >= SEED_LIMIT:
        raise ConfigurationError(
            f"lineup {lineup!r}: job {i} would draw from seed {seed} + {i} = {seed + i}, past 2**63 - 1 (the "
            f"ledger stores seeds as 64-bit integers; job i draws from seed + i). Pass a seed of at most "
            f"{SEED_LIMIT - 1 - i}."
        )


def lineup_spec(
    conv: Conversation,
    n: int | None,
    *,
    seed: int,
    mode: ExecutionMode,
    prefix: str | None,
    single_job_id: str | None,
    lineup: str,
    record_tokens: bool = False,
    limits: TimeLimits = NO_TIME_LIMITS,
    seed_given: bool = False,
) -> LineupSpec:
    """Expand ``conv`` into a lazily generated stream of jobs, each fingerprinted with what it is asked.
    ``record_tokens``: every participant that can records its turns' tokens (so the recipe a resume
    compares says so); the turns of those that cannot say why they have none."""
    from interlens.scheduler import ExecutionMode, JobSpec, LineupSpec

    unrecorded: dict[str, str] | None = None  # who cannot record, and why
    if record_tokens:
        unrecorded = {p.name: why for p in conv.participants if (why := p.token_record_problem()) is not None}
        conv = conv.set(
            participants=[
                p if p.name in unrecorded else p.replace(record_tokens=True) for p in conv.participants
            ]
        )
    if conv.generated_turns and conv.upto_turn is None:
        k = conv.generated_turns
        raise ConfigurationError(
            f"lineup {lineup!r}: this conversation has already run ({k} generated turn(s), e.g. a preview "
            "with conv.run()), so it is unclear what to roll out. Roll out conv.recipe() to start every copy "
            f"from the shared context, or conv.upto({k}) to continue every copy from its {k} turn(s)"
        )
    ambient = ambient_conditions()
    if ambient:
        conv = conv.run_until(*ambient)
    if conv.turns() is None and not conv.stop_conditions:
        raise ConfigurationError(
            f"lineup {lineup!r} would never stop: set .turns(n) or add a stop condition with .run_until(...)"
        )
    check_analyzer(conv.analyzer_fn)
    steered = [p.name for p in conv.participants if getattr(p, "steering", ())]
    if steered and mode is not ExecutionMode.DETERMINISTIC:
        raise InterpModeError(
            f"lineup {lineup!r}: participant(s) {steered} hold a steering= spec, which needs the "
            "deterministic path (the batched path generates many conversations in one forward pass, which "
            "a steered turn cannot share); pass batched=False (mode=ExecutionMode.DETERMINISTIC)"
        )
    needs_device = any(p.needs_device for p in conv.participants)

    engine_keys = _engine_keys(conv.participants)
    settings = conv.fingerprint()
    recipe = conv.recipe_json(strict=False)  # the lineup's describe, and every one of its jobs' recipe

    def spec(
        base: Conversation,
        job_id: str,
        row: Any,
        row_index: int | None,
        job_seed: int,
        point: BranchPoint | None = None,
    ) -> JobSpec:
        """One job: ``base`` expanded for ``row`` and ``job_seed`` (continued from ``point``'s recorded
        turns, for a branch), fingerprinted with what it is asked."""
        expanded: Conversation | None = None
        try:
            expanded = base.for_row(row, index=row_index, seed=job_seed)
            parent = None
            if point is not None:
                expanded, parent = point.start(expanded), point.lineage
            job = ConversationJob(
                expanded, needs_device, recipe, tokens_missing=unrecorded, limits=limits, parent=parent
            )
        except InterlensError as exc:  # a row that cannot be expanded fails its own job only
            job = ConversationJob(base, needs_device, error=exc)
        fingerprint = input_fingerprint(expanded, row=row, seed=job_seed, mode=mode.value, settings=settings)
        return JobSpec(
            job_id=job_id, lineup=lineup, seed=job_seed, job=job, row_index=row_index, input_fp=fingerprint
        )

    def job_spec(base: Conversation, job_id: str, i: int, row: Any, row_index: int | None) -> JobSpec:
        _check_job_seed(lineup, seed, i)  # data of unknown length: checked as the jobs are pulled
        return spec(base, job_id, row, row_index, seed + i)

    if conv.branch_points is not None:  # a branch recipe: n continuations of each branch point
        points = conv.branch_points
        per = points.n if n is None else n
        base = conv.data(None)

        def branch_spec(point: BranchPoint, i: int, s: int) -> JobSpec:
            # continuation s of point i: the parent job's own stream shifted by s, unless seed= was given
            job_seed = seed + i * per + s if seed_given else point.seed + s
            _check_job_seed(lineup, job_seed, 0)
            return spec(base, point.job_id(prefix or "", s), point.row, point.row_index, job_seed, point)

        def branches() -> Iterator[JobSpec]:
            for i, point in enumerate(points):
                for s in range(per):
                    yield branch_spec(point, i, s)

        return LineupSpec(
            name=lineup,
            fingerprint=settings,
            jobs=_Jobs(branches),
            n_jobs=len(points) * per,
            describe=recipe,
            explain_input=explain_change,
            engine_keys=engine_keys,
        )
    if conv.data_source is not None:
        columns = getattr(conv.data_source, "column_names", None)
        missing = sorted(_template_columns(conv) - set(columns)) if isinstance(columns, list) else []
        if missing:
            raise MissingColumnError(
                f"lineup {lineup!r} uses dataset_field({missing[0]!r}) but the data has no column "
                f"{missing[0]!r}; available columns: {sorted(columns or [])}"
            )
        rows = conv.read_rows(n, lineup=lineup)
        if rows.total:  # data of unknown length: checked as its jobs are pulled
            _check_job_seed(lineup, seed, rows.total - 1)
        base = conv.data(None)

        def jobs() -> Iterator[JobSpec]:
            i = -1
            for i, row in _rows_read(rows.read(), lineup):
                yield job_spec(base, f"{prefix}row_{i:05d}", i, row, i)
            if i < 0 and rows.total is None:  # of unknown length, and empty (known lengths: said already)
                warn_no_rows(lineup)

        return LineupSpec(
            name=lineup,
            fingerprint=settings,
            jobs=_Jobs(jobs) if rows.again else jobs(),
            n_jobs=rows.total,
            describe=recipe,
            explain_input=explain_change,
            engine_keys=engine_keys,
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
    if count:
        _check_job_seed(lineup, seed, count - 1)

    def samples() -> Iterator[JobSpec]:
        for i in range(count):
            job_id = single_job_id if single_job_id is not None and count == 1 else f"{prefix}rollout_{i:04d}"
            yield job_spec(conv, job_id, i, None, None)

    return LineupSpec(
        name=lineup,
        fingerprint=settings,
        jobs=_Jobs(samples),
        n_jobs=count,
        describe=recipe,
        explain_input=explain_change,
        engine_keys=engine_keys,
    )


def _engine_keys(participants: Sequence[Any]) -> frozenset[Hashable] | None:
    """The scheduler engines a lineup's turns use (an engine no remaining lineup needs is evicted); None when
    a participant needs a device but names no engine (its jobs may use any)."""
    keys: set[Hashable] = set()
    for p in participants:
        if not p.needs_device:
            continue
        key = getattr(p, "engine_key", None)
        if key is None:
            return None
        keys.add(key)
    return frozenset(keys)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from ..providers import PROVIDERS, provider

    sdks = dict.fromkeys(provider(name).sdk for name in PROVIDERS)  # each provider's SDK, once, in order
    out = {}
    for package in ("interlens", "torch", "transformers", "datasets", *sdks):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


async def execute(lineups: Sequence[tuple[Conversation, LineupSpec]], options: Options) -> RunReport:
    """Run the expanded lineups; every option was checked by ``parse_options`` in the user's call."""
    from interlens.scheduler import available_devices, check_ray_devices, run_jobs, validate_devices

    run = options.run
    devices = run.devices
    if run.cluster is not None:  # the cluster's devices: Ray reports them once it is joined
        with as_interlens_errors():
            devices = check_ray_devices(devices)
    else:
        if devices is None:  # only local models need a device: don't import torch for scripted or API jobs
            local = any(p.needs_device for conv, _ in lineups for p in conv.participants)
            devices = available_devices() if local else ["cpu"]
        with as_interlens_errors():
            devices = validate_devices(devices)  # before out_dir is created: a refused call leaves nothing
    if run.cluster is not None or len(devices or ()) > 1:  # local-model jobs run in other processes
        for conv, spec in lineups:
            if any(p.needs_device for p in conv.participants):
                check_shippable(conv.analyzer_fn, lineup=spec.name)
    spend = None
    if options.api_budget is not None:
        participants = [p for conv, _ in lineups for p in conv.participants if p.kind == "api"]
        models = {str(getattr(p, "model_id", "")) for p in participants}
        options.api_budget.check_models(models, where=f"{options.caller}()")
    prepare_out_dir(options)
    if options.api_budget is not None:
        spend = options.api_budget.guard(run.out_dir, resume=run.resume)
    config = dataclasses.replace(
        run,
        devices=devices,
        versions=_versions(),
        worker_init=worker_hooks(conv.analyzer_fn for conv, _ in lineups),
        spend_guard=spend,
    )
    with as_interlens_errors():
        outcome = await run_jobs([spec for _, spec in lineups], config)
    report = RunReport(outcome, {spec.name: conv for conv, spec in lineups})
    _warn_failures(report, options.caller)
    if report.stopped is not None:
        where = f" (out_dir={str(report.out_dir)!r})" if report.out_dir is not None else ""
        log.warning(
            "%s() stopped early%s: %s. %d jobs did not finish.",
            options.caller,
            where,
            report.stopped,
            report.counts.get("pending", 0),
        )
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
        escape_controls(failed[0], breaks=False),  # a job id or error cannot drive the terminal
        escape_controls(_shorten(why)),
        where,
    )


def _shorten(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _arollout(conv: Conversation, n: int | None, options: Options) -> RunReport:
    lineup = conv.name() or "rollout"
    spec = lineup_spec(
        conv,
        n,
        seed=options.seed,
        mode=options.run.mode,
        prefix="",
        single_job_id=None,
        lineup=lineup,
        record_tokens=options.record_tokens,
        limits=options.limits,
        seed_given=options.seed_given,
    )
    return await execute([(conv, spec)], options)


async def arollout(conv: Conversation, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
    """Async twin of :func:`rollout` (works under top-level await)."""
    return await _arollout(conv, check_n("arollout", n), parse_options("arollout", options))


def rollout(conv: Conversation, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
    """Run ``n`` independent copies of ``conv`` (default one, or one per data row); options as :func:`run`."""
    from interlens.scheduler import run_sync

    return run_sync(_arollout, conv, check_n("rollout", n), parse_options("rollout", options))
