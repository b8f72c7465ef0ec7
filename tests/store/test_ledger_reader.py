"""The synchronous read-only side: consistent while a run writes, lazy, in job order."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from interlens.store import JOB_STATES, JobRecord, Ledger, LedgerReader


async def test_a_reader_sees_consistent_snapshots_while_a_run_writes(tmp_path: Path) -> None:
    """A reader thread polls a live ledger; the writer pauses half-way until the reader has seen that point,
    so the reader provably reads mid-run. No snapshot may show a done job without its result."""
    jobs = [f"job_{i:03d}" for i in range(200)]
    halfway_seen = threading.Event()
    observations: list[dict[str, int]] = []
    stop = threading.Event()

    def poll() -> None:
        with LedgerReader(tmp_path) as reader:
            while not stop.is_set():
                counts = reader.counts()
                observations.append(counts)
                for job, result in reader.iter_results(states=("done",), page_size=32):
                    assert result is not None and result["analysis"] == {"id": job.job_id}
                assert len(reader.done_job_ids()) >= counts["done"]  # later read, never fewer
                if counts["done"] == 100:
                    halfway_seen.set()
                if counts["done"] == len(jobs):
                    return

    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"lineup": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(job, "lineup", seed=i) for i, job in enumerate(jobs))

        async def finish(job: str) -> None:
            await ledger.start_job(job, device="cpu")
            await ledger.record_turn(job, 0, {"content": job})
            await ledger.finish_job(job, conversation={"t": [job]}, analysis={"id": job}, tokens_generated=3)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, poll)
                async with anyio.create_task_group() as writers:
                    for job in jobs[:100]:
                        writers.start_soon(finish, job)
                await anyio.to_thread.run_sync(halfway_seen.wait)  # the reader saw exactly the first half
                async with anyio.create_task_group() as writers:
                    for job in jobs[100:]:
                        writers.start_soon(finish, job)
        stop.set()
    done_seen = [o["done"] for o in observations]
    assert done_seen == sorted(done_seen) and done_seen[-1] == len(jobs) and 100 in done_seen
    assert all(sum(o.values()) == len(jobs) for o in observations)


async def _fill(out_dir: Path, n: int) -> list[str]:
    ids = [f"row_{i:05d}" for i in reversed(range(n))]  # job order is the reverse of lexical order
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"data": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(job, "data", seed=i, row_index=i) for i, job in enumerate(ids))
        for i, job in enumerate(ids):
            if i % 3 == 2:
                continue  # stays pending
            await ledger.start_job(job, device="cpu")
            if i % 3 == 0:
                await ledger.finish_job(
                    job, conversation={"i": i}, analysis={"sq": i * i}, tokens_generated=i
                )
            else:
                await ledger.fail_job(job, error_type="Boom", message=str(i), traceback="tb")
    return ids


async def test_iter_results_is_lazy_paged_and_in_job_order(tmp_path: Path) -> None:
    ids = await _fill(tmp_path, 60)
    with LedgerReader(tmp_path) as reader:
        got = list(reader.iter_results(page_size=7))
        assert [job.job_id for job, _ in got] == [j for i, j in enumerate(ids) if i % 3 != 2]
        for job, result in got:
            i = job.row_index
            assert i is not None
            if job.state == "done":
                assert result == {"conversation": {"i": i}, "analysis": {"sq": i * i}, "tokens_generated": i}
            else:
                assert (job.state, job.error_message, result) == ("failed", str(i), None)
        every = list(reader.iter_results(states=JOB_STATES, page_size=1000))
        assert [job.job_id for job, _ in every] == ids
        # Lazy: a half-consumed iterator holds no read transaction; rows committed meanwhile show up later.
        partial = reader.iter_results(states=("pending",), page_size=4)
        first = next(partial)[0].job_id
        async with await Ledger.open(tmp_path) as ledger:
            await ledger.add_jobs([JobRecord("late", "data", seed=0)])
        rest = [job.job_id for job, _ in partial]
        assert [first, *rest] == [j for i, j in enumerate(ids) if i % 3 == 2] + ["late"]
        with pytest.raises(ValueError, match="states must be a non-empty selection"):
            list(reader.iter_results(states=("finished",)))
        with pytest.raises(ValueError, match="states must be"):
            reader.job_ids(state="complete")


async def test_summary_counts_and_lookups(tmp_path: Path) -> None:
    ids = await _fill(tmp_path, 30)
    with LedgerReader(tmp_path / "ledger.sqlite") as reader:  # the file itself works too
        assert reader.counts() == {"pending": 10, "running": 0, "done": 10, "failed": 10}
        summary = reader.summary()
        assert summary["jobs"] == 30 and summary["counts"] == reader.counts()
        assert summary["tokens_generated"] == sum(i for i in range(30) if i % 3 == 0)  # failed ones: 0
        assert summary["failures_by_type"] == {"Boom": 10}
        assert summary["lineups"] == {"data": {"fingerprint": "fp", "counts": reader.counts()}}
        assert summary["runs"] == 1 and summary["last_run"]["status"] == "interrupted"
        assert summary["open_batches"] == 0
        assert reader.done_job_ids() == {j for i, j in enumerate(ids) if i % 3 == 0}
        assert reader.job_ids(state="failed", lineup="data") == [j for i, j in enumerate(ids) if i % 3 == 1]
        assert reader.job_ids(lineup="other") == []
        assert reader.turns(ids[0]) == [] and reader.integrity_check() == "ok"
