"""A worker init hook defined in the main script shares its globals with the analyzers of that script.

The pattern it serves: load a probe once per GPU into a module global, read it in the analyzer. The script
(tests/scripts/worker_init_child.py) runs as ``__main__`` in its own process, on two CPU worker processes
with a tiny local model, exactly as a user's script would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

CHILD = Path(__file__).parent / "scripts" / "worker_init_child.py"


def test_a_main_script_init_hook_sets_state_its_analyzer_sees_once_per_worker(
    qwen2_path: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, str(CHILD), qwen2_path, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failed"] == [] and len(report["analyses"]) == 6
    assert report["parent_init_calls"] == 0  # two devices: the hook runs in the workers only
    inits = Counter(int(line) for line in (tmp_path / "inits.txt").read_text().split())
    assert len(inits) == 2 and set(inits.values()) == {1}, inits  # each worker ran it exactly once
    assert report["parent"] not in inits
    seen = set()
    for analysis in report["analyses"].values():
        pid = analysis["pid"]
        # The analyzer, resolved by name in the worker, read what that worker's init put in the global.
        assert analysis == {
            "pid": pid,
            "probe": {"loaded_in": pid, "weights": [0.25, -1.5]},
            "init_calls": 1,
            "turns": 3,
        }
        seen.add(pid)
    assert seen == set(inits)  # both workers ran jobs
