"""The job pool: lazy pulling, bounded concurrency, lineups sharing one pool, bad input, progress."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from scheduler_testkit import EchoSpec, TurnsJob, lineup

from interlens.scheduler import (
    DuplicateJobError,
    ExecutionMode,
    JobContext,
    JobResult,
    JobSpec,
    LineupSpec,
    RunConfig,
    SchedulerConfigError,
    run_jobs,
)
from interlens.store import LedgerReader


class Meter:
    """Counts pulled, live and finished jobs, and the worst "pulled but not finished" seen."""

    def __init__(self) -> None:
        self.pulled = self.live = self.finished = 0
        self.max_ahead = self.max_live = 0

    def jobs(
        self, name: str, n: int, *, needs_device: bool, spec: EchoSpec | None = None
    ) -> Iterator[JobSpec]:
        for i in range(n):
            self.pulled += 1
            self.max_ahead = max(self.max_ahead, self.pulled - self.finished)
            yield JobSpec(f"{name}/{i:05d}", name, seed=i, job=MeteredJob(self, needs_device, spec))


class MeteredJob:
    def __init__(self, meter: Meter, needs_device: bool, spec: EchoSpec | None) -> None:
        self.meter, self.needs_device, self.spec = meter, needs_device, spec

    async def run(self, ctx: JobContext) -> JobResult:
        m = self.meter
        m.live += 1
        m.max_live = max(m.max_live, m.live)
        try:
            if self.spec is not None:
                await ctx.generate(self.spec, ctx.job_id)
            else:
                await anyio.lowlevel.checkpoint()
        finally:
            m.live -= 1
            m.finished += 1
        return JobResult(conversation={"id": ctx.job_id})

    def is_transient(self, exc: BaseException) -> bool:
        return False


async def test_jobs_are_pulled_lazily_within_the_concurrency_bound() -> None:
    meter = Meter()
    stream = LineupSpec("big", "fp", jobs=meter.jobs("big", 5_000, needs_device=False))  # length unknown
    with anyio.fail_after(60):
        out = await run_jobs(
            [stream], RunConfig(devices=["cpu"], out_dir=None, max_concurrency=8, max_batch_size=4)
        )
    assert out.counts["done"] == 5_000 and meter.finished == 5_000
    assert meter.max_live == 8  # the bound is used...
    # ...and the generator is never drained far ahead of it: 8 live, at most 1.5 x (8 + 4) recorded ahead of
    # their start (jobs reach the ledger a chunk at a time, a chunk holds at most what the pools hold), +1.
    assert meter.max_ahead <= 8 + 18 + 1


async def test_device_jobs_are_bounded_by_the_batch_size_per_worker() -> None:
    meter, spec = Meter(), EchoSpec("m")
    stream = LineupSpec("d", "fp", jobs=meter.jobs("d", 200, needs_device=True, spec=spec))
    with anyio.fail_after(30):
        await run_jobs(
            [stream], RunConfig(devices=["cpu"], out_dir=None, max_batch_size=16, max_concurrency=1000)
        )
    assert meter.max_live == 16
    assert max(spec.engine.sizes) == 16 and sum(spec.engine.sizes) == 200


async def test_lineups_share_one_pool_and_the_ledger_records_each(tmp_path: Path) -> None:
    spec = EchoSpec("m")
    pair = lineup("pair", [TurnsJob([spec], turns=2) for _ in range(3)])
    solo = lineup("solo", [TurnsJob([spec], turns=2) for _ in range(3)])
    scripted = lineup("scripted", [TurnsJob(needs_device=False) for _ in range(2)])
    with anyio.fail_after(20):
        out = await run_jobs(
            [pair, solo, scripted], RunConfig(devices=["cpu"], out_dir=tmp_path, max_batch_wait=60.0)
        )
    assert out.job_ids == [
        f"{n}/{i:04d}" for n, k in (("pair", 3), ("solo", 3), ("scripted", 2)) for i in range(k)
    ]
    assert spec.engine.sizes == [6, 6]  # both lineups' turns co-step on the shared model
    with LedgerReader(tmp_path) as reader:
        assert reader.runs()[0]["lineups"] == {
            "pair": "fp-pair",
            "solo": "fp-solo",
            "scripted": "fp-scripted",
        }
        assert reader.job("solo/0001").lineup == "solo"


def _untouched() -> Iterator[JobSpec]:
    raise AssertionError("no job may be pulled when the run is refused up front")
    yield  # pragma: no cover


async def test_two_lineups_with_one_name_are_refused_before_anything_runs(tmp_path: Path) -> None:
    a1, a2 = LineupSpec("a", "fp", jobs=_untouched()), LineupSpec("a", "fp2", jobs=_untouched())
    with pytest.raises(DuplicateJobError, match="two lineups are named 'a'"):
        await run_jobs([a1, a2], RunConfig(devices=["cpu"], out_dir=tmp_path))
    assert not (tmp_path / "ledger.sqlite").exists()


@pytest.mark.parametrize("concurrency", [1, 8], ids=["one-after-the-other", "both-live"])
@pytest.mark.parametrize("with_ledger", [False, True], ids=["memory", "ledger"])
async def test_a_job_id_pulled_twice_is_an_error(tmp_path: Path, concurrency: int, with_ledger: bool) -> None:
    a = lineup("a", [JobSpec("x", "a", seed=0, job=TurnsJob(needs_device=False))])
    b = lineup("b", [JobSpec("x", "b", seed=0, job=TurnsJob(needs_device=False))])
    out_dir = tmp_path if with_ledger else None
    with pytest.raises(DuplicateJobError, match="job id 'x' occurs twice"):
        await run_jobs([a, b], RunConfig(devices=["cpu"], out_dir=out_dir, max_concurrency=concurrency))
    if with_ledger:
        with LedgerReader(tmp_path) as reader:
            assert reader.runs()[-1]["status"] == "failed"


async def test_a_job_claiming_another_lineup_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    stray = LineupSpec("a", "fp", jobs=iter([JobSpec("b/1", "b", seed=0, job=TurnsJob(needs_device=False))]))
    with pytest.raises(SchedulerConfigError, match="belongs to lineup 'b' but came from lineup 'a'"):
        await run_jobs([stray], RunConfig(devices=["cpu"], out_dir=tmp_path))
    with LedgerReader(tmp_path) as reader:  # the ledger was closed properly: the run is marked failed
        assert [r["status"] for r in reader.runs()] == ["failed"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be an int >= 1"),
        ({"max_concurrency": 2.5}, "max_concurrency must be an int >= 1"),
        ({"max_attempts": 0}, "max_attempts must be an int >= 1"),
        ({"max_batch_wait": -1}, "max_batch_wait must be a number of seconds >= 0"),
        ({"mode": "batched"}, "mode must be an ExecutionMode"),
        ({"versions": {"torch": 2}}, "versions must map str to str"),
        ({"out_dir": 3}, "out_dir must be a path"),
    ],
)
async def test_bad_arguments_are_refused_with_the_fix(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"devices": ["cpu"], "out_dir": None, **kwargs}
    with pytest.raises(SchedulerConfigError, match=message):
        await run_jobs([LineupSpec("a", "fp", jobs=_untouched())], RunConfig(**args))


def test_run_config_check_names_the_caller_and_tells_a_wrong_type_from_a_bad_value() -> None:
    """``RunConfig.check`` is the one checker of the run options: ``where`` (the user's call) starts each
    message, and a wrong type is also a ``TypeError`` (interlens raises its type-error twin for it)."""
    with pytest.raises(
        SchedulerConfigError, match=r"^rollout\(\): max_batch_size must be an int >= 1, got 0$"
    ):
        RunConfig(max_batch_size=0).check(where="rollout()")
    with pytest.raises(TypeError, match=r"^rollout\(\): resume must be True or False, got 'no' \(str\); "):
        RunConfig(resume="no").check(where="rollout()")  # type: ignore[arg-type]
    with pytest.raises(SchedulerConfigError) as info:
        RunConfig(max_batch_size=0).check()
    assert not isinstance(info.value, TypeError)
    RunConfig().check()  # the defaults pass; devices=None is run_jobs' question (only with a cluster)


async def test_devices_none_is_refused_without_a_cluster() -> None:
    with pytest.raises(SchedulerConfigError, match=r"None only with cluster='ray'"):
        await run_jobs([LineupSpec("a", "fp", jobs=_untouched())], RunConfig(out_dir=None))


async def test_a_single_lineup_must_be_wrapped_in_a_list() -> None:
    with pytest.raises(SchedulerConfigError, match=r"wrap the single lineup: \[lineup\]"):
        await run_jobs(LineupSpec("a", "fp", jobs=_untouched()), RunConfig(devices=["cpu"], out_dir=None))


async def test_progress_bar_shows_counts_only_when_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # progress=None means on inside a Jupyter kernel, which is judged by ipykernel being imported: an earlier
    # test (the notebook one) may have imported it into this process
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    jobs = [TurnsJob(needs_device=False) for _ in range(3)] + [TurnsJob(needs_device=False, raise_on_turn=0)]
    await run_jobs([lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, progress=True))
    err = capsys.readouterr().err
    assert "4/4" in err and "done=3" in err and "failed=1" in err and "tok_s=" in err
    await run_jobs(
        [lineup("b", [TurnsJob(needs_device=False)])], RunConfig(devices=["cpu"], out_dir=None, progress=None)
    )
    await run_jobs(
        [lineup("c", [TurnsJob(needs_device=False)])],
        RunConfig(devices=["cpu"], out_dir=None, progress=False),
    )
    assert capsys.readouterr() == ("", "")  # stderr is not a terminal here: None means off


async def test_context_carries_the_job_identity() -> None:
    job = TurnsJob(needs_device=False)
    spec = JobSpec("only", "a", seed=1234, job=job, row_index=7)
    out = await run_jobs(
        [LineupSpec("a", "fp", jobs=[spec])],
        RunConfig(devices=["cpu"], out_dir=None, mode=ExecutionMode.BATCHED),
    )
    assert job.seen == [
        {"attempt": 1, "device": "host", "mode": ExecutionMode.BATCHED, "seed": 1234, "committed": []}
    ]
    res = out.outcome("only")
    assert (res.lineup, res.row_index, res.seed) == ("a", 7, 1234)
