"""Each worker process sees only its own GPU(s), as cuda:0.., and CPU workers share the cores.

No GPU is needed: the environment is what the scheduler hands the spawned process, and a real worker
process started for "cuda:3" reports what it was given (it never touches a GPU, so it starts here too).
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest
from workers_testkit import EnvJob, children, lineup, one_slot_worker

from interlens.scheduler import DeviceError, ExecutionMode, JobSpec, RunConfig, run_jobs, validate_devices
from interlens.scheduler._placement import plan_workers

EXPANDABLE = "expandable_segments:True"  # static caches of changing sizes fragment fixed segments


def test_a_cuda_worker_sees_only_its_gpu_as_cuda_0() -> None:
    plans = plan_workers(["cuda:3", "cuda:0"], cores=16, environ={"PATH": "/bin"})
    assert [(p.device, p.inner) for p in plans] == [("cuda:3", "cuda:0"), ("cuda:0", "cuda:0")]
    env = plans[0].process_env({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3", "PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    assert plans[0].threads is None and "OMP_NUM_THREADS" not in env  # GPU workers keep torch's default
    assert [p.memory_fraction for p in plans] == [None, None]  # a GPU each: all of it


def test_workers_sharing_a_gpu_get_an_equal_share_of_its_memory() -> None:
    plans = plan_workers(["cuda:0", "cuda:0", "cuda:1", "cuda:1,cuda:2", "cpu"], cores=4, environ={})
    assert [p.memory_fraction for p in plans] == [0.5, 0.5, 0.5, 0.5, None]  # cuda:1 serves two workers
    alone = plan_workers(["cuda:0", "cuda:1"], environ={"CUDA_VISIBLE_DEVICES": "3,3"})
    assert [p.memory_fraction for p in alone] == [0.5, 0.5]  # the same physical GPU under two names


def test_a_users_allocator_configuration_is_kept() -> None:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        (plan,) = plan_workers(["cuda:0"], environ={var: "max_split_size_mb:128"})
        assert plan.env == {"CUDA_VISIBLE_DEVICES": "0"}
        assert plan.process_env({var: "max_split_size_mb:128"})[var] == "max_split_size_mb:128"


def test_the_parents_visible_devices_are_honoured_and_a_group_is_renumbered_from_zero() -> None:
    plans = plan_workers(["cuda:1", "cuda:0,cuda:2"], cores=8, environ={"CUDA_VISIBLE_DEVICES": "4,5,GPU-7a"})
    assert plans[0].env == {"CUDA_VISIBLE_DEVICES": "5", "PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}  # GPU 5
    assert plans[1].env == {"CUDA_VISIBLE_DEVICES": "4,GPU-7a", "PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    assert plans[1].inner == "cuda:0,cuda:1"


def test_cpu_workers_split_the_cores_unless_the_user_set_the_threads() -> None:
    plans = plan_workers(["cpu", "cpu", "cuda:0"], cores=16, environ={})
    assert [p.threads for p in plans] == [8, 8, None]
    assert plans[0].env == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert [p.threads for p in plan_workers(["cpu"] * 3, cores=2, environ={})] == [1, 1, 1]
    kept = plan_workers(["cpu", "cpu"], cores=16, environ={"OMP_NUM_THREADS": "3"})
    assert [p.threads for p in kept] == [None, None] and kept[0].env == {}


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([["cuda:0", "cpu"]], r"devices\[0\]: a group of devices may hold only CUDA GPUs"),
        ([[]], r"devices\[0\] is an empty group"),
        (["cpu", ["cuda:1", "cuda:1"]], r"devices\[1\]: the group .* names a GPU twice"),
        (["cpu", "cuda:0,mps"], r"devices\[1\]: a group of devices may hold only CUDA GPUs"),
        ([["cuda:0", 1]], r"devices\[0\]: a device must be a string"),
    ],
)
def test_bad_device_groups_are_refused_naming_the_entry(devices: Any, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        validate_devices(devices)


def test_a_group_of_gpus_that_are_not_here_is_refused() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match="device 'cuda:0' does not exist: no CUDA GPU"):
        validate_devices([["cuda:0", "cuda:1"]])


@pytest.mark.parametrize(
    ("device", "visible", "inner"), [("cuda:3", "3", "cuda:0"), ("cuda:4,cuda:5", "4,5", "cuda:0,cuda:1")]
)
async def test_a_worker_process_for_cuda_3_is_started_with_cuda_visible_devices_3(
    device: str, visible: str, inner: str
) -> None:
    """A real spawn for the plan of "cuda:3" (and of a group): the process reports its environment and its
    device."""
    (plan,) = plan_workers([device], environ={})
    spec = JobSpec("env/0", "env", seed=0, job=EnvJob())

    async def record(index: int, turn: Any) -> None:
        raise AssertionError("EnvJob records no turn")

    worker = one_slot_worker(plan)
    with anyio.fail_after(60):
        async with worker:
            await worker.started()
            outcome = await worker.run_attempt(spec, attempt=1, committed_turns=[], record_turn=record)
    assert outcome.ok and worker.device == device
    seen = outcome.analysis
    assert seen["visible"] == visible and seen["pid"] != os.getpid()
    assert seen["worker_device"] == seen["ctx_device"] == inner  # addressed from cuda:0 inside
    assert children() == set()


@pytest.mark.parametrize("mode", [ExecutionMode.DETERMINISTIC, ExecutionMode.BATCHED])
async def test_a_cuda_worker_of_a_deterministic_run_sets_cublas_and_torch_to_deterministic(
    mode: ExecutionMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuBLAS reads its workspace setting when it starts, so the worker sets it before any model loads;
    a batched run's worker keeps the defaults. (The worker for "cuda:3" never touches a GPU: it starts
    here.)"""
    pytest.importorskip("torch")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    (plan,) = plan_workers(["cuda:3"], environ={})
    spec = JobSpec("env/0", "env", seed=0, job=EnvJob(torch_threads=True))

    async def record(index: int, turn: Any) -> None:
        raise AssertionError("EnvJob records no turn")

    with anyio.fail_after(60):
        async with one_slot_worker(plan, mode) as worker:
            await worker.started()
            outcome = await worker.run_attempt(spec, attempt=1, committed_turns=[], record_turn=record)
    assert outcome.ok, outcome.error
    deterministic = mode is ExecutionMode.DETERMINISTIC
    assert outcome.analysis["deterministic_algorithms"] is deterministic
    # in the process's environment from its start (before its torch loaded), not set by the worker later
    env = outcome.analysis["env_at_start"]
    assert (env["CUBLAS_WORKSPACE_CONFIG"], env["CUBLASLT_WORKSPACE_SIZE"]) == (
        (":16:8", "1") if deterministic else (None, None)
    )
    assert outcome.analysis["cublas_workspace"] == (":16:8" if deterministic else None)
    assert outcome.analysis["cublaslt_workspace"] == ("1" if deterministic else None)
    assert children() == set()


async def test_two_cpu_workers_each_run_torch_with_half_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    cores = len(os.sched_getaffinity(0))
    jobs = [EnvJob(torch_threads=True) for _ in range(4)]
    with anyio.fail_after(120):
        out = await run_jobs(
            [lineup("t", jobs)], RunConfig(devices=["cpu", "cpu"], out_dir=None, max_batch_size=2)
        )
    seen = [o.analysis for o in out.outcomes()]
    assert len({s["pid"] for s in seen}) == 2  # both workers ran jobs
    share = max(1, cores // 2)
    assert {(s["torch_threads"], s["omp"], s["worker_device"]) for s in seen} == {(share, str(share), "cpu")}
    assert children() == set()
