"""Moving a ledger aside for a fresh start: nothing a user ran is ever deleted by the ledger."""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["move_aside"]


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def move_aside(path: Path) -> Path | None:
    """Rename ``path`` and its -wal/-shm files to ``<stem>.<UTC timestamp>.sqlite*``; return the new path.

    The -wal file holds committed transactions not yet copied into the main file, so it travels with it
    (SQLite pairs them by name). Two fresh starts in one second get ``-1``, ``-2``... suffixes. Called only
    with the writer lock held, so no process is writing these files.
    """
    if not path.exists():
        for suffix in ("-wal", "-shm"):  # orphans of a ledger deleted by hand must not meet a new one
            orphan = path.with_name(path.name + suffix)
            if orphan.exists():
                orphan.rename(path.with_name(f"{path.stem}.orphan-{_stamp()}{path.suffix}{suffix}"))
        return None
    stamp = _stamp()
    target = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
        n += 1
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    path.rename(target)
    return target
