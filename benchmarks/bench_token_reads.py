"""What token records cost the readers that do not ask for them (issue 40). Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/bench_token_reads.py [--jobs 10000] [--turns 8] [--tokens 256] [--repeats 3]

Writes two ledgers of ``--jobs`` finished jobs x ``--turns`` turns of ~1 KB of text through the writer: one
without token records, one where every turn has one (``--tokens`` ids, two float32 arrays, a prompt that
is a difference from its speaker's previous turn, as a debate's are). Then times, side by side and
interleaved (``--repeats`` each, medians), ``interlens status``'s facts (``run_status``) and a plain export
(``ledger_rows``: every job's row, transcripts included). Schema 7 keeps the records in ``turn_tokens`` and
``token_stream``, which neither reads, and a local turn's marker in its turns row (``stored_tokens``), not
its JSON, so both should take the same time. For reference the same ledger as schema 6 stored it (the
marker ``{"stored":"turn_tokens"}`` in each recorded turn's JSON) is timed too, and with ``--older``
as schema 5 (a marker with the count and digest) and schema 4 (the records back in the turns' JSON as
base64) stored it (``ledger_testkit``'s downgrades, then ``VACUUM``).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from interlens import Message, TokenRecord, Transcript
from interlens.cli._runs import run_status
from interlens.report import ledger_rows
from interlens.store import JobRecord, Ledger, LedgerReader

WORDS = "the a model answer because tabs spaces indentation code review team style".split()


def _transcript(job: int, turns: int, tokens: int, record: bool) -> list[dict[str, Any]]:
    rng = random.Random(job)
    messages = [Message("moderator", "Debate: tabs or spaces?")]
    seen: dict[str, list[int]] = {}
    for t in range(turns):
        author = "ab"[t % 2]
        text = " ".join(rng.choice(WORDS) for _ in range(180))
        meta: dict[str, Any] = {"n_tokens": tokens, "finish_reason": "length"}
        if record:
            ids = [rng.randrange(49_152) for _ in range(tokens)]
            prompt = [*seen.get(author, [1, 2, 3]), *(rng.randrange(49_152) for _ in range(tokens + 20))]
            logprobs = [-rng.random() * 4 for _ in range(tokens)]
            sampled = [v * 0.9 for v in logprobs]
            meta["tokens"] = TokenRecord.build(ids, logprobs, sampled, prompt).to_json()
            seen[author] = [*prompt, *ids]
        messages.append(Message(author, text, meta))
    return Transcript(messages).to_json()


async def _write(out: Path, jobs: int, turns: int, tokens: int, record: bool) -> None:
    async with await Ledger.open(out) as ledger:
        await ledger.begin_run({"debate": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"rollout_{j:05d}", "debate", seed=j) for j in range(jobs))

        async def one(j: int) -> None:
            job = f"rollout_{j:05d}"
            messages = _transcript(j, turns, tokens, record)
            await ledger.start_job(job, device="cpu")
            for i, message in enumerate(messages[1:]):
                await ledger.record_turn(job, i, message)
            conversation = {"transcript": messages, "seed": j}
            await ledger.finish_job(job, conversation=conversation, analysis=None, tokens_generated=turns)

        for start in range(0, jobs, 64):
            async with anyio.create_task_group() as tg:
                for j in range(start, min(start + 64, jobs)):
                    tg.start_soon(one, j)
        await ledger.end_run("completed")


def _as_schema(src: Path, dst: Path, version: int) -> None:
    """``src``'s ledger as schema ``version`` stored it (5: the old marker; 4: the records back in the turns'
    JSON; the tests' downgrade, ``tests/ledger_testkit.as_schema``), compacted as written."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ledger_testkit import as_schema

    dst.mkdir()
    shutil.copy(src / "ledger.sqlite", dst / "ledger.sqlite")
    as_schema(dst / "ledger.sqlite", version)
    conn = sqlite3.connect(dst / "ledger.sqlite", isolation_level=None)
    conn.execute("VACUUM")
    conn.close()


def _stripped(src: Path, dst: Path) -> None:
    """``src``'s ledger without its records (rows, stream, flags), compacted: the ledger written without
    records commits its turns in another order (the writer's timing differs), which alone moves a plain
    export by a few per cent either way; this one differs from ``src`` by the records only."""
    dst.mkdir()
    shutil.copy(src / "ledger.sqlite", dst / "ledger.sqlite")
    conn = sqlite3.connect(dst / "ledger.sqlite", isolation_level=None)
    conn.execute("DELETE FROM turn_tokens")
    conn.execute("DELETE FROM token_stream")
    conn.execute("UPDATE turns SET stored_tokens = NULL")
    conn.execute("VACUUM")
    conn.close()


def _status(out: Path) -> None:
    with LedgerReader(out) as reader:
        run_status(reader)


def _export(out: Path) -> None:
    for _ in ledger_rows(out):
        pass


def _timed(fn: Callable[[Path], None], out: Path) -> float:
    start = time.perf_counter()
    fn(out)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--older", action="store_true", help="also time schemas 5 and 4 (slower)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_token_reads_"))
    try:
        dirs = {"without records": root / "plain", "with records": root / "tokens"}
        for label, out in dirs.items():
            start = time.perf_counter()
            anyio.run(_write, out, args.jobs, args.turns, args.tokens, label == "with records")
            size = (out / "ledger.sqlite").stat().st_size
            print(f"  wrote {label}: {time.perf_counter() - start:.1f} s, {size / 2**20:.0f} MiB")
        dirs["the same, records stripped"] = root / "stripped"  # its rows in the same order (see _stripped)
        _stripped(dirs["with records"], dirs["the same, records stripped"])
        dirs["schema 6 (marker in JSON)"] = root / "v6"
        _as_schema(dirs["with records"], dirs["schema 6 (marker in JSON)"], 6)
        if args.older:
            dirs["schema 5 marker"] = root / "v5"
            _as_schema(dirs["with records"], dirs["schema 5 marker"], 5)
            dirs["schema 4 (base64 in JSON)"] = root / "v4"
            _as_schema(dirs["with records"], dirs["schema 4 (base64 in JSON)"], 4)
        for name, fn in (("status", _status), ("plain export", _export)):
            times: dict[str, list[float]] = {label: [] for label in dirs}
            for _ in range(args.repeats):
                for label, out in dirs.items():  # interleaved: the machine's drift hits all alike
                    times[label].append(_timed(fn, out))
            print(
                f"  {name}: "
                + "; ".join(
                    f"{label} {statistics.median(t):.2f} s ({min(t):.2f}-{max(t):.2f})"
                    for label, t in times.items()
                )
            )
            base = times["without records"]
            print(  # each repeat's ratio to the ledger without records, timed next to it
                f"  {name} / without records: "
                + "; ".join(
                    f"{label} {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"
                    for label, t in times.items()
                    if label != "without records"
                    for r in [[a / b for a, b in zip(t, base, strict=True)]]
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
