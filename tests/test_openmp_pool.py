"""The caller's OpenMP thread pool is given back before generation runs in another thread (issue 24).

Torch work on the caller's thread leaves a libgomp thread pool there, and while it lives every parallel
region of the thread that generates runs slower (measured in benchmarks/bench_main_thread.py; timing is
not a unit test's business). What a test can see is whether the pool is gone: the threads libgomp started
for the caller's parallel region exit. The checks run in fresh interpreters, whose threads are their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytest.importorskip("torch")

_PRELUDE = """
import json, os, sys, threading
import torch
torch.set_num_threads(2)  # a pool of one helper thread even on a one-CPU machine

def tids():
    return set(os.listdir("/proc/self/task"))

def main_thread_work():
    '''A parallel region on this thread: the helper threads libgomp started for it.'''
    before = tids()
    x = torch.randn(2048, 2048)
    for _ in range(3):
        x + x
    return tids() - before
"""


def _child(body: str, *args: str) -> dict[str, Any]:
    code = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_releasing_frees_the_calling_threads_pool_and_spares_other_threads() -> None:
    """Only the caller's pool goes, while another thread's parallel regions run on undisturbed."""
    out = _child(
        """
        from interlens.scheduler import release_openmp_pool

        pool = main_thread_work()
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        want = (a @ b).sum().item()
        wrong, stop = [], threading.Event()

        def other():
            while not stop.is_set():
                got = (a @ b).sum().item()
                if got != want:
                    wrong.append(got)

        worker = threading.Thread(target=other)
        worker.start()
        released = []
        for _ in range(30):  # build and free the caller's pool again and again beside the other thread
            main_thread_work()
            released.append(release_openmp_pool())
        stop.set()
        worker.join()
        print(json.dumps({"pool": len(pool), "left": len(pool & tids()), "released": all(released),
                          "wrong": len(wrong)}))
        """
    )
    assert out["pool"] >= 1 and out["released"] is True
    assert out["left"] == 0  # the helper threads of the caller's first region have exited
    assert out["wrong"] == 0


@pytest.fixture(scope="module")
def callers(qwen2_path: str) -> dict[str, Any]:
    """One fresh interpreter runs each caller in turn, after leaving a pool on its main thread each time:
    ``conv.run()`` from a script (the loop runs on the caller's thread), from inside a running event loop
    as in a notebook (``run_sync`` runs it on a helper thread while the caller waits), and an in-process
    rollout (the scheduler hands every engine call to a thread through one function)."""
    return _child(
        """
        import asyncio
        from interlens import AutoModelParticipant, Conversation
        from interlens.scheduler import release_openmp_pool

        model = AutoModelParticipant.from_pretrained(sys.argv[1], name="a", max_new_tokens=3)

        def fresh():  # a conversation that has not run (a run one has its turns already)
            return Conversation([model], shared_context="hi").turns(1)

        fresh().rollout(n=1, progress=False)  # load the engine

        def after(work):
            pool = main_thread_work()
            failed = work()
            left = len(pool & tids())
            release_openmp_pool()  # the next case starts without a pool, whatever this one did
            return {"pool": len(pool), "left": left, "failed": failed}

        def turn():
            conv = fresh()
            conv.run()
            return 1 - conv.generated_turns  # 0: the turn was generated

        async def in_loop():
            return after(turn)

        out = {
            "script": after(turn),
            "inside a running loop": asyncio.run(in_loop()),
            "rollout": after(lambda: len(fresh().rollout(n=2, progress=False).failed)),
        }
        print(json.dumps(out))
        """,
        qwen2_path,
    )


@pytest.mark.parametrize("where", ["script", "inside a running loop"])
def test_a_live_turn_gives_back_the_callers_pool(callers: dict[str, Any], where: str) -> None:
    """Either way the pool the caller's torch work left is gone once the turn has been generated."""
    out = callers[where]
    assert out["failed"] == 0 and out["pool"] >= 1 and out["left"] == 0


def test_a_rollout_in_process_gives_back_the_callers_pool(callers: dict[str, Any]) -> None:
    out = callers["rollout"]
    assert out["failed"] == 0 and out["pool"] >= 1 and out["left"] == 0
