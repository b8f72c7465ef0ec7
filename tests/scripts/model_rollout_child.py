"""A rollout of a tiny local model on two CPU worker processes, in its own process, so a test can SIGKILL it.

Usage: model_rollout_child.py OUT_DIR MODEL_PATH N_JOBS TURNS TAG [HOLD_FLAG]

Each job is a tiny model ("a") talking with a scripted partner ("s"); job ``i`` is data row ``i`` and its
shared context names it. Every turn of "s" prints, from its worker process, ``TURN <pid> <job> <index>``.

With INTERLENS_TEST_STEER=1 in the environment, "a" is steered (a fixed seeded direction) and the rollout
runs with batched=False, and "s" says the same in every run (no TAG), so two runs' transcripts compare.

With HOLD_FLAG (a path that does not exist yet), the first "s" turn at index 3 or later, in whichever worker
gets there first (creating the file decides it, across processes), prints ``HOLD <pid> <job> <index>`` and
blocks that worker's event loop until the run is killed: its jobs stop mid-conversation, with exactly the
turns before ``index`` committed for that job, while the other worker runs its jobs to the end.
"""

from __future__ import annotations

import os
import sys
import time

from interlens import AutoModelParticipant, Conversation, ScriptedParticipant, SteeringSpec, dataset_field

ARGS = sys.argv[1:]  # the same in a worker (spawn hands the parent's argv over), unused there
STEER = os.environ.get("INTERLENS_TEST_STEER") == "1"


def _say(*words: object) -> None:
    os.write(1, (" ".join(map(str, words)) + "\n").encode())  # one write: workers' lines never interleave


def partner(view):
    job = view.messages[0].content.rsplit(" ", 1)[-1]
    index = len(view.messages) - 1  # the shared context, then one message per generated turn
    if len(ARGS) > 5 and index >= 3:
        try:
            os.close(os.open(ARGS[5], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            _say("HOLD", os.getpid(), job, index)
            time.sleep(600)  # blocks this worker: nothing more of its jobs is generated; killed here
    _say("TURN", os.getpid(), job, index)
    if STEER:
        return f"partner turn {view.own_turns}"
    return f"partner turn {view.own_turns} by {ARGS[4]}"


if __name__ == "__main__":
    out_dir, model_path, n_jobs, turns, tag = ARGS[0], ARGS[1], int(ARGS[2]), int(ARGS[3]), ARGS[4]
    steering = None
    if STEER:
        import torch
        from transformers import AutoConfig

        width = AutoConfig.from_pretrained(model_path).hidden_size
        direction = torch.randn(width, generator=torch.Generator().manual_seed(7))
        steering = SteeringSpec(direction, layers=[0], coef=4.0)
    model = AutoModelParticipant.from_pretrained(model_path, name="a", max_new_tokens=4, steering=steering)
    conv = (
        Conversation(
            participants=[model, ScriptedParticipant("s", partner)],
            shared_context=("Debate tabs against spaces, job ", dataset_field("job")),
        )
        .turns(turns)
        .data([{"job": f"row_{i:05d}"} for i in range(n_jobs)])
    )
    report = conv.rollout(out_dir=out_dir, devices=["cpu", "cpu"], batched=not STEER, progress=False)
    _say("DONE", len(report.results), len(report.failed))
