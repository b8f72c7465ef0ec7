"""Failure isolation: one job's exception, retry, analyzer failure or bad value never touches another job."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduler_testkit import EchoSpec, TransientError, TurnsJob, lineup

from interlens.scheduler import RunConfig, run_jobs
from interlens.store import LedgerReader


@pytest.fixture(params=["memory", "ledger"])
def out_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path | None:
    """Every behaviour here must be the same with and without a ledger."""
    return None if request.param == "memory" else tmp_path / "run"


async def test_a_job_exception_fails_that_job_only(out_dir: Path | None) -> None:
    spec = EchoSpec("m")
    jobs = [TurnsJob([spec], turns=3) for _ in range(7)] + [TurnsJob([spec], turns=3, raise_on_turn=1)]
    out = await run_jobs([lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=out_dir))
    assert out.failed == ["a/0007"] and len(out.done) == 7
    res = out.outcome("a/0007")
    assert res.state == "failed" and res.conversation is None and res.attempts == 1
    assert (
        res.error is not None and res.error.type == "KeyError" and "row broke at turn 1" in res.error.message
    )
    assert 'raise KeyError(f"row broke at turn {i}")' in res.error.traceback
    assert out.counts == {"total": 8, "done": 7, "failed": 1, "skipped": 0}
    if out_dir is not None:  # the turn committed before the failure is kept, for the next run to resume
        with LedgerReader(out_dir) as reader:
            assert [t["index"] for t in reader.turns("a/0007")] == [0]
            assert reader.job("a/0007").error_type == "KeyError"


async def test_transient_failure_is_retried_and_resumes_from_committed_turns(out_dir: Path | None) -> None:
    spec = EchoSpec("m")
    flaky = TurnsJob([spec], turns=3, transient_failures=2, transient_at_turn=2)
    out = await run_jobs(
        [lineup("a", [flaky, TurnsJob([spec])])], RunConfig(devices=["cpu"], out_dir=out_dir, max_attempts=3)
    )
    assert out.failed == [] and len(out.done) == 2
    assert [s["attempt"] for s in flaky.seen] == [1, 2, 3]
    # Attempts 2 and 3 start from the two turns attempt 1 committed instead of regenerating them.
    assert [len(s["committed"]) for s in flaky.seen] == [0, 2, 2]
    res = out.outcome("a/0000")
    assert res.attempts == 3 and [t["index"] for t in res.conversation["turns"]] == [0, 1, 2]
    requests = [r for batch in spec.engine.batches for r in batch if r.startswith("a/0000")]
    assert requests == ["a/0000:0", "a/0000:1", "a/0000:2"]  # every turn generated exactly once
    if out_dir is not None:
        with LedgerReader(out_dir) as reader:
            assert reader.job("a/0000").attempts == 3


async def test_retries_stop_at_max_attempts(out_dir: Path | None) -> None:
    always = TurnsJob(turns=1, needs_device=False, transient_failures=99)
    out = await run_jobs([lineup("a", [always])], RunConfig(devices=["cpu"], out_dir=out_dir, max_attempts=2))
    res = out.outcome("a/0000")
    assert res.state == "failed" and res.attempts == 2 and len(always.seen) == 2
    assert res.error is not None and res.error.type == TransientError.__qualname__


async def test_a_permanent_failure_is_not_retried(out_dir: Path | None) -> None:
    job = TurnsJob(turns=2, needs_device=False, raise_on_turn=0)
    out = await run_jobs([lineup("a", [job])], RunConfig(devices=["cpu"], out_dir=out_dir, max_attempts=5))
    assert out.outcome("a/0000").attempts == 1 and len(job.seen) == 1


async def test_failed_analyzer_is_recorded_as_failed_with_its_conversation(out_dir: Path | None) -> None:
    spec = EchoSpec("m")
    job = TurnsJob([spec], turns=2, analysis_error=ZeroDivisionError("analyzer divided by zero"))
    out = await run_jobs(
        [lineup("a", [job, TurnsJob([spec], turns=2)])], RunConfig(devices=["cpu"], out_dir=out_dir)
    )
    assert out.failed == ["a/0000"] and out.done == ["a/0001"]
    res = out.outcome("a/0000")
    assert res.error is not None and res.error.type == "ZeroDivisionError"
    assert res.error.message == "analyzer divided by zero"
    assert res.conversation == {
        "job": "a/0000",
        "turns": [{"index": 0, "text": "m(a/0000:0)"}, {"index": 1, "text": "m(a/0000:1)"}],
    }
    assert res.tokens_generated == 20 and res.attempts == 1  # not retried: the conversation is finished


async def test_rerun_after_a_failed_analyzer_replays_the_conversation_without_generating(
    tmp_path: Path,
) -> None:
    spec = EchoSpec("m")
    broken = TurnsJob([spec], turns=2, analysis_error=ValueError("bad analyzer"))
    await run_jobs([lineup("a", [broken])], RunConfig(devices=["cpu"], out_dir=tmp_path))
    fixed = EchoSpec("m")
    job = TurnsJob([fixed], turns=2)
    out = await run_jobs([lineup("a", [job])], RunConfig(devices=["cpu"], out_dir=tmp_path))
    assert out.done == ["a/0000"] and out.outcome("a/0000").analysis == {"n_turns": 2}
    assert len(job.seen[0]["committed"]) == 2 and fixed.loads == []  # nothing regenerated


async def test_unstorable_result_fails_that_job_only(out_dir: Path | None) -> None:
    bad = TurnsJob(turns=1, needs_device=False, conversation_extra={"when": object()})
    out = await run_jobs(
        [lineup("a", [bad, TurnsJob(turns=1, needs_device=False)])],
        RunConfig(devices=["cpu"], out_dir=out_dir),
    )
    assert out.failed == ["a/0000"] and out.done == ["a/0001"]
    err = out.outcome("a/0000").error
    assert err is not None and err.type == "TypeError" and "JSON" in err.message


async def test_run_returning_something_else_than_a_jobresult_is_a_clear_failure(out_dir: Path | None) -> None:
    class Sloppy(TurnsJob):
        async def run(self, ctx):
            return {"turns": []}

    out = await run_jobs(
        [lineup("a", [Sloppy(needs_device=False)])], RunConfig(devices=["cpu"], out_dir=out_dir)
    )
    err = out.outcome("a/0000").error
    assert err is not None and err.type == "TypeError" and "must return a JobResult" in err.message


async def test_a_broken_is_transient_means_no_retry(out_dir: Path | None) -> None:
    class Confused(TurnsJob):
        def is_transient(self, exc: BaseException) -> bool:
            raise RuntimeError("classifier bug")

    job = Confused(needs_device=False, transient_failures=5)
    out = await run_jobs([lineup("a", [job])], RunConfig(devices=["cpu"], out_dir=out_dir))
    res = out.outcome("a/0000")
    assert res.state == "failed" and res.attempts == 1 and res.error.type == "TransientError"


async def test_scripted_jobs_run_on_the_host_worker(out_dir: Path | None) -> None:
    jobs = [TurnsJob(turns=2, needs_device=False) for _ in range(3)]
    out = await run_jobs([lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=out_dir))
    assert out.done == ["a/0000", "a/0001", "a/0002"]
    assert {j.seen[0]["device"] for j in jobs} == {"host"} and out.outcome("a/0002").device == "host"
    assert out.outcome("a/0002").conversation == {
        "job": "a/0002",
        "turns": [{"index": 0, "text": "scripted 0"}, {"index": 1, "text": "scripted 1"}],
    }
