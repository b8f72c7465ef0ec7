"""A run on two worker processes that never finishes, for the orphan tests (interrupted or killed).

Usage: ``python workers_child.py OUT_DIR``. Prints ``PARENT <pid>``, then each job prints, from its worker
process, ``WORKER <pid> <name>`` where <name> is the name this script was imported under in that worker
(``__mp_main__``: workers import the main module as multiprocessing's spawn does), and waits forever.
"""

from __future__ import annotations

import os
import sys

import anyio

from interlens.scheduler import JobContext, JobResult, JobSpec, LineupSpec, RunConfig, run_jobs, run_sync

IMPORTED_AS = __name__


class Forever:
    needs_device = True

    async def run(self, ctx: JobContext) -> JobResult:
        main = sys.modules.get("__mp_main__")
        line = f"WORKER {os.getpid()} {getattr(main, 'IMPORTED_AS', None)}\n"
        os.write(1, line.encode())  # one write: lines from two workers sharing the pipe never interleave
        await anyio.sleep_forever()
        return JobResult(conversation={})

    def is_transient(self, exc: BaseException) -> bool:
        return False


if __name__ == "__main__":
    print(f"PARENT {os.getpid()}", flush=True)
    specs = [JobSpec(f"f/{i}", "f", seed=i, job=Forever()) for i in range(4)]
    run_sync(
        run_jobs,
        [LineupSpec("f", "fp-f", jobs=iter(specs), n_jobs=4)],
        RunConfig(devices=["cpu", "cpu"], out_dir=sys.argv[1], max_batch_size=2, progress=False),
    )
