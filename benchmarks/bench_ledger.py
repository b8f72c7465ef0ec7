"""Ledger throughput and scan times on a real file (issue #3's figures). Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/bench_ledger.py [--jobs 100000] [--concurrency 64] [--dir /tmp/x]

Measures, over a ledger of ``--jobs`` jobs:
  * committed turns/s with many concurrent jobs (group commit; every turn durable against SIGKILL when its
    ``await`` returns — WAL + synchronous=NORMAL), and the same with synchronous=FULL (power-loss safe);
  * committed turns/s from a single sequential caller (no grouping possible: the latency bound);
  * finish_job/s (result + state in one transaction);
  * the resume scan (done ids, requeue) and the writer's open time (includes PRAGMA quick_check);
  * report open time: LedgerReader open + counts, + summary, and iterating every result.
Targets (2-core CI machine): >= 5,000 committed turns/s concurrent; resume scan of 100,000 jobs < 2 s.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import anyio

from interlens.store import JobRecord, Ledger, LedgerReader

TURN = {
    "speaker": "a",
    "content": "lorem ipsum dolor sit amet " * 18,
    "metadata": {"n_tokens": 96, "batched": True},
}


def _row(label: str, value: float, unit: str, note: str = "") -> None:
    print(f"  {label:<46} {value:>12,.1f} {unit:<10} {note}")


async def _concurrent_turns(ledger: Ledger, jobs: list[str], turns_per_job: int, concurrency: int) -> float:
    """Record ``turns_per_job`` turns for every job, ``concurrency`` jobs at a time; return turns/s."""
    send, receive = anyio.create_memory_object_stream[str](len(jobs))
    for job in jobs:
        send.send_nowait(job)
    send.close()

    async def worker() -> None:
        async for job in receive:
            for index in range(turns_per_job):
                await ledger.record_turn(job, index, TURN)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return len(jobs) * turns_per_job / (time.perf_counter() - start)


async def _bench(root: Path, n_jobs: int, concurrency: int) -> None:
    ids = [f"lineup/row_{i:06d}" for i in range(n_jobs)]
    out = root / "main"
    print(f"ledger benchmark: {n_jobs:,} jobs, concurrency {concurrency}, in {root}")

    async with await Ledger.open(out) as ledger:
        await ledger.begin_run({"lineup": "fp"}, versions={})
        start = time.perf_counter()
        await ledger.add_jobs(JobRecord(job, "lineup", seed=i, row_index=i) for i, job in enumerate(ids))
        _row("add_jobs", n_jobs / (time.perf_counter() - start), "jobs/s")

        turn_jobs = ids[: min(n_jobs, 20_000)]
        rate = await _concurrent_turns(ledger, turn_jobs, 3, concurrency)
        stats = ledger.commit_stats
        _row(
            "committed turns/s, concurrent (NORMAL)",
            rate,
            "turns/s",
            f"target >= 5,000: {'OK' if rate >= 5000 else 'MISSED'}; "
            f"{stats['operations'] / max(stats['transactions'], 1):.0f} ops/transaction",
        )

        seq_job = ids[-1]
        start = time.perf_counter()
        for index in range(2000):
            await ledger.record_turn(seq_job, index, TURN)
        _row("committed turns/s, one sequential caller", 2000 / (time.perf_counter() - start), "turns/s")

        send, receive = anyio.create_memory_object_stream[str](n_jobs)
        for job in ids:
            send.send_nowait(job)
        send.close()

        async def finisher() -> None:
            async for job in receive:
                await ledger.start_job(job, device="cpu")
                await ledger.finish_job(
                    job, conversation={"transcript": [TURN] * 3}, analysis={"ok": True}, tokens_generated=288
                )

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(finisher)
        _row("start_job + finish_job, concurrent", n_jobs / (time.perf_counter() - start), "jobs/s")
        await ledger.end_run("completed")

    size = sum(p.stat().st_size for p in out.iterdir())
    _row("ledger size", size / 2**20, "MiB")

    start = time.perf_counter()
    ledger = await Ledger.open(out)
    _row("Ledger.open (with quick_check)", (time.perf_counter() - start) * 1000, "ms")
    async with ledger:
        await ledger.begin_run({"lineup": "fp"}, versions={})
        start = time.perf_counter()
        done = await ledger.done_job_ids()
        requeued = await ledger.requeue_running()
        scan = time.perf_counter() - start
        assert len(done) == n_jobs and requeued == []
        _row(
            f"resume scan ({n_jobs:,} done ids + requeue)",
            scan * 1000,
            "ms",
            f"target < 2,000 ms: {'OK' if scan < 2 else 'MISSED'}",
        )

        start = time.perf_counter()
        with LedgerReader(out) as reader:  # while a writer is live
            reader.counts()
            opened = time.perf_counter() - start
            reader.summary()
            summarised = time.perf_counter() - start
            start = time.perf_counter()
            n = sum(1 for _ in reader.iter_results())
            iterated = time.perf_counter() - start
            start = time.perf_counter()
            for job in ids[:: max(1, n_jobs // 1000)]:
                reader.job(job)
                reader.result(job)
            lookups = time.perf_counter() - start
            n_lookups = len(ids[:: max(1, n_jobs // 1000)])
        _row("report open: LedgerReader + counts", opened * 1000, "ms")
        _row("report open: LedgerReader + counts + summary", summarised * 1000, "ms")
        _row(f"iter_results over {n:,} results", n / iterated, "results/s")
        _row("job() + result() lookup", lookups / n_lookups * 1e6, "us each")

    full = root / "full"
    async with await Ledger.open(full, synchronous="full") as ledger:
        await ledger.begin_run({"lineup": "fp"}, versions={})
        jobs = ids[: min(n_jobs, 5_000)]
        await ledger.add_jobs(JobRecord(job, "lineup", seed=i) for i, job in enumerate(jobs))
        rate = await _concurrent_turns(ledger, jobs, 3, concurrency)
        _row("committed turns/s, concurrent (FULL, fsync)", rate, "turns/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench_ledger_"))
    try:
        anyio.run(_bench, root, args.jobs, args.concurrency)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
