"""A streaming rollout keeps memory flat: rows are pulled lazily, results live in the ledger.

12,000 one-turn jobs in a process of their own (``scripts/scale_child.py``: no other test's threads
allocating beside them), memory compared between jobs 2,000-3,000 and the last 1,000, each window's least
traced memory after a full collection. Measured growth: 6-105 KB, alone and beside three busy processes;
state kept per job (a job id in a list, ~65 bytes) grows it by 0.63-0.68 MB, past the 0.35 MB allowed (seen:
``scale_child.py OUT --keep-per-row``). Before the child collected garbage and ran 32 jobs at once (it ran
256, the default), the in-flight jobs' state swung the figure by up to 0.6 MB under load: the flake of CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from interlens.store import LedgerReader

CHILD = Path(__file__).parent / "scripts" / "scale_child.py"
N_ROWS = 12_000
LIMIT = 350_000  # 9,000 rows between the windows: O(rows) state of even 39 bytes a row would pass it


def streamed(out_dir: Path, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(CHILD), str(out_dir), *extra], capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_12k_row_streaming_rollout_has_flat_memory(tmp_path: Path) -> None:
    run = streamed(tmp_path)
    assert run["growth"] < LIMIT, f"memory grew by {run['growth'] / 1e6:.2f} MB over 9,000 rows"
    assert run["done"] == N_ROWS and run["last"] == f"question {N_ROWS - 1}"
    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == N_ROWS
