"""Runs with a real ledger file: resume, skipping, recipe checks, and a cancellation that stays consistent."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
from scheduler_testkit import EchoEngine, EchoSpec, TurnsJob, lineup

from interlens.scheduler import ExecutionMode, RunConfig, run_jobs
from interlens.store import FingerprintMismatchError, LedgerReader


async def test_rerun_skips_done_jobs_and_resumes_committed_turns(tmp_path: Path) -> None:
    spec = EchoSpec("m")
    first = [TurnsJob([spec], turns=3) for _ in range(4)] + [TurnsJob([spec], turns=3, raise_on_turn=2)]
    out1 = await run_jobs(
        [lineup("a", first)], RunConfig(devices=["cpu"], out_dir=tmp_path, versions={"interlens": "0.1"})
    )
    assert out1.failed == ["a/0004"] and out1.ledger_path == tmp_path / "ledger.sqlite"

    again = EchoSpec("m")
    second = [TurnsJob([again], turns=3) for _ in range(6)]
    out2 = await run_jobs([lineup("a", second)], RunConfig(devices=["cpu"], out_dir=tmp_path))
    assert out2.skipped == ["a/0000", "a/0001", "a/0002", "a/0003"]
    assert out2.done == ["a/0004", "a/0005"] and out2.failed == []
    assert out2.counts == {"total": 6, "done": 2, "failed": 0, "skipped": 4}
    assert out2.job_ids == [f"a/{i:04d}" for i in range(6)]
    assert [j.seen for j in second[:4]] == [[], [], [], []]  # skipped jobs never ran
    # The failed job resumes after its two committed turns: only turn 2 is generated again.
    assert second[4].seen[0]["committed"] == [
        {"index": 0, "text": "m(a/0004:0)"},
        {"index": 1, "text": "m(a/0004:1)"},
    ]
    assert second[4].seen[0]["attempt"] == 2  # attempts count across runs
    assert sorted(r for b in again.engine.batches for r in b if r.startswith("a/0004")) == ["a/0004:2"]

    skipped = out2.outcome("a/0001")
    assert skipped.skipped and skipped.state == "done" and skipped.attempts == 1
    assert skipped.conversation["turns"][2]["text"] == "m(a/0001:2)"
    resumed = out2.outcome("a/0004")
    assert not resumed.skipped and resumed.attempts == 2 and resumed.error is None
    assert [o.job_id for o in out2.outcomes()] == out2.job_ids
    with pytest.raises(KeyError, match="not part of this run"):
        out2.outcome("a/0099")
    with LedgerReader(tmp_path) as reader:
        runs = reader.runs()
        assert [r["status"] for r in runs] == ["completed", "completed"]
        assert runs[0]["versions"] == {"interlens": "0.1"} and runs[0]["lineups"] == {"a": "fp-a"}


async def test_resume_false_starts_over(tmp_path: Path) -> None:
    await run_jobs(
        [lineup("a", [TurnsJob(needs_device=False)])], RunConfig(devices=["cpu"], out_dir=tmp_path)
    )
    job = TurnsJob(needs_device=False)
    out = await run_jobs([lineup("a", [job])], RunConfig(devices=["cpu"], out_dir=tmp_path, resume=False))
    assert out.skipped == [] and out.done == ["a/0000"] and job.seen[0]["committed"] == []
    assert len(list(tmp_path.glob("ledger.*.sqlite"))) == 1  # the old ledger was moved aside, not deleted


async def test_a_changed_recipe_is_refused_before_anything_runs(tmp_path: Path) -> None:
    await run_jobs(
        [lineup("a", [TurnsJob(needs_device=False)])], RunConfig(devices=["cpu"], out_dir=tmp_path)
    )
    changed = lineup("a", [TurnsJob(needs_device=False)])
    changed.fingerprint = "fp-other"
    spec = EchoSpec("m")
    with pytest.raises(FingerprintMismatchError):
        await run_jobs(
            [changed, lineup("b", [TurnsJob([spec])])], RunConfig(devices=["cpu"], out_dir=tmp_path)
        )
    assert spec.loads == []
    # The refused run left the ledger usable: the lock is released, the same recipe resumes.
    out = await run_jobs(
        [lineup("a", [TurnsJob(needs_device=False)])], RunConfig(devices=["cpu"], out_dir=tmp_path)
    )
    assert out.skipped == ["a/0000"]


async def test_cancelling_a_run_stops_the_batch_and_leaves_a_consistent_ledger(tmp_path: Path) -> None:
    entered = threading.Event()
    spec = EchoSpec("m", make=lambda n, d: EchoEngine(n, d, block_until_cancelled=entered))
    quick = EchoSpec("quick")
    # Turn 0 is generated at once by ``quick``; turn 1 blocks the device in ``spec`` until cancelled. The
    # long fallback delay makes turn 1 wait until all four jobs have committed turn 0.
    jobs = [TurnsJob([quick, spec], turns=3) for _ in range(4)]
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: run_jobs(
                    [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=tmp_path, max_batch_wait=60.0)
                )
            )
            await anyio.to_thread.run_sync(entered.wait, 10)  # a batch of turn 1 is now in flight
            tg.cancel_scope.cancel()
    assert spec.engine.saw_cancel.is_set()  # the in-flight batch was told to stop, not waited out
    with LedgerReader(tmp_path) as reader:
        assert reader.runs()[-1]["status"] == "interrupted"
        assert reader.counts()["running"] == 4
        assert [len(reader.turns(f"a/{i:04d}")) for i in range(4)] == [1, 1, 1, 1]

    # A rerun requeues the interrupted jobs and finishes them from their committed turn.
    spec2, quick2 = EchoSpec("m"), EchoSpec("quick")
    rerun = [TurnsJob([quick2, spec2], turns=3) for _ in range(4)]
    with anyio.fail_after(20):
        out = await run_jobs([lineup("a", rerun)], RunConfig(devices=["cpu"], out_dir=tmp_path))
    assert out.done == [f"a/{i:04d}" for i in range(4)] and out.skipped == []
    assert [len(j.seen[0]["committed"]) for j in rerun] == [1, 1, 1, 1]
    assert spec2.engine.sizes == [4] and quick2.engine.sizes == [4]  # turns 1 and 2, still co-stepped
    assert out.outcome("a/0002").attempts == 2
    with LedgerReader(tmp_path) as reader:
        assert reader.counts() == {"pending": 0, "running": 0, "done": 4, "failed": 0}
        assert [r["status"] for r in reader.runs()] == ["interrupted", "completed"]


async def test_ledger_run_co_steps_like_an_in_memory_run(tmp_path: Path) -> None:
    spec = EchoSpec("m")
    jobs = [TurnsJob([spec], turns=3) for _ in range(32)]
    with anyio.fail_after(30):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=tmp_path, max_batch_wait=60.0)
        )
    # Durable turn commits happen between rounds; quiescence still waits for every job to come back.
    assert spec.engine.sizes == [32, 32, 32] and len(out.done) == 32


async def test_deterministic_mode_with_ledger(tmp_path: Path) -> None:
    spec = EchoSpec("m")
    jobs = [TurnsJob([spec], turns=2) for _ in range(3)]
    out = await run_jobs(
        [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=tmp_path, mode=ExecutionMode.DETERMINISTIC)
    )
    # coalesced like batched mode (the engine decides whether the rows co-step), with durable commits
    assert spec.engine.sizes == [3, 3] and spec.engine.modes == {ExecutionMode.DETERMINISTIC}
    assert len(out.done) == 3
