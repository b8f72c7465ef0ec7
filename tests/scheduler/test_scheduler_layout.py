"""Where the scheduler's code lives: the process seam is loaded only by a run that starts worker processes."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_scheduler_loads_none_of_the_worker_process_code() -> None:
    """``scheduler/workers/`` (the spawned process, its pipe, the Ray actors) is imported by ``_pool`` only
    when a run starts worker processes: ``import interlens.scheduler`` (and so a single-device run's set-up)
    does not pay for it."""
    code = (
        "import sys, interlens.scheduler\n"
        "print(sorted(m for m in sys.modules if m.startswith('interlens.scheduler.workers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_worker_package_exports_what_the_pool_starts_workers_with() -> None:
    from interlens.scheduler import workers

    assert set(workers.__all__) >= {"SubprocessWorker", "Launch", "RaySession", "launcher", "ray_plans"}
    assert all(hasattr(workers, name) for name in workers.__all__)
