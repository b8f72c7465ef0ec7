"""A script whose worker init hook loads a "probe" into a global that its analyzer reads (issue #9).

Usage: ``python worker_init_child.py MODEL_PATH OUT_DIR``. Runs a rollout of a tiny local model on two CPU
worker processes and prints one JSON line: the parent's pid and init count, and every job's analysis. Each
init appends its pid to OUT_DIR/inits.txt, so the test can count how often it ran in each process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from interlens import (
    AutoModelParticipant,
    Conversation,
    ScriptedParticipant,
    register_analyzer,
    register_worker_init,
)

PROBE: dict[str, Any] | None = None  # "loaded once per GPU": set by the init hook, read by the analyzer
INIT_CALLS = 0


@register_worker_init
def load_probe() -> None:
    global PROBE, INIT_CALLS
    INIT_CALLS += 1
    PROBE = {"loaded_in": os.getpid(), "weights": [0.25, -1.5]}
    with open(Path(sys.argv[2]) / "inits.txt", "a") as log:
        log.write(f"{os.getpid()}\n")


def read_probe(conv: Conversation) -> dict[str, Any]:
    return {"pid": os.getpid(), "probe": PROBE, "init_calls": INIT_CALLS, "turns": len(conv.transcript)}


register_analyzer("read_probe", read_probe)


if __name__ == "__main__":
    model = AutoModelParticipant.from_pretrained(sys.argv[1], name="m", max_new_tokens=3, kv_reuse=False)
    conv = (
        Conversation([model, ScriptedParticipant("s", ["ok", "ok"])], shared_context="Probe me.")
        .turns(2)
        .analyzer("read_probe")
    )
    report = conv.rollout(n=6, devices=["cpu", "cpu"], out_dir=Path(sys.argv[2]) / "run", progress=False)
    analyses = {job_id: result.analysis for job_id, result in report.results.items()}
    out = {"parent": os.getpid(), "parent_init_calls": INIT_CALLS, "failed": report.failed}
    print(json.dumps(out | {"analyses": analyses}), flush=True)
