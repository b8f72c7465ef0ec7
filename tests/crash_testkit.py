"""Helpers for tests that run a rollout in a child process and SIGKILL it: its events, its processes.

The child tells the test what happened on its stdout (one line per event); the test waits on those lines
with a timeout, never on time. Process checks read ``/proc`` and wait on pidfds (Linux).
"""

from __future__ import annotations

import os
import queue
import select
import subprocess
import threading
from collections.abc import Iterable

__all__ = ["children", "exited", "lines", "turn_events"]


def lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The child's stdout lines, read by a thread so the test can wait for each with a timeout (None: EOF)."""
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` now."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            found.add(int(entry))
    return found


def exited(pid: int, *, timeout: float) -> bool:
    """Wait on a pidfd (readable once the process has exited, even as an unreaped zombie)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def turn_events(output: Iterable[str]) -> dict[str, list[int]]:
    """``TURN ... <job> <index>`` lines -> the turn indices each job generated, in order."""
    generated: dict[str, list[int]] = {}
    for line in output:
        if line.startswith("TURN "):
            *_, job, index = line.split()
            generated.setdefault(job, []).append(int(index))
    return generated
