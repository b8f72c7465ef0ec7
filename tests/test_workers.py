"""Several devices: one spawned worker process each, with real tiny HF models, analyzers and init hooks.

``devices=["cpu", "cpu"]`` is two CPU workers: the multi-process path any CPU-only machine can exercise.
One module-scoped pair of runs (two worker processes, then the same lineups in-process) serves the
comparison tests, because each worker imports torch and loads the model once (seconds). The orphan tests
run a script (tests/scripts/workers_child.py) and interrupt or kill it for real.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from crash_testkit import children, exited

import interlens
from interlens import (
    AutoModelParticipant,
    ConfigurationError,
    Conversation,
    DeviceError,
    RunReport,
    ScriptedParticipant,
    register_analyzer,
    register_worker_init,
)
from interlens.rollouts import _analyzers
from interlens.store import LedgerReader

CHILD = Path(__file__).parent / "scripts" / "workers_child.py"
INIT_PIDS: list[int] = []  # filled by remember_worker, in whichever process runs it


def remember_worker() -> None:
    INIT_PIDS.append(os.getpid())


def probe(conv: Conversation) -> dict[str, Any]:
    """Registered by name at import time; a worker resolves the name in its own registry."""
    return {"pid": os.getpid(), "turns": len(conv.transcript), "init": list(INIT_PIDS)}


register_analyzer("workers_probe", probe)


def debate(path: str, **settings: Any) -> Conversation:
    a = AutoModelParticipant.from_pretrained(path, name="a", max_new_tokens=6, temperature=0.9, **settings)
    s = ScriptedParticipant("s", lambda view: f"reply {view.own_turns}")  # a lambda: travels by value
    rows = [{"i": i} for i in range(3)]
    return Conversation(participants=[a, s], shared_context="Debate: tabs vs spaces.").turns(3).data(rows)


@pytest.fixture(scope="module")
def runs(qwen2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunReport, RunReport]]:
    register_worker_init(remember_worker)
    label = "closure"  # captured: the closure analyzer is shipped by value with its job
    lineups = [
        debate(qwen2_path, kv_reuse=False).analyzer("workers_probe").name("named"),
        debate(qwen2_path, kv_reuse=False)
        .analyzer(lambda conv: {"pid": os.getpid(), "label": label})
        .name("closure"),
    ]
    try:
        out = tmp_path_factory.mktemp("workers")
        multi = interlens.run(lineups, devices=["cpu", "cpu"], batched=False, seed=3, out_dir=out)
        single = interlens.run(lineups, devices=["cpu"], batched=False, seed=3)
    finally:
        _analyzers._WORKER_INIT.remove(remember_worker)
    yield multi, single


def test_two_workers_give_the_in_process_results_token_for_token(runs: tuple[RunReport, RunReport]) -> None:
    multi, single = runs
    assert multi.failed == [] and single.failed == [] and len(multi.results) == 6
    for job_id, res in single.results.items():
        other = multi.results[job_id]
        assert [(m.author, m.content) for m in other.transcript] == [
            (m.author, m.content) for m in res.transcript
        ]
        assert other.transcript[2].content == "reply 0" and other.device == "cpu"
    assert multi.results["named/row_00001"].transcript[1].n_tokens > 0
    with LedgerReader(multi.out_dir) as reader:  # the parent wrote what the workers generated
        assert reader.counts()["done"] == 6
        assert len(reader.turns("closure/row_00002")) == 3
    assert children(os.getpid()) == set()  # both worker processes exited and were reaped


@pytest.mark.parametrize("batched", [False, True], ids=["deterministic", "batched"])
def test_default_settings_give_the_in_process_tokens_in_two_workers(qwen2_path: str, batched: bool) -> None:
    """The same token-for-token check with the settings users get (KV reuse on, no participant seed).

    Deterministic mode guarantees it. Batched, each worker batches 3 rows where one process batches 6: the
    tokens agree because these models' batched forward pass is batch-invariant on CPU (see turn_seed).
    """
    lineups = [debate(qwen2_path).name("p"), debate(qwen2_path).name("q")]
    multi = interlens.run(lineups, devices=["cpu", "cpu"], batched=batched, seed=3, progress=False)
    single = interlens.run(lineups, devices=["cpu"], batched=batched, seed=3, progress=False)
    assert multi.failed == [] and single.failed == [] and len(single.results) == 6
    for job_id, res in single.results.items():
        other = multi.results[job_id]
        assert [(m.author, m.content) for m in other.transcript] == [
            (m.author, m.content) for m in res.transcript
        ]
    assert all(r.transcript[1].n_tokens > 0 for r in single.results.values())
    assert children(os.getpid()) == set()


def test_both_workers_get_jobs_and_run_named_and_closure_analyzers(runs: tuple[RunReport, RunReport]) -> None:
    multi, _ = runs
    pids = {res.analysis["pid"] for res in multi.results.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    for job_id, res in multi.results.items():
        if job_id.startswith("named/"):  # the registered name resolved in the worker, after its init hook
            assert res.analysis == {"pid": res.analysis["pid"], "turns": 4, "init": [res.analysis["pid"]]}
        else:
            assert res.analysis["label"] == "closure"
    _, single = runs  # in-process, the init hook ran once, here, before the first job
    assert single.results["named/row_00000"].analysis["init"] == [os.getpid()]


def test_an_analyzer_that_cannot_travel_is_refused_before_any_worker_starts(qwen2_path: str) -> None:
    lock = threading.Lock()
    conv = debate(qwen2_path).analyzer(lambda conv: str(lock))
    with pytest.raises(
        ConfigurationError, match=r"cannot be sent to the worker processes.*register_analyzer"
    ):
        conv.rollout(devices=["cpu", "cpu"])
    assert children(os.getpid()) == set()


def test_a_device_that_does_not_exist_fails_fast(qwen2_path: str) -> None:
    with pytest.raises(DeviceError, match="'cuda:5' does not exist"):
        debate(qwen2_path).rollout(devices=["cpu", "cuda:5"])
    assert children(os.getpid()) == set()


@pytest.mark.parametrize("stop", ["ctrl_c", "kill_parent"])
def test_no_worker_outlives_an_interrupted_or_killed_run(stop: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = _lines(proc)
        workers: dict[int, str] = {}
        while len(workers) < 2:  # four jobs, two per worker: both workers report in
            kind, pid, *rest = lines.get(timeout=60).split()
            if kind == "WORKER":
                workers[int(pid)] = rest[0]
        assert set(workers.values()) == {"__mp_main__"}  # each worker imported this script as its main module
        if stop == "ctrl_c":
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) != 0
            with LedgerReader(tmp_path) as reader:
                assert reader.runs()[-1]["status"] == "interrupted"
        else:
            proc.kill()
            proc.wait(timeout=10)
        for pid in workers:
            assert exited(pid, timeout=20), f"worker {pid} outlived its parent ({stop})"
    finally:
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The child's stdout lines, read by a thread so the test can wait for each with a timeout."""
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out
