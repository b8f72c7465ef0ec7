"""A rollout process SIGKILLed mid-run resumes: no committed turn lost, no job duplicated, report complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from interlens.store import LedgerReader

CHILD = Path(__file__).parent / "scripts" / "rollout_child.py"


def _run_child(
    out_dir: Path, *, n_jobs: int, turns: int, tag: str, kill_after: int | None
) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(out_dir), str(n_jobs), str(turns), tag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if kill_after is not None:
        seen = 0
        for line in proc.stdout:  # wait on the child's own progress events, not on time
            seen += line.startswith("TURN")
            if seen >= kill_after:
                os.kill(proc.pid, signal.SIGKILL)
                break
    proc.wait(timeout=120)
    return proc


def test_sigkilled_rollout_resumes_without_losing_committed_turns(tmp_path):
    n_jobs, turns = 12, 6
    killed = _run_child(tmp_path, n_jobs=n_jobs, turns=turns, tag="first", kill_after=30)
    assert killed.returncode == -signal.SIGKILL
    with LedgerReader(tmp_path) as reader:
        committed = {job: reader.turns(job) for job in reader.job_ids()}
        done_before = reader.done_job_ids()
    assert sum(len(t) for t in committed.values()) > 0, "nothing was committed before the kill"
    assert len(done_before) < n_jobs, "the kill landed after the run finished"

    # the rerun (same recipe, a new process) resumes
    rerun = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), str(n_jobs), str(turns), "second"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = rerun.stdout.splitlines()
    assert lines[-1] == f"DONE {n_jobs} 0"
    n_committed = sum(len(t) for t in committed.values())
    assert lines.count("TURN") == n_jobs * turns - n_committed  # only the missing turns were generated
    with LedgerReader(tmp_path) as reader:
        skipped_now = {job for job in reader.done_job_ids()}
        assert skipped_now == {f"rollout_{i:04d}" for i in range(n_jobs)}
        for job, turns_before in committed.items():
            generated = reader.turns(job)
            assert len(generated) == turns
            assert generated[: len(turns_before)] == turns_before  # every committed turn survived as it was
            assert all("by second" in m["content"] for m in generated[len(turns_before) :])
            result = reader.result(job)
            assert [m["content"] for m in result["conversation"]["transcript"][1:]] == [
                m["content"] for m in generated
            ]
    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == n_jobs and sum(reader.counts().values()) == n_jobs
        assert len(reader.job_ids()) == n_jobs  # no duplicate job
