"""Device workers in spawned processes: placement, co-stepping, the pipe, faults, start-up failures, orphans.

Every run here starts real worker processes (``devices=["cpu", "cpu"]``) and kills them for real. The jobs
come from workers_testkit, which the workers import by name; nothing here imports torch, so a spawn costs a
fraction of a second.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from workers_testkit import (
    PARENT_CALLS,
    CallingJob,
    LockedJob,
    WorkerJob,
    children,
    failing_init,
    hanging_init,
    lineup,
    mark_init,
)

from interlens.scheduler import (
    DeviceError,
    JobPickleError,
    ProviderCallError,
    RunConfig,
    SchedulerConfigError,
    WorkerLostError,
    WorkerStartError,
    run_jobs,
)
from interlens.store import LedgerReader

TWO = ["cpu", "cpu"]


@pytest.fixture
def parent_calls() -> Any:
    """What the jobs' ``ParentSpec`` gateway calls run in this process; cleared after the test."""
    yield PARENT_CALLS
    PARENT_CALLS.clear()


def _texts(out: Any) -> dict[str, list[str]]:
    return {o.job_id: [t["text"] for t in o.conversation["turns"]] for o in out.outcomes()}


async def test_two_workers_share_the_jobs_costep_and_match_the_in_process_run(tmp_path: Path) -> None:
    jobs = [WorkerJob(turns=2, noise=(i == 0)) for i in range(8)]
    with anyio.fail_after(60):
        out = await run_jobs(
            [lineup("a", jobs)],
            RunConfig(devices=TWO, out_dir=tmp_path, max_batch_size=4, worker_init=[mark_init]),
        )
        alone = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_size=4)
        )
    assert out.counts == {"total": 8, "done": 8, "failed": 0, "skipped": 0}
    assert _texts(out) == _texts(alone) and _texts(out)["a/0003"] == ["m(a/0003:0)", "m(a/0003:1)"]
    pids = [o.analysis["pid"] for o in out.outcomes()]
    assert sorted(pids.count(p) for p in set(pids)) == [4, 4] and os.getpid() not in pids  # least-loaded
    batches = [t["batch"] for o in out.outcomes() for t in o.conversation["turns"]]
    assert max(batches) > 1  # turns of the jobs on one worker co-step in one batch
    for o in out.outcomes():  # the init hook ran once in that worker, before its first job
        assert o.analysis["init"] == [f"init in {o.analysis['pid']}"] and o.attempts == 1
    with LedgerReader(tmp_path) as reader:  # the parent recorded every turn the workers produced
        assert reader.counts()["done"] == 8
        assert [t["text"] for t in reader.turns("a/0005")] == ["m(a/0005:0)", "m(a/0005:1)"]
    assert children() == set()  # every worker process exited and was reaped


async def test_a_worker_killed_mid_run_is_replaced_and_its_jobs_retried(
    tmp_path: Path, parent_calls: dict[str, Any]
) -> None:
    """SIGKILL one worker while all 8 jobs wait in the parent after their first committed turn."""
    reached: list[tuple[str, int]] = []
    all_there, released = anyio.Event(), anyio.Event()
    victim: list[int] = []

    async def checkpoint(request: tuple[str, int]) -> None:
        job_id, pid = request
        reached.append((job_id, pid))
        if len(reached) == 8:
            all_there.set()
        await released.wait()

    async def kill_one() -> None:
        await all_there.wait()
        victim.append(reached[0][1])
        os.kill(victim[0], signal.SIGKILL)
        released.set()

    parent_calls["checkpoint"] = checkpoint
    jobs = [WorkerJob(turns=3, checkpoint_at=0) for _ in range(8)]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_one)
            out = await run_jobs(
                [lineup("k", jobs)], RunConfig(devices=TWO, out_dir=tmp_path, max_batch_size=4)
            )
    assert out.counts["done"] == 8 and out.failed == []
    hit = {job_id for job_id, pid in reached if pid == victim[0]}
    assert len(hit) == 4  # the victim's four jobs, no others
    with LedgerReader(tmp_path) as reader:
        assert reader.counts() == {"pending": 0, "running": 0, "done": 8, "failed": 0}
        for o in out.outcomes():
            job = reader.job(o.job_id)
            assert job is not None and job.attempts == o.attempts == (2 if o.job_id in hit else 1)
            assert [t["index"] for t in reader.turns(o.job_id)] == [0, 1, 2]
    for o in out.outcomes():
        if o.job_id in hit:  # resumed on a fresh worker after the turn committed before the kill
            assert o.analysis["committed"] == 1 and o.analysis["pid"] != victim[0]
    assert children() == set()


async def test_a_job_that_kills_its_worker_every_time_fails_alone_after_the_bound() -> None:
    jobs = [WorkerJob(turns=2) for _ in range(5)] + [WorkerJob(turns=2, kill_worker_at=1)]
    with anyio.fail_after(60):
        out = await run_jobs(
            [lineup("p", jobs)], RunConfig(devices=TWO, out_dir=None, max_batch_size=4, max_attempts=3)
        )
    assert out.failed == ["p/0005"] and len(out.done) == 5
    poison = out.outcome("p/0005")
    assert poison.attempts == 3 and poison.error is not None and poison.error.type == WorkerLostError.__name__
    assert "killed by SIGKILL" in poison.error.message
    assert "died on each of its 3 attempts" in poison.error.message and "alone" in poison.error.message
    assert all(out.outcome(f"p/{i:04d}").attempts <= 2 for i in range(5))  # at most one shared death each
    assert children() == set()


async def test_calls_to_the_parent_run_concurrently_and_answer_out_of_order(
    parent_calls: dict[str, Any],
) -> None:
    second_answered = anyio.Event()

    async def order(request: tuple[str, str]) -> str:
        job_id, key = request
        if key == "first":  # answered only after "second": a pipe serving calls in order would deadlock
            await second_answered.wait()
        else:
            second_answered.set()
        return f"{key} for {job_id}"

    async def refuse(request: tuple[str, None]) -> None:
        raise ValueError(f"no quota left for {request[0]}")

    parent_calls.update(order=order, refuse=refuse)
    jobs = [CallingJob(), CallingJob(then=["refuse"]), LockedJob()]
    with anyio.fail_after(60):
        out = await run_jobs([lineup("c", jobs)], RunConfig(devices=TWO, out_dir=None))
    assert out.outcome("c/0000").conversation == {
        "answers": {"first": "first for c/0000", "second": "second for c/0000"}
    }
    refused = out.outcome("c/0001").error  # raised in the parent, typed in the worker's job
    assert refused is not None and refused.type == ProviderCallError.__name__
    assert "ValueError: no quota left for c/0001" in refused.message
    locked = out.outcome("c/0002").error  # cannot be pickled: fails alone, before it reaches a worker
    assert locked is not None and locked.type == JobPickleError.__name__ and "lock" in locked.message


async def test_a_worker_that_cannot_start_fails_the_run_before_any_job(tmp_path: Path) -> None:
    with anyio.fail_after(60), pytest.raises(WorkerStartError) as info:
        await run_jobs(
            [lineup("s", [WorkerJob()])], RunConfig(devices=TWO, out_dir=tmp_path, worker_init=[failing_init])
        )
    assert "could not start: ImportError: No module named 'missing_probe_lib'" in str(info.value)
    assert "failing_init" in str(info.value)  # the worker's traceback comes along
    with LedgerReader(tmp_path) as reader:
        assert reader.job("s/0000") is None or reader.job("s/0000").attempts == 0  # type: ignore[union-attr]
    assert children() == set()


async def test_a_worker_that_never_reports_ready_times_out() -> None:
    with anyio.fail_after(60), pytest.raises(WorkerStartError, match=r"did not report ready within 1 s"):
        await run_jobs(
            [lineup("h", [WorkerJob()])],
            RunConfig(devices=TWO, out_dir=None, worker_init=[hanging_init], worker_start_timeout=1),
        )
    assert children() == set()


async def test_bad_devices_and_hooks_are_refused_before_any_process_starts() -> None:
    with pytest.raises(DeviceError, match="'cuda:7' does not exist"):
        await run_jobs([lineup("d", [WorkerJob()])], RunConfig(devices=["cpu", "cuda:7"], out_dir=None))
    lock = threading.Lock()
    with pytest.raises(SchedulerConfigError, match="cannot be sent to the worker processes"):
        await run_jobs(
            [lineup("d", [WorkerJob()])], RunConfig(devices=TWO, out_dir=None, worker_init=[lambda: lock])
        )
    assert children() == set()


async def test_workers_import_the_parents_interlens_not_a_checkout_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started in a source checkout's root with interlens installed from a wheel (as on a bare GPU
    machine): a worker's ``python -c`` puts the working directory first on ``sys.path``, whose ``interlens/``
    lacks the packages an install maps into it. Workers must import the package the parent imported."""
    decoy = tmp_path / "interlens"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise ImportError("the checkout in the working directory")\n')
    monkeypatch.chdir(tmp_path)
    with anyio.fail_after(60):
        out = await run_jobs([lineup("d", [WorkerJob(), WorkerJob()])], RunConfig(devices=TWO, out_dir=None))
    assert out.failed == [] and len(out.done) == 2
    assert len({o.analysis["pid"] for o in out.outcomes() if o.analysis}) == 2  # both ran in workers
    assert children() == set()
