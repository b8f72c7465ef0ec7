"""A CUDA error that is not an out-of-memory poisons its process: the worker exits and is replaced.

Faked: only the GPU. A test engine raises the very error text a device-side assert gives, in real worker
processes; everything else (the pipe, the parent's bookkeeping, retries, the replacement spawn) is real.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from workers_testkit import FaultyEngineSpec, WorkerJob, children, exited, lineup

from interlens.scheduler import RunConfig, WorkerLostError, run_jobs
from interlens.scheduler._batcher import is_out_of_memory
from interlens.scheduler._worker import is_fatal_device_error

TWO = ["cpu", "cpu"]
ASSERT = "CUDA error: device-side assert triggered"
CUBLAS_ALLOC = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


def test_what_counts_as_a_poisoning_device_error() -> None:
    assert is_fatal_device_error(RuntimeError(ASSERT))
    assert is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    wrapped = ValueError("turn 3 failed")
    wrapped.__cause__ = RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx")
    assert is_fatal_device_error(wrapped)
    assert not is_fatal_device_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal_device_error(RuntimeError("CUDA error: out of memory"))
    assert not is_fatal_device_error(RuntimeError(CUBLAS_ALLOC))  # cuBLAS's own allocation failed: an OOM
    assert is_out_of_memory(RuntimeError(CUBLAS_ALLOC))
    assert not is_fatal_device_error(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not is_fatal_device_error(ValueError("bad prompt"))


async def test_a_worker_hit_by_a_device_side_assert_exits_and_is_replaced(tmp_path: Path) -> None:
    log = tmp_path / "loads.txt"
    bad = FaultyEngineSpec("bad", error=ASSERT, log=str(log))
    jobs = [WorkerJob(turns=2) for _ in range(4)] + [WorkerJob(turns=2, engine=bad)]
    with anyio.fail_after(120):
        out = await run_jobs(
            [lineup("f", jobs)], RunConfig(devices=TWO, out_dir=None, max_batch_size=4, max_attempts=3)
        )
    assert out.failed == ["f/0004"] and len(out.done) == 4  # the other jobs completed
    poison = out.outcome("f/0004")
    assert poison.attempts == 3 and poison.error is not None and poison.error.type == WorkerLostError.__name__
    assert (
        f"it hit a CUDA error that leaves its process unusable (RuntimeError: {ASSERT})"
        in poison.error.message
    )
    loaders = [int(line) for line in log.read_text().split()]
    assert len(loaders) == 3 and len(set(loaders)) == 3  # each attempt ran in a fresh process
    assert all(exited(pid, 10) for pid in loaders)  # ... and each of them left after the assert
    assert children() == set()


async def test_an_analyzer_hit_by_a_device_side_assert_is_retried_on_a_fresh_worker() -> None:
    """An analyzer's exception comes back beside a finished conversation, not raised out of the job: a CUDA
    error in it poisons the worker all the same (seen on an H200: the job failed and the worker was kept)."""
    jobs = [WorkerJob(turns=2) for _ in range(3)] + [WorkerJob(turns=2, analysis_error=ASSERT)]
    with anyio.fail_after(120):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=TWO, out_dir=None, max_batch_size=4, max_attempts=3)
        )
    assert out.failed == [] and len(out.done) == 4
    poisoned = out.outcome("a/0003")
    assert poisoned.attempts == 2 and poisoned.error is None and poisoned.analysis is not None
    pids = {o.analysis["pid"] for o in out.outcomes() if o.analysis}
    assert poisoned.analysis["pid"] in pids and len(pids) >= 2
    assert children() == set()


@pytest.mark.parametrize("error", ["CUDA out of memory. Tried to allocate 2.00 GiB", CUBLAS_ALLOC])
async def test_an_out_of_memory_fails_its_job_and_keeps_the_worker(tmp_path: Path, error: str) -> None:
    log = tmp_path / "loads.txt"
    oom = FaultyEngineSpec("big", error=error, log=str(log))
    jobs = [WorkerJob(turns=2) for _ in range(4)] + [WorkerJob(turns=2, engine=oom)]
    with anyio.fail_after(120):
        out = await run_jobs(
            [lineup("o", jobs)], RunConfig(devices=TWO, out_dir=None, max_batch_size=4, max_attempts=3)
        )
    assert out.failed == ["o/0004"] and len(out.done) == 4
    failed = out.outcome("o/0004")
    assert failed.attempts == 1 and failed.error is not None and failed.error.type == "RuntimeError"
    assert len(log.read_text().split()) == 1  # loaded once: no worker was replaced
    assert all(o.attempts == 1 for o in out.outcomes())
    assert len({o.analysis["pid"] for o in out.outcomes() if o.analysis}) == 2


@pytest.fixture(autouse=True)
def _no_orphans() -> object:
    yield
    assert children() == set()


async def test_a_poisoned_device_in_this_process_stops_the_run_and_leaves_the_rest_pending(
    tmp_path: Path,
) -> None:
    """One device runs in the run's own process, which nothing can replace: the run starts no new job,
    the ones not started stay pending in the ledger, and the outcome says how to go on."""
    bad = FaultyEngineSpec("bad", error=ASSERT)
    jobs = [WorkerJob(turns=2, engine=bad)] + [WorkerJob(turns=2) for _ in range(30)]
    with anyio.fail_after(120):
        out = await run_jobs(
            [lineup("p", jobs)],
            RunConfig(devices=["cpu"], out_dir=tmp_path, max_batch_size=2, max_concurrency=2, max_attempts=1),
        )
    assert out.stopped is not None
    assert "device 'cpu' hit a CUDA error that leaves this process unusable" in out.stopped
    assert "Restart the Python process" in out.stopped and "same out_dir to resume" in out.stopped
    assert "p/0000" in out.failed
    finished = len(out.done) + len(out.failed)
    assert finished < len(jobs)  # the run stopped early: jobs not started were left
    from interlens.store import LedgerReader

    with LedgerReader(tmp_path) as reader:
        counts = reader.counts()
        assert reader.runs()[-1]["status"] == "stopped"
    # Nothing else failed or hangs as running: the rest is pending or not pulled yet, both left to a rerun.
    assert counts["failed"] == len(out.failed) and counts["done"] == len(out.done)
    assert counts.get("running", 0) == 0 and counts["pending"] >= 1
