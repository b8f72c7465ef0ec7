"""Child of tests/store/test_turn_tokens.py: records a burst of turns with token records, concurrently, and
prints ``ACK <job> <idx>`` once each is durable; the test SIGKILLs it mid-burst."""

from __future__ import annotations

import sys

import anyio

from interlens import Message, TokenRecord
from interlens.store import JobRecord, Ledger


def _ids(job: int, idx: int) -> list[int]:
    return [(job * 7 + idx * 1_000 + k) % 50_000 for k in range(64 + idx)]


def turn(job: int, idx: int) -> dict[str, object]:
    """Turn ``idx`` of ``job``: its prompt quotes the previous turn's answer (stored as a reference)."""
    n = 64 + idx
    quoted = _ids(job, idx - 1) if idx else []
    record = TokenRecord.build(
        _ids(job, idx),
        [-(k % 13) / 7 for k in range(n)],
        [-(k % 5) / 3 for k in range(n)],
        [*range(idx * 10, idx * 10 + 40), *quoted, 1],
    )
    return Message(
        f"s{idx % 2}", f"turn {idx} of job {job}", {"n_tokens": n, "tokens": record.to_json()}
    ).to_json()


async def main(out_dir: str, jobs: int, turns: int) -> None:
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"burst": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"job_{j}", "burst", seed=j) for j in range(jobs))

        async def one(j: int) -> None:
            await ledger.start_job(f"job_{j}", device="cpu")
            for i in range(turns):
                await ledger.record_turn(f"job_{j}", i, turn(j, i))
                print(f"ACK job_{j} {i}", flush=True)

        async with anyio.create_task_group() as tg:
            for j in range(jobs):
                tg.start_soon(one, j)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
