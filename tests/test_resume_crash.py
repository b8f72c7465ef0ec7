"""A rollout process SIGKILLed mid-run resumes: a job cut mid-conversation goes on at its next turn, no
committed turn is lost or changed, no job runs twice, the report is complete.

The child (tests/scripts/rollout_child.py) blocks its own event loop at a reply once a conversation has a
committed turn and says so; the test kills it then, so the cut is certain, not a matter of timing.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from crash_testkit import lines, turn_events

from interlens.store import LedgerReader

CHILD = Path(__file__).parent / "scripts" / "rollout_child.py"


def test_sigkilled_rollout_resumes_a_cut_job_at_its_next_turn(tmp_path: Path) -> None:
    n_jobs, turns = 12, 6
    first = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path), str(n_jobs), str(turns), "first", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        events = lines(first)
        held: tuple[str, int] | None = None
        while held is None:  # wait on the child's own event, not on time
            line = events.get(timeout=120)
            assert line is not None, "the child ended without holding mid-conversation"
            if line.startswith("HOLD "):
                held = (line.split()[1], int(line.split()[2]))
    finally:
        first.kill()
        first.wait(timeout=60)
    killed_at = time.time()
    assert first.returncode == -signal.SIGKILL

    with LedgerReader(tmp_path) as reader:  # after the kill, before the resume
        before = {job: reader.turn_records(job) for job in reader.job_ids()}
        done_before = reader.done_job_ids()
        [first_run] = reader.runs()
    job, index = held
    # The held job was asking for turn `index`: exactly the turns before it are committed.
    assert 0 < len(before[job]) == index < turns, f"{job} was not cut mid-conversation"
    assert [t.index for t in before[job]] == list(range(index))
    assert job not in done_before and len(done_before) < n_jobs

    rerun = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), str(n_jobs), str(turns), "second"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    output = rerun.stdout.splitlines()
    assert output[-1] == f"DONE {n_jobs} 0"
    generated = turn_events(output)
    all_jobs = {f"row_{i:05d}" for i in range(n_jobs)}
    assert set(before) <= all_jobs
    for name in sorted(all_jobs):
        kept = len(before.get(name, []))
        # Each job went on at its next turn: only its missing turns were generated, each once, in order.
        assert generated.get(name, []) == list(range(kept, turns)), name
    assert generated[job][0] == index  # the cut job resumed exactly where it was cut
    assert not set(done_before) & set(generated)  # a finished job is not run again

    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == n_jobs and sum(reader.counts().values()) == n_jobs
        assert set(reader.job_ids()) == all_jobs  # no duplicate job
        for name in sorted(all_jobs):
            stored = reader.turn_records(name)
            kept = before.get(name, [])
            assert [t.index for t in stored] == list(range(turns))
            assert stored[: len(kept)] == kept  # every committed turn survived as it was (commit time too)
            assert all(t.committed_at > killed_at for t in stored[len(kept) :])
            assert all("by second" in t.turn["content"] for t in stored[len(kept) :])
            result = reader.result(name)
            assert result is not None
            assert result["conversation"]["transcript"][1:] == [t.turn for t in stored]
            record = reader.job(name)
            assert record is not None
            if name in done_before:
                assert record.run_id == first_run["run_id"]  # done once, by the first run
