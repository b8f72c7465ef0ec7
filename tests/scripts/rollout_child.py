"""A rollout run in its own process, so a test can SIGKILL it mid-run.

Usage: rollout_child.py OUT_DIR N_JOBS TURNS TAG [HOLD_AT]

Job ``i`` is data row ``i`` (job id ``row_0000i``); its shared context names it, so every reply knows its
job. Every generated turn prints ``TURN <job> <index>`` (before the ledger commit). Replies carry TAG so the
parent can tell which process generated each turn.

With HOLD_AT, the first reply asked for at or after the HOLD_AT-th call whose conversation already has a
committed turn prints ``HOLD <job> <index>`` instead and blocks until the process is killed (a scripted
callable runs in a thread of its own, so the other jobs go on meanwhile): the ledger then holds exactly
``index`` committed turns for that job (a job's turn is committed before its next one is asked for), so the
parent kills a run with a job certainly cut mid-conversation. Each event is one write (the callables of
several jobs run at once, and ``print`` writes its text and its newline apart).
"""

from __future__ import annotations

import sys
import time

from interlens import Conversation, ScriptedParticipant, dataset_field

out_dir, n_jobs, turns, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
hold_at = int(sys.argv[5]) if len(sys.argv) > 5 else None
calls = 0


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def reply(view):
    global calls
    calls += 1
    job = view.messages[0].content.rsplit(" ", 1)[-1]
    index = len(view.messages) - 1  # the shared context, then one message per generated turn
    if hold_at is not None and calls >= hold_at and index >= 1:
        say(f"HOLD {job} {index}")
        time.sleep(600)  # this job's turn never comes back: it is killed here
    say(f"TURN {job} {index}")
    return f"{view.speaker} turn {view.own_turns} by {tag}"


conv = (
    Conversation(
        participants=[ScriptedParticipant("a", reply), ScriptedParticipant("b", reply)],
        shared_context=("Resume me, job ", dataset_field("job")),
    )
    .turns(turns)
    .data([{"job": f"row_{i:05d}"} for i in range(n_jobs)])
)
report = conv.rollout(out_dir=out_dir, max_concurrency=8, progress=False)
print("DONE", len(report.results), len(report.failed), flush=True)
