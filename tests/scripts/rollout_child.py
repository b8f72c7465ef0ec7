"""A rollout run in its own process, so a test can SIGKILL it mid-run.

Usage: rollout_child.py OUT_DIR N_JOBS TURNS TAG
Every generated turn prints "TURN <job> <index>" (before the ledger commit), so the parent can kill it at a
moment of its choosing. Replies carry TAG so the parent can tell which process generated each turn.
"""

from __future__ import annotations

import sys
import time

from interlens import Conversation, ScriptedParticipant

out_dir, n_jobs, turns, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


def reply(view):
    time.sleep(0.002)  # stands in for generation time, so the kill lands mid-run
    print("TURN", flush=True)
    return f"{view.speaker} turn {view.own_turns} by {tag}"


conv = Conversation(
    participants=[ScriptedParticipant("a", reply), ScriptedParticipant("b", reply)],
    shared_context="Resume me.",
).turns(turns)
report = conv.rollout(n=n_jobs, out_dir=out_dir, max_concurrency=8, progress=False)
print("DONE", len(report.results), len(report.failed), flush=True)
