"""``cluster="ray"``: device workers as Ray actors, on a private local Ray instance with 2 CPUs.

The instance is started once for the module, by the product's own ``RaySession`` (as a run without
``RAY_ADDRESS`` would start it), with an API key in the environment that its processes must not inherit; each
run joins it and leaves it up. The resume test's driver is a child process that joins it through
``RAY_ADDRESS``. Tiny local models, real actors, a real ledger, the fake provider for API turns.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import interlens
from interlens import (
    APIParticipant,
    AutoModelParticipant,
    ConfigurationError,
    Conversation,
    DeviceError,
    RunReport,
    ScriptedParticipant,
    WorkerStartError,
    register_analyzer,
    register_worker_init,
)
from interlens.rollouts import _analyzers
from interlens.store import LedgerReader
from interlens.testing import FakeProviderServer

ray = pytest.importorskip(
    "ray", reason="Ray is not installed (pip install 'interlens[ray]'): cluster='ray' needs it"
)

from interlens.scheduler.workers._ray_worker import RaySession  # noqa: E402  (after the skip: it needs nothing of Ray)

SCRIPTS = Path(__file__).parent / "scripts"
KEY = "sk-test-ray-0123456789abcdef"  # in the environment when Ray starts, and the fake provider's key
HUB = "hf_test0123456789abcdef"  # a Hub token in the environment when Ray starts
RUN = {"batched": False, "seed": 3, "progress": False}
INIT_PIDS: list[int] = []  # filled by remember_actor, in whichever process runs it


def remember_actor() -> None:
    INIT_PIDS.append(os.getpid())


def probe(conv: Conversation) -> dict[str, Any]:
    """Registered by name; an actor runs it after its init hooks, with the actor's environment."""
    keys = [name for name in os.environ if name.endswith("API_KEY")]
    return {
        "pid": os.getpid(),
        "init": list(INIT_PIDS),
        "keys": keys,
        "hub": os.environ.get("HF_TOKEN") == HUB,
    }


register_analyzer("ray_probe", probe)


@pytest.fixture
def api_key() -> str:
    return KEY


@pytest.fixture(scope="module")
def ray_session() -> Iterator[RaySession]:
    saved, saved_hub = os.environ.get("OPENAI_API_KEY"), os.environ.get("HF_TOKEN")
    os.environ["OPENAI_API_KEY"] = KEY
    os.environ["HF_TOKEN"] = HUB  # the actors load (gated) weights with it: theirs to keep
    try:
        with RaySession() as session:
            assert session.resources()["CPU"] == 2
            yield session
    finally:
        if saved_hub is None:
            os.environ.pop("HF_TOKEN", None)
        else:
            os.environ["HF_TOKEN"] = saved_hub
        if saved is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = saved
    assert not ray.is_initialized()  # it started Ray, so it shut it down


def debate(path: str, reply: Any = None, rows: int = 4) -> Conversation:
    settings: dict[str, Any] = {"max_new_tokens": 6, "temperature": 0.9, "kv_reuse": False}
    a = AutoModelParticipant.from_pretrained(path, name="a", **settings)
    s = ScriptedParticipant("s", reply or (lambda view: f"reply {view.own_turns}"))
    data = [{"i": i} for i in range(rows)]
    return Conversation([a, s], shared_context="Debate: tabs vs spaces.").turns(3).data(data).name("d")


def texts(report: RunReport) -> dict[str, list[tuple[str, str]]]:
    out = {}
    for job_id, res in report.results.items():
        assert res.transcript is not None
        out[job_id] = [(m.author, m.content) for m in res.transcript]
    return out


@pytest.fixture(scope="module")
def local(qwen2_path: str) -> dict[str, list[tuple[str, str]]]:
    """The debate's transcripts on this machine, in this process: what every Ray run must reproduce."""
    report = interlens.run([debate(qwen2_path)], devices=["cpu"], **RUN)
    assert report.failed == []
    return texts(report)


def test_ray_gives_the_local_results_runs_closures_and_sends_api_turns_to_the_parent(
    ray_session: RaySession, qwen2_path: str, local: dict[str, Any], server: FakeProviderServer
) -> None:
    label = "closure"  # captured: the analyzer travels by value
    closure = debate(qwen2_path).analyzer(
        lambda conv: {"pid": os.getpid(), "label": label, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}
    )
    hosted = APIParticipant(name="hosted", provider="openai", model_id="gpt-test")
    a = AutoModelParticipant.from_pretrained(qwen2_path, name="a", max_new_tokens=6, kv_reuse=False)
    mixed = (
        Conversation([a, hosted], shared_context="Debate: tabs vs spaces.")
        .turns(2)
        .analyzer("ray_probe")
        .name("api")
    )
    assert KEY.encode() not in cloudpickle.dumps(mixed)  # what travels to an actor holds no key

    register_worker_init(remember_actor)
    try:
        report = interlens.run([closure, mixed], cluster="ray", devices=["cpu", "cpu"], **RUN)
    finally:
        _analyzers._WORKER_INIT.remove(remember_actor)

    assert report.failed == []
    got = texts(report)
    assert {k: v for k, v in got.items() if k.startswith("d/")} == local
    pids = {res.analysis["pid"] for res in report.results.values()}
    assert len(pids) == 2 and os.getpid() not in pids  # two actors, neither of them this process
    assert {res.device for res in report.results.values()} == {"ray/cpu:0", "ray/cpu:1"}
    for job_id, res in report.results.items():
        if job_id.startswith("d/"):  # a CPU actor sees no GPU, whatever its node has
            assert res.analysis["label"] == "closure" and res.analysis["gpus"] == ""
    api = report.results["api"]
    assert api.analysis["pid"] in pids and api.analysis["init"] == [api.analysis["pid"]]  # hook ran there
    assert api.analysis["keys"] == []  # the actor's environment holds no API key
    assert api.analysis["hub"] is True  # but the Hub token its model loads may need
    assert INIT_PIDS == []  # the init hook ran in the actors only
    assert api.transcript is not None and api.transcript[2].author == "hosted"
    calls = [r for r in server.requests if r.path == "/v1/chat/completions"]
    assert len(calls) == 1 and calls[0].authenticated  # the parent's gateway sent it, with the key
    assert api.transcript[2].content.startswith("reply to")
    assert ray.is_initialized()  # the run joined the module's Ray and left it up


def test_the_default_batched_mode_co_steps_and_reuses_kept_kv_on_an_actor(
    ray_session: RaySession, qwen2_path: str
) -> None:
    """What users get without options (batched, kv_reuse on): the actor co-steps the rows in one batch and
    continues each stream's kept KV cache on its next turn, with the tokens of the same run in this process
    (these tiny models' batched tokens equal the lone ones on CPU: tests/test_seeding.py)."""
    a = AutoModelParticipant.from_pretrained(qwen2_path, name="a", max_new_tokens=6)  # settings as given
    s = ScriptedParticipant("s", lambda view: f"reply {view.own_turns}")
    rows = [{"i": i} for i in range(4)]
    conv = Conversation([a, s], shared_context="Debate: tabs vs spaces.").turns(3).data(rows).name("b")
    on_ray = interlens.run([conv], cluster="ray", devices=["cpu"], progress=False)
    here = interlens.run([conv], devices=["cpu"], progress=False)
    assert on_ray.failed == [] and texts(on_ray) == texts(here)
    turns = [m for res in on_ray.results.values() for m in res.transcript if m.author == "a"]
    assert len(turns) == 8 and {res.device for res in on_ray.results.values()} == {"ray/cpu:0"}
    assert max(m.metadata["batch_size"] for m in turns) == 4  # the four rows in one batch
    assert all(m.metadata["batched"] for m in turns)
    second = [res.transcript[3] for res in on_ray.results.values()]  # a's second turn
    assert all(m.author == "a" and m.metadata["kv_reused_tokens"] > 0 for m in second)


def test_an_actor_killed_mid_run_loses_its_jobs_to_a_fresh_actor_and_the_run_completes(
    ray_session: RaySession, qwen2_path: str, local: dict[str, Any], tmp_path: Path
) -> None:
    killed = tmp_path / "killed"

    def reply(view: Any) -> str:  # runs in an actor: the first scripted turn kills that actor
        if not killed.exists():
            killed.write_text(str(os.getpid()))
            import threading

            import ray

            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            threading.Event().wait(60)  # dies here: no job of this actor finishes
        return f"reply {view.own_turns}"

    conv = debate(qwen2_path, reply, rows=2).analyzer(lambda conv: os.getpid())
    report = interlens.run([conv], cluster="ray", devices=["cpu", "cpu"], out_dir=tmp_path / "run", **RUN)

    assert report.failed == [] and texts(report) == {k: local[k] for k in ("d/row_00000", "d/row_00001")}
    victim = int(killed.read_text())
    lost = {job_id for job_id, res in report.results.items() if res.attempts == 2}
    assert len(lost) == 1 and all(res.attempts == 1 for k, res in report.results.items() if k not in lost)
    assert victim not in {res.analysis for res in report.results.values()}  # they finished elsewhere
    with LedgerReader(tmp_path / "run") as reader:
        assert reader.counts()["done"] == 2
        for job_id in lost:
            record = reader.job(job_id)
            assert record is not None and record.attempts == 2


def test_a_run_resumes_after_its_ray_driver_is_killed(
    ray_session: RaySession, qwen2_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as in the child: the recipe's module is importable
    import ray_recipe

    hold = tmp_path / "hold_dir"
    hold.mkdir()
    (hold / "hold").touch()
    os.mkfifo(hold / "events")
    events = os.open(hold / "events", os.O_RDONLY | os.O_NONBLOCK)  # open before any writer comes
    out = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    child = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "ray_driver_child.py"), qwen2_path, str(out), str(hold)], env=env
    )
    try:
        # Row 1 started on the one actor, which runs one job at a time: row 0 is done.
        assert select.select([events], [], [], 120)[0], "the driver's held row never started"
        assert os.read(events, 4096).startswith(b"HOLD")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
        child.wait()
        os.close(events)
    with LedgerReader(out) as reader:
        assert reader.counts()["done"] == 1
    (hold / "hold").unlink()

    conv = ray_recipe.conversation(qwen2_path, str(hold)).name("r")
    report = conv.rollout(cluster="ray", devices=["cpu"], out_dir=out, max_batch_size=1, **RUN)
    baseline = conv.rollout(devices=["cpu"], **RUN)

    assert report.failed == [] and report.skipped == ["row_00000"]
    assert texts(report) == texts(baseline)
    with LedgerReader(out) as reader:
        assert reader.counts()["done"] == 2
        attempts = {job_id: reader.job(job_id).attempts for job_id in reader.job_ids()}  # type: ignore[union-attr]
    assert attempts == {"row_00000": 1, "row_00001": 2}  # each done once


def test_an_actor_that_does_not_start_in_time_ends_the_run_with_a_start_error(
    ray_session: RaySession, qwen2_path: str
) -> None:
    with pytest.raises(WorkerStartError, match=r"Ray actor for .*'ray/cpu:0'.*worker_start_timeout"):
        debate(qwen2_path).rollout(cluster="ray", devices=["cpu"], worker_start_timeout=0.001, progress=False)
    assert ray.is_initialized()


def test_cluster_and_its_devices_are_checked_before_anything_runs(qwen2_path: str) -> None:
    conv = debate(qwen2_path)
    with pytest.raises(
        ConfigurationError, match=r"^rollout\(\): cluster must be None \(this machine\) or 'ray'"
    ):
        conv.rollout(cluster="slurm")
    with pytest.raises(DeviceError, match=r"devices\[1\] is 'cuda:0'; with cluster='ray' each entry"):
        conv.rollout(cluster="ray", devices=["cpu", "cuda:0"])


async def test_a_deterministic_cuda_actor_starts_with_cublas_without_split_k_and_a_batched_one_without(
    ray_session: RaySession,
) -> None:
    """The launcher's actor for a CUDA worker, started as a deterministic run's slot starts it: its process
    had the cuBLAS settings in its environment from its start (``/proc/<pid>/environ`` is the environment a
    process started with, not what ``open`` set later); a batched run's actor did not; neither has an API
    key. The cluster here has no GPU, so the actor is placed without one (placement is ``ray_plans``')."""
    from dataclasses import replace

    from interlens.scheduler._placement import DETERMINISTIC_CUDA_ENV
    from interlens.scheduler.workers._ray_worker import launcher, ray_plans

    (plan,) = ray_plans(["cuda"], {"GPU": 1.0, "CPU": 2.0})
    assert plan.options["num_gpus"] == 1
    plan = replace(plan, options={"num_cpus": 1})
    launch = launcher(plan, start_timeout=120)
    started: dict[str, dict[str, str]] = {}
    for mode, worker in (("deterministic", plan.worker.deterministic()), ("batched", plan.worker)):
        link = await launch(worker)
        try:
            raw = Path(f"/proc/{link.pid}/environ").read_bytes()
        finally:
            await link.stop(grace=0)
        started[mode] = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    for name, value in DETERMINISTIC_CUDA_ENV.items():
        assert started["deterministic"].get(name) == value
        assert name not in started["batched"]
    assert not [name for env in started.values() for name in env if name.endswith("API_KEY")]
