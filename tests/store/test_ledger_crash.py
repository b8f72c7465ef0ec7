"""Crash safety: a real writer process SIGKILLed at random moments, again and again, on one ledger.

The writer (``_crash_writer.py``) prints an acknowledgement after every awaited write returns; whatever it
acknowledged must be in the file after the kill. Each round resumes the previous rounds' leftovers, so this
also covers "a lock left by a dead process is taken over" and "resume at the next committed turn".
"""

from __future__ import annotations

import json
import random
import selectors
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from _crash_writer import n_turns, outcome, turn_content

from interlens.store import Ledger, LedgerReader

WRITER = Path(__file__).with_name("_crash_writer.py")
ROUNDS = 30
LINE_TIMEOUT_S = 60.0


@dataclass
class Acked:
    """The model of what the ledger promised: built only from acknowledgement lines."""

    added: set[str] = field(default_factory=set)
    turns: set[tuple[str, int]] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)
    final: dict[str, str] = field(default_factory=dict)  # job → done | failed | pending (last acked outcome)
    running: set[str] = field(default_factory=set)  # acked started, no outcome acked since
    batches: dict[str, str] = field(default_factory=dict)
    schema_committed: bool = False  # a RUN line proves the ledger's schema is in the file
    resumed_mid_conversation: int = 0  # restarts that continued after turn 0


def _read_acks(proc: subprocess.Popen[str], count: int) -> list[str]:
    """Read ``count`` lines (or until EOF), each within LINE_TIMEOUT_S: wait on the pipe, never sleep."""
    assert proc.stdout is not None
    lines: list[str] = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(lines) < count:
            if not sel.select(timeout=LINE_TIMEOUT_S):
                raise AssertionError(
                    f"writer produced no acknowledgement in {LINE_TIMEOUT_S}s; got {lines[-5:]}"
                )
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
    return lines


def _apply(acked: Acked, lines: list[str], requeued_expected: set[str] | None) -> None:
    # Starts acked by the previous round were checked as running right after its kill; from here on they may
    # be requeued by this round even if the kill hides the acknowledgement, so only this round's count.
    acked.running.clear()
    for line in lines:
        kind, *rest = line.split(" ", 1)
        arg = rest[0] if rest else ""
        if kind == "BAD":
            raise AssertionError(f"writer saw an inconsistent ledger on resume: {line}")
        if kind == "RUN":
            acked.schema_committed = True
            continue
        if kind == "REQUEUED":
            requeued = set(json.loads(arg))
            if requeued_expected is not None:
                # Exactly the rows the kill left running (a superset of the acked-started, unfinished jobs,
                # checked in _check: a start may commit just before the kill, unacknowledged).
                assert requeued == requeued_expected
                assert not requeued & {j for j, s in acked.final.items() if s in ("done", "failed")}
            continue
        job, _, tail = arg.partition(" ")
        if kind == "ADD":
            acked.added.add(job)
        elif kind == "START":
            acked.attempts[job] = int(tail)
            acked.running.add(job)
        elif kind == "RESUME":
            # A restarted job continues after every turn it had acknowledged, never from turn 0.
            acked_here = [i for j, i in acked.turns if j == job]
            assert int(tail) >= len(acked_here) and int(tail) >= max(acked_here, default=-1) + 1
            acked.resumed_mid_conversation += int(tail) > 0
        elif kind == "TURN":
            acked.turns.add((job, int(tail)))
        elif kind in ("DONE", "FAILED", "PENDING"):
            acked.final[job] = {"DONE": "done", "FAILED": "failed", "PENDING": "pending"}[kind]
            acked.running.discard(job)
        elif kind == "BATCH":
            acked.batches[job] = "in_progress"
        elif kind == "BATCHSTATE":
            acked.batches[job] = tail


def _check(out_dir: Path, acked: Acked) -> set[str]:
    """Assert the ledger holds everything acknowledged; return the ids it has as running (for requeue)."""
    with LedgerReader(out_dir) as reader:
        assert reader.integrity_check() == "ok"
        for job in acked.added:
            assert reader.job(job) is not None, f"acknowledged add_jobs of {job} lost"
        by_job: dict[str, set[int]] = {}
        for job, index in acked.turns:
            by_job.setdefault(job, set()).add(index)
        for job, indices in by_job.items():
            stored = {t.index: t.turn for t in reader.turn_records(job)}
            for index in indices:
                assert stored.get(index) == turn_content(job, index), f"acknowledged turn {job}/{index} lost"
        for job, attempts in acked.attempts.items():
            record = reader.job(job)
            assert record is not None and record.attempts >= attempts
        for job, state in acked.final.items():
            record = reader.job(job)
            assert record is not None
            if state == "done":
                assert record.state == "done"
                result = reader.result(job)
                assert result is not None
                assert result["conversation"]["transcript"] == [
                    turn_content(job, i) for i in range(n_turns(job))
                ]
            elif state == "failed":
                assert record.state == "failed" and record.error_message == f"boom {job}"
        # No job is done without its result, in any state the kill left behind.
        done = 0
        for record, result in reader.iter_results(states=("done",)):
            assert result is not None and result["analysis"] == {"job": record.job_id}
            done += 1
        assert done == reader.counts()["done"]
        running = set(reader.job_ids(state="running"))
        for job in acked.running - running:
            # Acked as started, not running: only possible if its final write (the one its outcome dictates)
            # committed and the kill came before the acknowledgement was printed — after all of its turns.
            record = reader.job(job)
            assert record is not None
            assert record.state == {"done": "done", "fail": "failed", "pending": "pending"}[outcome(job)], job
            assert len(reader.turns(job)) == n_turns(job), job
        batches = {b.batch_id: b.state for b in reader.batches()}
        for batch_id, state in acked.batches.items():
            # The acknowledged state, or a later one whose write committed just before the kill, ahead of
            # its acknowledgement (the writer moves a batch in_progress -> ended, never back).
            later = {"in_progress": ("in_progress", "ended"), "ended": ("ended",)}[state]
            assert batches.get(batch_id) in later, (batch_id, batches.get(batch_id), state)
        return running


def test_sigkill_at_random_moments_keeps_every_acknowledged_write(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    rng = random.Random(20240601)
    acked = Acked()
    running_after_kill: set[str] | None = None
    total_acks = 0
    for round_no in range(ROUNDS):
        # Kill at a random point: sometimes before the writer is even up, mostly in the middle of the work.
        kill_after = rng.choice([0, rng.randint(1, 12), rng.randint(12, 120), rng.randint(120, 500)])
        proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(out_dir), str(round_no)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            lines = _read_acks(proc, kill_after)
            proc.send_signal(signal.SIGKILL)
            lines += _read_acks(proc, 10**9)  # acknowledgements already in the pipe when it died
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        assert proc.returncode == -signal.SIGKILL, f"writer died on its own (rc {proc.returncode}):\n{stderr}"
        total_acks += len(lines)
        _apply(acked, lines, running_after_kill)
        if acked.schema_committed:
            running_after_kill = _check(out_dir, acked)
    assert total_acks > 500, "the kills landed too early to test anything"
    assert sum(1 for s in acked.final.values() if s == "done") > 20
    assert acked.resumed_mid_conversation > 0
    print(
        f"{ROUNDS} kills, {total_acks} acknowledged writes, {acked.resumed_mid_conversation} resumed mid-way"
    )

    # A final writer takes over the lock of the last killed one and requeues what it left running.
    async def requeue() -> list[str]:
        async with await Ledger.open(out_dir) as ledger:
            return await ledger.requeue_running()

    import anyio

    assert running_after_kill is not None
    assert set(anyio.run(requeue)) == running_after_kill
    with LedgerReader(out_dir) as reader:
        assert reader.counts()["running"] == 0
