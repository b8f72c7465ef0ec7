"""SIGKILL a rollout of tiny local models on two CPU worker processes, then resume it.

The child (tests/scripts/model_rollout_child.py) runs a tiny model talking with a scripted partner on
``devices=["cpu", "cpu"]``. One worker blocks at a partner turn (index 3 or later) and says so, which leaves
its jobs cut mid-conversation for certain, while the other worker finishes its jobs. The test kills the
run's process with SIGKILL once it has seen both, checks that no worker outlives it, and reruns: every job is
done exactly once, no committed turn is lost or changed, and each cut job goes on at its next turn.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from crash_testkit import children, exited, lines, turn_events

from interlens.store import LedgerNotFoundError, LedgerReader

CHILD = Path(__file__).parent / "scripts" / "model_rollout_child.py"
N_JOBS, TURNS = 6, 6
PARTNER_TURNS = range(1, TURNS, 2)  # the model speaks at even indices, its scripted partner at odd ones


def _done(out_dir: Path) -> set[str]:
    try:
        with LedgerReader(out_dir) as reader:
            return set(reader.done_job_ids())
    except LedgerNotFoundError:  # the run has not written its ledger yet
        return set()


def _run_until_held_then_kill(
    args: list[str], out_dir: Path, tmp_path: Path, env: dict[str, str] | None = None
) -> tuple[tuple[int, str, int], float]:
    """Start the child, wait until one worker holds a job mid-conversation while the other finished one,
    SIGKILL the run and check no worker outlives it; returns the held (pid, job, index) and the kill time."""
    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen(
            [*args, "first", str(tmp_path / "hold")], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    try:
        events = lines(first)
        held: tuple[int, str, int] | None = None
        workers: set[int] = set()
        deadline = time.monotonic() + 300
        # Wait on the run's own events (a worker held, both workers seen) and on the ledger (a job done).
        while held is None or len(workers) < 2 or not _done(out_dir):
            assert time.monotonic() < deadline, "the run never reached a job done and a job held"
            try:
                line = events.get(timeout=0.5)
            except queue.Empty:
                continue
            assert line is not None, f"the run ended early: {(tmp_path / 'first.err').read_text()[-2000:]}"
            kind, *rest = line.split()
            if kind in ("TURN", "HOLD"):
                workers.add(int(rest[0]))
            if kind == "HOLD":
                held = (int(rest[0]), rest[1], int(rest[2]))
        spawned = children(first.pid)
        assert workers <= spawned  # the pids that generated turns are the run's own worker processes
    finally:
        first.kill()
        first.wait(timeout=60)
    killed_at = time.time()
    assert first.returncode == -signal.SIGKILL
    outlived = [pid for pid in spawned if not exited(pid, timeout=30)]
    for pid in outlived:  # do not leave them behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not outlived, f"worker processes {outlived} outlived the killed run"
    assert held is not None
    return held, killed_at


def test_sigkilled_two_worker_model_rollout_resumes_every_job_once(qwen2_path: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = [sys.executable, str(CHILD), str(out_dir), qwen2_path, str(N_JOBS), str(TURNS)]
    held, killed_at = _run_until_held_then_kill(args, out_dir, tmp_path)

    with LedgerReader(out_dir) as reader:  # after the kill, before the resume
        before = {job: reader.turn_records(job) for job in reader.job_ids()}
        done_before = set(reader.done_job_ids())
        [first_run] = reader.runs()
    _, held_job, index = held
    assert 0 < len(before[held_job]) == index < TURNS, f"{held_job} was not cut mid-conversation"
    cut = {job for job, kept in before.items() if 0 < len(kept) < TURNS}
    assert done_before and held_job in cut and not cut & done_before

    rerun = subprocess.run([*args, "second"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    output = rerun.stdout.splitlines()
    assert output[-1] == f"DONE {N_JOBS} 0"
    generated = turn_events(output)
    all_jobs = {f"row_{i:05d}" for i in range(N_JOBS)}
    for job in sorted(all_jobs):
        kept = len(before.get(job, []))
        # Only the missing turns were generated, each once: the partner's among them show it.
        assert generated.get(job, []) == [i for i in PARTNER_TURNS if i >= kept], job
    assert generated[held_job][0] == index  # the held job went on exactly at the turn it was cut before
    assert not done_before & set(generated)  # a finished job is not run again

    with LedgerReader(out_dir) as reader:
        assert reader.counts()["done"] == N_JOBS and sum(reader.counts().values()) == N_JOBS
        assert set(reader.job_ids()) == all_jobs  # no duplicate job
        [_, second_run] = reader.runs()
        for job in sorted(all_jobs):
            stored = reader.turn_records(job)
            kept = before.get(job, [])
            assert [t.index for t in stored] == list(range(TURNS))
            assert [t.turn["author"] for t in stored] == ["a", "s"] * (TURNS // 2)
            assert stored[: len(kept)] == kept  # every committed turn, model turns too, kept as it was
            assert all(t.committed_at > killed_at for t in stored[len(kept) :])  # the rest: the rerun's
            result = reader.result(job)
            assert result is not None
            assert result["conversation"]["transcript"][1:] == [t.turn for t in stored]
            record = reader.job(job)
            assert record is not None and record.state == "done"
            # Done exactly once: by the first run if it finished there, else by the rerun.
            expected = first_run if job in done_before else second_run
            assert record.run_id == expected["run_id"], job


def test_a_steered_deterministic_rollout_killed_and_resumed_equals_an_uninterrupted_one(
    qwen2_path: str, tmp_path: Path
) -> None:
    env = os.environ | {"INTERLENS_TEST_STEER": "1"}
    out_dir = tmp_path / "run"
    args = [sys.executable, str(CHILD), str(out_dir), qwen2_path, str(N_JOBS), str(TURNS)]
    _run_until_held_then_kill(args, out_dir, tmp_path, env)
    rerun = subprocess.run([*args, "second"], capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    whole_dir = tmp_path / "whole"
    whole_args = [sys.executable, str(CHILD), str(whole_dir), qwen2_path, str(N_JOBS), str(TURNS), "whole"]
    whole = subprocess.run(whole_args, capture_output=True, text=True, timeout=300, env=env)
    assert whole.returncode == 0, whole.stderr[-2000:]

    def transcripts(path: Path) -> dict[str, list[tuple[str, str, Any]]]:
        with LedgerReader(path) as reader:
            assert reader.counts()["done"] == N_JOBS
            return {
                job: [
                    (t.turn["author"], t.turn["content"], t.turn["metadata"].get("steering")) for t in turns
                ]
                for job in reader.job_ids()
                for turns in [reader.turn_records(job)]
            }

    resumed, uninterrupted = transcripts(out_dir), transcripts(whole_dir)
    assert resumed == uninterrupted
    steered = [s for turns in resumed.values() for a, _, s in turns if a == "a"]
    assert steered and all(s is not None and s[0]["coef"] == 4.0 for s in steered)
