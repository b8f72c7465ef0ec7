"""The progress bar: done / failed / skipped and generated tokens per second.

Off unless someone is watching (stderr is a terminal, or we run inside a Jupyter kernel), so batch jobs and
CI logs get no bar noise; ``progress=True/False`` forces it. tqdm is imported only when the bar is on.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress", "progress_wanted"]


def progress_wanted(progress: bool | None) -> bool:
    if progress is not None:
        return bool(progress)
    if "ipykernel" in sys.modules:
        return True
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


class Progress:
    """Counts outcomes; draws a tqdm bar when enabled (and prints nothing otherwise)."""

    def __init__(self, *, enabled: bool, total: int | None) -> None:
        self.done = self.failed = self.skipped = 0
        self.tokens = 0
        self._started = time.monotonic()
        self._bar: Any = None
        if enabled:
            import importlib.util

            # tqdm.auto picks the notebook widget in a kernel, which needs ipywidgets; without it tqdm warns
            # "IProgress not found" and draws nothing useful, so fall back to the text bar quietly.
            if importlib.util.find_spec("ipywidgets") is not None:
                from tqdm.auto import tqdm
            else:
                from tqdm import tqdm

            self._bar = tqdm(total=total, unit="job", dynamic_ncols=True, desc="rollouts")

    def job_done(self, *, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        self._tick()

    def job_failed(self, *, tokens: int) -> None:
        self.failed += 1
        self.tokens += tokens
        self._tick()

    def job_skipped(self) -> None:
        self.skipped += 1
        self._tick()

    def _tick(self) -> None:
        if self._bar is None:
            return
        elapsed = max(time.monotonic() - self._started, 1e-9)
        self._bar.set_postfix(
            done=self.done,
            failed=self.failed,
            skipped=self.skipped,
            tok_s=f"{self.tokens / elapsed:.1f}",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
