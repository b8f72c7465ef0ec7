"""``transformers serve`` on loopback: a real OpenAI-compatible server (FastAPI, uvicorn, transformers'
continuous batching) for tests and benchmarks that point an ``APIParticipant`` at one, as users point
interlens at vLLM or a llama.cpp server. Needs ``transformers[serving]``."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["transformers_serve"]


@contextmanager
def transformers_serve(model: str, *, dtype: str | None = None, start_timeout: float = 180) -> Iterator[str]:
    """Serve ``model`` (a local directory) on a free loopback port on the CPU; yields the base URL
    (``http://127.0.0.1:PORT/v1``) once uvicorn says it is up, and stops the server on exit.

    ``dtype`` None: the server's default (the weights' own). The server gets this environment offline
    (``HF_HUB_OFFLINE=1``) and without its ``OPENAI_*``/``ANTHROPIC_*`` variables. A server that exits before
    it is up raises ``RuntimeError`` with the end of its log."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [str(Path(sys.executable).parent / "transformers"), "serve", model, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--continuous-batching", "--device", "cpu", "--log-level", "info"]
    if dtype is not None:
        command += ["--dtype", dtype]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    server = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            seen.append(line)
            lines.put(line)
        lines.put("")  # the server's stderr closed: it exited

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=start_timeout)  # the model loads before uvicorn starts listening
            if "Uvicorn running on" in line or "Application startup complete" in line:
                break
            if not line:
                raise RuntimeError(f"transformers serve exited {server.wait()}:\n{''.join(seen)[-3000:]}")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
