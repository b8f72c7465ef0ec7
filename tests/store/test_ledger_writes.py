"""The writer API on a real SQLite file: job lifecycle, turns, results, runs, batches, group commit."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from interlens.store import (
    BatchRecord,
    JobRecord,
    Ledger,
    LedgerReader,
    StoreError,
)

VERSIONS = {"interlens": "0.1.0"}


async def _ledger(out_dir: Path, *jobs: str, **kwargs: Any) -> Ledger:
    ledger = await Ledger.open(out_dir, **kwargs)
    await ledger.begin_run({"lineup": "fp"}, versions=VERSIONS)
    await ledger.add_jobs(JobRecord(job, "lineup", seed=i) for i, job in enumerate(jobs))
    return ledger


async def test_job_lifecycle_is_recorded_and_read_back(tmp_path: Path) -> None:
    async with await _ledger(tmp_path, "rollout_2", "rollout_10", "rollout_1") as ledger:
        # Adding again (a resume) keeps the existing rows, even with other values.
        await ledger.add_jobs(
            [JobRecord("rollout_10", "other", seed=99), JobRecord("rollout_0", "lineup", seed=3)]
        )
        assert await ledger.start_job("rollout_10", device="cuda:1") == 1
        for index in (2, 0, 1):  # out of order on purpose
            await ledger.record_turn("rollout_10", index, {"speaker": "a", "content": f"turn {index}"})
        await ledger.record_turn("rollout_10", 1, {"speaker": "b", "content": "retried"})  # replaces
        assert await ledger.committed_turns("rollout_10") == [
            {"speaker": "a", "content": "turn 0"},
            {"speaker": "b", "content": "retried"},
            {"speaker": "a", "content": "turn 2"},
        ]
        await ledger.finish_job(
            "rollout_10", conversation={"transcript": ["x"]}, analysis={"score": 0.5}, tokens_generated=42
        )
        assert await ledger.done_job_ids() == {"rollout_10"}
        assert await ledger.counts() == {"pending": 3, "running": 0, "done": 1, "failed": 0}
        run_id = ledger.run_id

    with LedgerReader(tmp_path) as reader:
        assert reader.job_ids() == [
            "rollout_2",
            "rollout_10",
            "rollout_1",
            "rollout_0",
        ]  # insertion, not lexical
        job = reader.job("rollout_10")
        assert job is not None
        assert (job.lineup, job.seed, job.state, job.attempts, job.device) == (
            "lineup",
            1,
            "done",
            1,
            "cuda:1",
        )
        assert (job.tokens_generated, job.run_id, job.error_type) == (42, run_id, None)
        assert job.started_at is not None and job.finished_at is not None and job.duration_s is not None
        assert 0 <= job.duration_s < 60
        assert reader.result("rollout_10") == {
            "conversation": {"transcript": ["x"]},
            "analysis": {"score": 0.5},
            "tokens_generated": 42,
        }
        assert reader.result("rollout_2") is None and reader.job("nope") is None
        assert [t.index for t in reader.turn_records("rollout_10")] == [0, 1, 2]
        assert reader.runs()[0]["status"] == "interrupted"  # closed without end_run


async def test_failures_keep_the_error_and_a_finished_conversation(tmp_path: Path) -> None:
    async with await _ledger(tmp_path, "a", "b") as ledger:
        await ledger.start_job("a", device="cpu")
        await ledger.fail_job(
            "a",
            error_type="AnalyzerError",
            message="analyzer raised KeyError('gold')",
            traceback="Traceback (most recent call last): ...",
            conversation={"transcript": ["hi"]},
            tokens_generated=7,
        )
        await ledger.start_job("b", device="cpu")
        await ledger.fail_job("b", error_type="OutOfMemoryError", message="CUDA OOM", traceback="tb")
        with LedgerReader(tmp_path) as reader:
            a = reader.job("a")
            assert a is not None and (a.state, a.error_type, a.tokens_generated) == (
                "failed",
                "AnalyzerError",
                7,
            )
            assert a.error_message == "analyzer raised KeyError('gold')" and a.traceback is not None
            assert reader.result("a") == {
                "conversation": {"transcript": ["hi"]},
                "analysis": None,
                "tokens_generated": 7,
            }
            assert reader.result("b") is None
            assert reader.summary()["failures_by_type"] == {"AnalyzerError": 1, "OutOfMemoryError": 1}
        # A retry that succeeds clears the error of the earlier attempt.
        assert await ledger.start_job("a", device="cpu") == 2
        await ledger.finish_job("a", conversation={"transcript": ["hi"]}, analysis=1, tokens_generated=7)
    with LedgerReader(tmp_path) as reader:
        a = reader.job("a")
        assert a is not None and (a.state, a.attempts, a.error_type, a.error_message) == (
            "done",
            2,
            None,
            None,
        )


async def test_bad_calls_are_refused_with_the_job_named(tmp_path: Path) -> None:
    ledger = await Ledger.open(tmp_path)
    try:
        with pytest.raises(StoreError, match="call begin_run"):
            await ledger.finish_job("x", conversation={}, analysis=None, tokens_generated=0)
        await ledger.begin_run({"lineup": "fp"}, versions=VERSIONS)
        with pytest.raises(StoreError, match="already called"):
            await ledger.begin_run({"lineup": "fp"}, versions=VERSIONS)
        await ledger.add_jobs([JobRecord("real", "lineup", seed=0)])
        with pytest.raises(StoreError, match=r"unknown job id 'ghost'.*add_jobs"):
            await ledger.record_turn("ghost", 0, {"content": "x"})
        with pytest.raises(StoreError, match="unknown job id 'ghost'"):
            await ledger.start_job("ghost", device="cpu")
        with pytest.raises(StoreError, match="unknown job id 'ghost'"):
            await ledger.finish_job("ghost", conversation={}, analysis=None, tokens_generated=0)
        with pytest.raises(StoreError, match="unknown job id 'ghost'"):
            await ledger.fail_job("ghost", error_type="E", message="m", traceback="t")
        with pytest.raises(ValueError, match="index must be an int >= 0"):
            await ledger.record_turn("real", -1, {})
        with pytest.raises(TypeError, match="add_jobs takes JobRecord"):
            await ledger.add_jobs(cast(Any, [("real", "lineup", 0)]))
        with pytest.raises(ValueError, match="seed"):
            JobRecord("j", "lineup", seed=cast(Any, "0"))

        await ledger.start_job("real", device="cpu")
        # Not JSON: refused in the caller, naming the job and what to do; nothing is written.
        with pytest.raises(
            TypeError, match=r"the analysis of job 'real' is not JSON-serializable.*never pickle"
        ):
            await ledger.finish_job(
                "real", conversation={"t": []}, analysis={"x": object()}, tokens_generated=1
            )
        with pytest.raises(TypeError, match=r"turn 0 of job 'real'"):
            await ledger.record_turn("real", 0, {"tokens": {1, 2}})
        assert await ledger.counts() == {"pending": 0, "running": 1, "done": 0, "failed": 0}
        assert await ledger.committed_turns("real") == []

        await ledger.finish_job("real", conversation={}, analysis=None, tokens_generated=0)
        with pytest.raises(StoreError, match="already done"):
            await ledger.start_job("real", device="cpu")
        with pytest.raises(ValueError, match="end_run status must be one of"):
            await ledger.end_run("finished")
    finally:
        await ledger.close()
    with pytest.raises(StoreError, match="ledger is closed"):
        await ledger.record_turn("real", 1, {})
    await ledger.close()  # idempotent


async def test_concurrent_writes_share_transactions_and_a_bad_one_fails_alone(tmp_path: Path) -> None:
    jobs = [f"job_{i}" for i in range(50)]
    async with await _ledger(tmp_path, *jobs) as ledger:
        failures: list[BaseException] = []

        async def write(job: str, index: int) -> None:
            try:
                await ledger.record_turn(job, index, {"content": f"{job}/{index}"})
            except StoreError as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            for index in range(4):
                for job in jobs:
                    tg.start_soon(write, job, index)
                tg.start_soon(write, "ghost", index)  # an unknown job in the middle of every batch
        stats = ledger.commit_stats
        assert len(failures) == 4 and all("ghost" in str(exc) for exc in failures)
        for job in jobs:
            assert [t["content"] for t in await ledger.committed_turns(job)] == [
                f"{job}/{i}" for i in range(4)
            ]
    # 200 acknowledged writes (plus solo retries after the bad ones) in far fewer transactions.
    assert stats["operations"] >= 200
    assert stats["transactions"] < stats["operations"] / 4


async def test_requeue_running_offers_leftovers_in_job_order(tmp_path: Path) -> None:
    async with await _ledger(tmp_path, "z", "m", "a", "done") as ledger:
        for job in ("a", "z", "done"):
            await ledger.start_job(job, device="cpu")
        await ledger.record_turn("z", 0, {"content": "kept"})
        await ledger.finish_job("done", conversation={}, analysis=None, tokens_generated=0)
        await ledger.start_job("m", device="cpu")
        await ledger.return_to_pending("m")  # its worker died: back to pending, the attempt stays counted
        await ledger.return_to_pending("done")  # finished meanwhile: left alone
        with pytest.raises(StoreError, match="unknown job id"):
            await ledger.return_to_pending("ghost")
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"lineup": "fp"}, versions=VERSIONS)
        assert await ledger.requeue_running() == ["z", "a"]
        assert await ledger.requeue_running() == []
        assert await ledger.committed_turns("z") == [{"content": "kept"}]
        assert await ledger.counts() == {"pending": 3, "running": 0, "done": 1, "failed": 0}
    with LedgerReader(tmp_path) as reader:
        for job in ("z", "m", "a"):
            record = reader.job(job)
            assert record is not None and (record.state, record.attempts) == ("pending", 1)


async def test_jobs_done_before_this_run_are_listed_as_skipped(tmp_path: Path) -> None:
    async with await _ledger(tmp_path, "a", "b", "c", "d") as ledger:
        for job in ("b", "a"):
            await ledger.start_job(job, device="cpu")
            await ledger.finish_job(job, conversation={}, analysis=None, tokens_generated=1)
        await ledger.end_run("completed")
        first = ledger.run_id
    async with await Ledger.open(tmp_path) as ledger:
        second = await ledger.begin_run({"lineup": "fp"}, versions={"interlens": "0.2.0"})
        assert second > (first or 0)
        await ledger.start_job("c", device="cpu")
        await ledger.finish_job("c", conversation={}, analysis=None, tokens_generated=1)
        await ledger.start_job("d", device="cpu")
        await ledger.fail_job("d", error_type="E", message="m", traceback="t")
        with LedgerReader(tmp_path) as reader:  # while this run is live
            assert reader.job_ids(state="done", before_run=second) == ["a", "b"]
            assert reader.job_ids(run=second) == ["c", "d"]
            assert reader.job_ids(state="failed", run=second) == ["d"]
        await ledger.end_run("failed")
    with LedgerReader(tmp_path) as reader:
        runs = reader.runs()
        assert [(r["run_id"], r["status"]) for r in runs] == [(first, "completed"), (second, "failed")]
        assert runs[1]["versions"] == {"interlens": "0.2.0"} and runs[1]["lineups"] == {"lineup": "fp"}
        assert all(r["ended_at"] >= r["started_at"] for r in runs)


async def test_provider_batches_are_kept_for_reattach(tmp_path: Path) -> None:
    async with await _ledger(tmp_path, "j0", "j1") as ledger:
        requests = {"j0-t1": ("j0", 1), "j1-t1": ("j1", 1)}
        await ledger.record_batch(
            BatchRecord("openai", "batch_abc", "in_progress", requests=requests, meta={"model": "gpt-x"})
        )
        await ledger.record_batch(
            BatchRecord("anthropic", "msgbatch_1", "in_progress", requests={"c": ("j0", 2)})
        )
        await ledger.update_batch("anthropic", "msgbatch_1", state="ended")
        with pytest.raises(StoreError, match="no openai batch 'nope' was recorded"):
            await ledger.update_batch("openai", "nope", state="ended")
        with pytest.raises(ValueError, match="custom id"):
            BatchRecord("openai", "b", "s", requests=cast(Any, {"c": ("j0",)}))
    async with await Ledger.open(tmp_path) as ledger:  # a resumed run re-attaches
        (batch,) = await ledger.open_batches()
        assert (batch.provider, batch.batch_id, batch.state, batch.meta) == (
            "openai",
            "batch_abc",
            "in_progress",
            {"model": "gpt-x"},
        )
        assert dict(batch.requests) == requests and not batch.is_terminal
        await ledger.update_batch("openai", "batch_abc", state="completed", meta={"output_file_id": "file-1"})
        assert await ledger.open_batches() == []
    with LedgerReader(tmp_path) as reader:
        states = {b.batch_id: (b.state, dict(b.meta)) for b in reader.batches()}
        assert states == {
            "batch_abc": ("completed", {"output_file_id": "file-1"}),
            "msgbatch_1": ("ended", {}),
        }


async def test_cancelled_writers_leave_a_working_ledger(tmp_path: Path) -> None:
    jobs = [f"j{i}" for i in range(40)]
    async with await _ledger(tmp_path, *jobs) as ledger:
        acknowledged: set[str] = set()
        enough = anyio.Event()

        async def write(job: str) -> None:
            for index in range(1000):
                await ledger.record_turn(job, index, {"content": f"{job}/{index}"})
                acknowledged.add(f"{job}/{index}")
                if len(acknowledged) >= 300:
                    enough.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(write, job)
                await enough.wait()
                tg.cancel_scope.cancel()  # mid-flight: some callers are queued, one is committing

        # Every acknowledged write is there; turns are contiguous (no half-committed batch); the ledger works.
        stored: set[str] = set()
        for job in jobs:
            turns = await ledger.committed_turns(job)
            assert [t["content"] for t in turns] == [f"{job}/{i}" for i in range(len(turns))]
            stored |= {t["content"] for t in turns}
        assert acknowledged <= stored
        await ledger.record_turn("j0", 5000, {"content": "after"})
    with LedgerReader(tmp_path) as reader:
        assert reader.integrity_check() == "ok"
        assert reader.turns("j0")[-1] == {"content": "after"}


async def test_a_failing_commit_reaches_every_waiting_caller(tmp_path: Path) -> None:
    """Some other program write-locks the file behind the ledger's back: every queued write gets the error
    (none hangs), and the ledger works again once the foreign lock is gone."""
    jobs = [f"j{i}" for i in range(20)]
    async with await _ledger(tmp_path, *jobs, busy_timeout_s=0.05) as ledger:
        intruder = sqlite3.connect(tmp_path / "ledger.sqlite", isolation_level=None)
        intruder.execute("BEGIN EXCLUSIVE")
        errors: list[BaseException] = []

        async def write(job: str) -> None:
            try:
                await ledger.record_turn(job, 0, {"content": job})
            except StoreError as exc:
                errors.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(write, job)
        assert len(errors) == len(jobs)
        assert all(
            "database is locked" in str(exc) and isinstance(exc.__cause__, sqlite3.Error) for exc in errors
        )
        intruder.execute("ROLLBACK")
        intruder.close()
        await ledger.record_turn("j0", 0, {"content": "j0"})
        assert await ledger.committed_turns("j0") == [{"content": "j0"}]
        assert await ledger.committed_turns("j1") == []


async def test_an_open_cancelled_half_way_does_not_keep_the_lock(tmp_path: Path) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(Ledger.open, tmp_path)
        await wait_all_tasks_blocked()  # the open is now waiting on its lock-taking thread...
        tg.cancel_scope.cancel()  # ...and the cancellation lands while that thread takes the lock
    assert (tmp_path / "ledger.lock").exists()
    async with await Ledger.open(tmp_path) as ledger:  # not refused: the cancelled open let go of it
        await ledger.begin_run({"lineup": "fp"}, versions={})
