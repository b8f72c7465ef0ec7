"""One live writer per out_dir: an ``flock`` on ``out_dir/ledger.lock``.

Why flock on an open descriptor rather than "create the file if absent": the kernel drops the lock the
moment the holding process dies, SIGKILL included, so a lock left behind by a dead run is taken over with no
stale-pid guesswork (and no race between two runs both deciding a pid is dead). The file's contents (pid,
host, start time) are only there to name the holder in the error. Python opens descriptors non-inheritable,
so spawned worker processes never keep a dead parent's lock alive. flock is advisory and per open file
description, so a second ``Ledger.open`` in the same process is refused too.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Final

from ._errors import LedgerLockedError

__all__ = ["LOCK_FILENAME", "WriterLock"]

LOCK_FILENAME: Final = "ledger.lock"


class WriterLock:
    """The exclusive writer lock of one out_dir. Acquire with :meth:`acquire`, drop with :meth:`release`."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, out_dir: Path) -> WriterLock:
        """Take the lock or raise :class:`LedgerLockedError` naming the live holder."""
        path = out_dir / LOCK_FILENAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise LedgerLockedError(
                f"{out_dir} is being written by another live run ({holder}). Two runs must not write one "
                f"ledger: wait for that run to finish or stop it, or give this run a different out_dir."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        return cls(fd, path)

    def __del__(self) -> None:  # a safety net only: Ledger.close releases it
        if self._fd is not None:
            os.close(self._fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock. The file stays (deleting it would race with a process that just opened it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _describe_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw) if raw else {}
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "its pid is not recorded yet: it is starting up"
    return f"pid {info.get('pid')} on host {info.get('host', '?')}, since {info.get('since', '?')}"
