"""A ledger writer that runs until it is SIGKILLed, for test_ledger_crash.py.

Usage: python _crash_writer.py OUT_DIR ROUND

It resumes what earlier (killed) rounds left — jobs left running are requeued, pending ones restarted from
their last committed turn — then runs new jobs forever, several at once so that writes are group-committed.
After EVERY awaited ledger write returns it prints one acknowledgement line (flushed), so the parent knows
exactly which writes the ledger has promised to keep. Turn contents are a pure function of (job id, index),
so the parent can check them byte for byte. Any inconsistency it sees on resume is printed as a BAD line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import anyio

from interlens.store import BatchRecord, JobRecord, Ledger, LedgerReader

CONCURRENCY = 6
LINEUP = "crash"
FINGERPRINT = "fp-crash-v1"


def n_turns(job_id: str) -> int:
    return 3 + hashlib.sha256(job_id.encode()).digest()[0] % 6


def outcome(job_id: str) -> str:
    """done for most jobs; some fail, some are handed back to pending (a dead worker)."""
    b = hashlib.sha256(job_id.encode()).digest()[1] % 8
    return {0: "fail", 1: "pending"}.get(b, "done")


def turn_content(job_id: str, index: int) -> dict[str, object]:
    digest = hashlib.sha256(f"{job_id}/{index}".encode()).hexdigest()
    return {"speaker": "ab"[index % 2], "index": index, "content": digest * (2 + int(digest[0], 16) * 3)}


def ack(*parts: object) -> None:
    """One write(2) per line: a pipe write under PIPE_BUF is atomic, so a kill never leaves half a line
    (print() may issue several writes)."""
    os.write(1, (" ".join(map(str, parts)) + "\n").encode())


async def run_job(ledger: Ledger, job_id: str) -> None:
    attempt = await ledger.start_job(job_id, device="cpu")
    ack("START", job_id, attempt)
    committed = await ledger.committed_turns(job_id)
    for i, turn in enumerate(committed):
        if turn != turn_content(job_id, i):
            ack("BAD", job_id, "committed turn", i, "differs")
    ack("RESUME", job_id, len(committed))
    for index in range(len(committed), n_turns(job_id)):
        await ledger.record_turn(job_id, index, turn_content(job_id, index))
        ack("TURN", job_id, index)
    kind = outcome(job_id)
    if kind == "fail":
        await ledger.fail_job(
            job_id, error_type="ValueError", message=f"boom {job_id}", traceback="Traceback: ..."
        )
        ack("FAILED", job_id)
    elif kind == "pending":
        await ledger.return_to_pending(job_id)
        ack("PENDING", job_id)
    else:
        turns = [turn_content(job_id, i) for i in range(n_turns(job_id))]
        await ledger.finish_job(
            job_id, conversation={"transcript": turns}, analysis={"job": job_id}, tokens_generated=len(turns)
        )
        ack("DONE", job_id)


async def main(out_dir: Path, round_no: int) -> None:
    ledger = await Ledger.open(out_dir)
    run_id = await ledger.begin_run({LINEUP: FINGERPRINT}, versions={"python": sys.version.split()[0]})
    ack("RUN", run_id)
    requeued = await ledger.requeue_running()
    ack("REQUEUED", json.dumps(requeued))
    batch_id = f"batch_r{round_no}"
    await ledger.record_batch(BatchRecord("openai", batch_id, "in_progress", requests={"c0": ("none", 0)}))
    ack("BATCH", batch_id)
    with LedgerReader(out_dir) as reader:
        todo = reader.job_ids(state="pending")

    send, receive = anyio.create_memory_object_stream[str](0)

    async def worker() -> None:
        async for job_id in receive:
            await run_job(ledger, job_id)

    async with anyio.create_task_group() as tg:
        for _ in range(CONCURRENCY):
            tg.start_soon(worker)
        for job_id in todo:
            await send.send(job_id)
        k = 0
        while True:  # until SIGKILL
            job_id = f"r{round_no:02d}_j{k:04d}"
            await ledger.add_jobs([JobRecord(job_id, LINEUP, seed=k)])
            ack("ADD", job_id)
            if k == 3:
                await ledger.update_batch("openai", batch_id, state="ended")
                ack("BATCHSTATE", batch_id, "ended")
            await send.send(job_id)
            k += 1


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]))
