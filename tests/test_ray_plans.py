"""``cluster="ray"`` without a Ray instance: which actors a run asks for (``ray_plans``, from ``devices`` and
the cluster's resources), the refusals before a run starts, and the order of messages over the actor link
(the actor class called as a plain object). The runs on a real local Ray are in test_ray.py."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from interlens import ConfigurationError, Conversation, ScriptedParticipant
from interlens.scheduler import DeviceError, check_ray_devices
from interlens.scheduler.workers._ray_worker import actor_options, ray_plans


def test_by_default_one_gpu_actor_per_gpu_of_the_cluster_each_seeing_its_gpu_as_cuda_0() -> None:
    plans = ray_plans(None, {"GPU": 16.0, "CPU": 128.0})
    assert [p.worker.device for p in plans] == [f"ray/cuda:{i}" for i in range(16)]
    assert {p.worker.inner for p in plans} == {"cuda:0"}
    assert all(p.options == {"num_gpus": 1, "num_cpus": 1} for p in plans)


def test_only_a_deterministic_cuda_actor_gets_cublas_settings_in_its_runtime_env() -> None:
    """What the actor is created with (a real actor's start-up environment: ``test_ray.py``)."""
    gpu, cpu = ray_plans(["cuda", "cpu"], {"GPU": 1.0, "CPU": 4.0})
    assert actor_options(gpu, gpu.worker.deterministic()) == {
        "num_gpus": 1,
        "num_cpus": 1,
        "runtime_env": {"env_vars": {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}},
    }
    assert actor_options(gpu, gpu.worker) == gpu.options == {"num_gpus": 1, "num_cpus": 1}
    assert actor_options(cpu, cpu.worker.deterministic()) == cpu.options  # a CPU's kernels read no such thing


def test_a_cluster_without_gpus_gets_one_cpu_actor_that_sees_no_gpu() -> None:
    [plan] = ray_plans(None, {"CPU": 8.0})
    assert (plan.worker.device, plan.worker.inner) == ("ray/cpu:0", "cpu")
    assert plan.options == {"num_cpus": 1.0} and plan.worker.env == {"CUDA_VISIBLE_DEVICES": ""}


def test_cpu_actors_share_the_cpus_left_beside_the_gpu_actors_so_every_actor_fits() -> None:
    plans = ray_plans(["cuda", "cpu", "cpu", "cpu"], {"GPU": 1.0, "CPU": 3.0})
    assert [p.worker.device for p in plans] == ["ray/cuda:0", "ray/cpu:1", "ray/cpu:2", "ray/cpu:3"]
    assert [p.options["num_cpus"] for p in plans] == [1, 2 / 3, 2 / 3, 2 / 3]
    assert sum(p.options["num_cpus"] for p in plans) <= 3


def test_more_workers_than_the_cluster_can_hold_are_refused_with_the_counts() -> None:
    with pytest.raises(DeviceError, match=r"asks for 3 GPU workers but the Ray cluster has 2 GPU\(s\)"):
        ray_plans(["cuda"] * 3, {"GPU": 2.0, "CPU": 64.0})
    with pytest.raises(DeviceError, match=r"has 1 CPU\(s\), none left for 1 CPU worker\(s\) beside 1 GPU"):
        ray_plans(["cuda", "cpu"], {"GPU": 1.0, "CPU": 1.0})


@pytest.mark.parametrize("devices", [["cuda:1"], ["cpu", ["cuda:0", "cuda:1"]], ["mps"], [], "cpu"])
def test_ray_devices_are_cpu_or_cuda_entries_without_an_index(devices: object) -> None:
    with pytest.raises(DeviceError, match="cluster='ray'"):
        check_ray_devices(devices)  # type: ignore[arg-type]
    assert check_ray_devices(["cuda", "cpu"]) == ["cuda", "cpu"] and check_ray_devices(None) is None


def test_cluster_ray_without_ray_installed_is_refused_in_the_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is not installed
    conv = Conversation([ScriptedParticipant("s", ["hi"])])
    with pytest.raises(ConfigurationError, match=r"^rollout\(\): cluster='ray' needs Ray.*interlens\[ray\]"):
        conv.rollout(cluster="ray", out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was written


async def test_an_actor_delivers_the_parents_messages_in_sent_order_whatever_order_the_calls_start() -> None:
    """Ray does not promise that an async actor starts calls in their sent order: ``down`` reorders."""
    from interlens.scheduler.workers._ray_worker import WorkerActor, _ActorEnd
    from interlens.scheduler.workers._wire import Cancel, Evict

    actor = WorkerActor()
    actor._end = end = _ActorEnd()
    frames = [pickle.dumps(message) for message in (Cancel(0), Cancel(1), Evict(frozenset({"m"})), Cancel(3))]
    await actor.down(2, [frames[3]])
    await actor.down(1, [frames[1], frames[2]])
    assert end.inbox.empty()  # nothing before call 0
    await actor.down(0, [frames[0]])
    got = [end.inbox.get_nowait() for _ in range(4)]
    assert got == [Cancel(0), Cancel(1), Evict(frozenset({"m"})), Cancel(3)] and end.inbox.empty()

    await end.send(Cancel(7), Cancel(8))  # the worker's messages go up in batches, in order
    await end.send_eof()
    batches = [batch async for batch in actor.uplink()]
    assert [[pickle.loads(f) for f in batch] for batch in batches] == [[Cancel(7), Cancel(8)]]
