"""Where token records' bytes go in the ledger file (issue 40): layouts side by side. Prints; asserts nothing.

    .venv/bin/python benchmarks/bench_token_layout.py [--jobs 1000] [--turns 8] [--tokens 256] [--repeats 3]

A 256-token record is ~2.7 KB (2-byte ids, two float32 log-probabilities per id, facts). Stored as a row of
its own it filled a 4 KiB page alone, so the file grew by ~3.4x the turns' text where the records were
~2.3x. Two parts:

1. **SQLite alone** (the shapes, no interlens code): the same records, ``--jobs`` jobs x ``--turns`` turns
   appended turn by turn across jobs as a rollout does, stored as one row each at page sizes 4-64 KiB, as
   rows cut into pieces of 500 or 1,000 bytes, and as one byte stream cut into page-sized segments (schema
   7's ``token_stream``); each file against the same file without records, after ``VACUUM``: what the
   records grow it by, x the text.
2. **The writer**: the same turns recorded through ``Ledger.record_turn`` (64 jobs at a time, group commit)
   with the records in the stream (schema 7), as rows in their own columns (schema 6's layout: the stream's
   append replaced by the row's values as they are), and as those rows in a file of 32 KiB pages (the
   other way to fill pages); interleaved, ``--repeats`` each: committed turns/s (median (min-max)) and each
   repeat's ratio to schema 6's layout timed next to it, and what the records grow each file by against a
   ledger without records of the same page size (as written, WAL checkpointed, no ``VACUUM``).

Records: each turn's token count is 256 (80 %) or 60-255 (a turn that ended early), ~4.7 bytes of text a
token (SmolLM2's tokenizer on English), random ids and log-probabilities (incompressible, as real float32
log-probabilities nearly are).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

from interlens import Message, TokenRecord
from interlens.store import JobRecord, Ledger

_BYTES_PER_TOKEN = 4.7


def _shapes(jobs: int, turns: int, tokens: int, seed: int = 1) -> Iterator[tuple[int, int, int]]:
    """(turn, job, token count) in the order a rollout commits them: turn by turn across its jobs."""
    rng = random.Random(seed)
    for turn in range(turns):
        for job in range(jobs):
            yield turn, job, tokens if rng.random() < 0.8 else rng.randrange(60, tokens)


# ------------------------------------------------------------------------------------------ SQLite alone


def _sqlite_file(path: str, page: int, layout: str | None, jobs: int, turns: int, tokens: int) -> int:
    """The records' text bytes; writes the file at ``path`` in ``layout`` (None: no records)."""
    if os.path.exists(path):
        os.remove(path)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(f"PRAGMA page_size = {page}")
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("CREATE TABLE turns (job_id TEXT, idx INTEGER, turn_json TEXT, PRIMARY KEY (job_id, idx))")
    db.execute(
        "CREATE TABLE turn_tokens (job_id TEXT, idx INTEGER, facts_json TEXT, ids BLOB, model BLOB, "
        "sampling BLOB, prompt BLOB, PRIMARY KEY (job_id, idx))"
    )
    db.execute("CREATE TABLE pieces (k INTEGER PRIMARY KEY, data BLOB)")
    text_bytes, stream = 0, bytearray()
    facts = json.dumps({"format": 1, "id_bytes": 2, "sampling": "array", "keep": 300, "digest": "0a1b2c3d"})
    last_turn = -1
    for turn, job, n in _shapes(jobs, turns, tokens):
        if turn != last_turn:
            if last_turn >= 0:
                db.execute("COMMIT")
            db.execute("BEGIN")
            last_turn = turn
        text = "x" * int(n * _BYTES_PER_TOKEN)
        text_bytes += len(text)
        body = {"author": "ab"[turn % 2], "content": text, "metadata": {"n_tokens": n}}
        db.execute("INSERT INTO turns VALUES (?, ?, ?)", (f"row_{job:05d}", turn, json.dumps(body)))
        if layout is None:
            continue
        parts = [os.urandom(2 * n), os.urandom(4 * n), os.urandom(4 * n), os.urandom(40)]
        key = (f"row_{job:05d}", turn)
        if layout == "row":
            db.execute("INSERT INTO turn_tokens VALUES (?, ?, ?, ?, ?, ?, ?)", (*key, facts, *parts))
            continue
        blob = b"".join(parts)
        pointer = json.dumps({"at": len(stream), "n": len(blob)})
        db.execute("INSERT INTO turn_tokens VALUES (?, ?, ?, NULL, x'', NULL, NULL)", (*key, facts + pointer))
        if layout.startswith("pieces"):
            size = int(layout.split()[1])
            for at in range(0, len(blob), size):
                db.execute("INSERT INTO pieces (data) VALUES (?)", (blob[at : at + size],))
        else:  # "stream": one byte stream in segments of 4,056 bytes (store/_token_stream.py)
            first = len(stream) // 4056
            stream += blob
            for k in range(first, (len(stream) - 1) // 4056 + 1):
                segment = bytes(stream[k * 4056 : (k + 1) * 4056])
                db.execute("INSERT OR REPLACE INTO pieces (k, data) VALUES (?, ?)", (k, segment))
    db.execute("COMMIT")
    db.execute("VACUUM")
    db.close()
    return text_bytes


def sqlite_layouts(jobs: int, turns: int, tokens: int) -> None:
    layouts = [(page, "row") for page in (4096, 8192, 16384, 32768, 65536)]
    layouts += [(4096, "pieces 1000"), (4096, "pieces 500"), (4096, "stream")]
    with tempfile.TemporaryDirectory() as out:
        plain: dict[int, int] = {}
        for page, layout in layouts:
            if page not in plain:
                _sqlite_file(f"{out}/plain.db", page, None, jobs, turns, tokens)
                plain[page] = os.path.getsize(f"{out}/plain.db")
            text = _sqlite_file(f"{out}/with.db", page, layout, jobs, turns, tokens)
            grown = os.path.getsize(f"{out}/with.db") - plain[page]
            print(
                f"  {layout:<12} {page // 1024:>2} KiB pages: the records grow the file by "
                f"{grown / text:.2f}x the text (without them {plain[page] / 2**20:.1f} MiB, "
                f"text {text / 2**20:.1f} MiB)"
            )


# --------------------------------------------------------------------------------------------- the writer


def _turn(rng: random.Random, turn: int, n: int) -> dict[str, Any]:
    ids = [rng.randrange(49_152) for _ in range(n)]
    logprobs = [-rng.random() * 4 for _ in range(n)]
    record = TokenRecord.build(ids, logprobs, [v * 0.9 for v in logprobs], [1, 2, 3, *ids[:20]])
    meta = {"n_tokens": n, "finish_reason": "length", "tokens": record.to_json()}
    return Message("ab"[turn % 2], "x" * int(n * _BYTES_PER_TOKEN), meta).to_json()


async def _write(out: Path, jobs: int, turns: int, tokens: int, record: bool) -> float:
    """Record every turn through the writer; the seconds recording took (64 jobs at a time)."""
    rng = random.Random(7)
    shapes = list(_shapes(jobs, turns, tokens))
    messages = {(job, turn): _turn(rng, turn, n) for turn, job, n in shapes}
    if not record:
        for message in messages.values():
            del message["metadata"]["tokens"]
    async with await Ledger.open(out) as ledger:
        await ledger.begin_run({"debate": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"row_{j:05d}", "debate", seed=j) for j in range(jobs))
        start = time.perf_counter()

        async def one(job: int) -> None:
            for turn in range(turns):
                await ledger.record_turn(f"row_{job:05d}", turn, messages[job, turn])

        for first in range(0, jobs, 64):
            async with anyio.create_task_group() as tg:
                for job in range(first, min(first + 64, jobs)):
                    tg.start_soon(one, job)
        seconds = time.perf_counter() - start
        await ledger.end_run("completed")
    return seconds


def _empty_file(out: Path, page: int) -> None:
    """An empty SQLite file of ``page``-byte pages: the writer creates its ledger in it."""
    out.mkdir(parents=True)
    db = sqlite3.connect(out / "ledger.sqlite")
    db.execute(f"PRAGMA page_size = {page}")
    db.execute("PRAGMA journal_mode = WAL")
    db.close()


def _size(out: Path) -> int:
    db = sqlite3.connect(out / "ledger.sqlite")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return (out / "ledger.sqlite").stat().st_size


def writer_layouts(jobs: int, turns: int, tokens: int, repeats: int) -> None:
    import interlens.store._turn_ops as turn_ops

    streamed = turn_ops.append

    async def in_columns(conn: Any, rows: Any) -> list[tuple[Any, ...]]:  # schema 6's layout
        return [tuple(values) for values in rows]

    ways = {"stream (schema 7)": 4096, "rows in columns (schema 6)": 4096, "rows, 32 KiB pages": 32768}
    text = sum(int(n * _BYTES_PER_TOKEN) for _, _, n in _shapes(jobs, turns, tokens))
    rates: dict[str, list[float]] = {way: [] for way in ways}
    growth: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root:
        plain: dict[int, int] = {}
        for page in sorted(set(ways.values())):
            _empty_file(Path(root) / f"plain{page}", page)
            anyio.run(_write, Path(root) / f"plain{page}", jobs, turns, tokens, False)
            plain[page] = _size(Path(root) / f"plain{page}")
        for r in range(repeats):
            for k, (way, page) in enumerate(ways.items()):  # interleaved: the machine's drift hits all alike
                out = Path(root) / f"w{r}_{k}"
                _empty_file(out, page)
                turn_ops.append = streamed if way.startswith("stream") else in_columns  # type: ignore[assignment]
                try:
                    seconds = anyio.run(_write, out, jobs, turns, tokens, True)
                finally:
                    turn_ops.append = streamed  # type: ignore[assignment]
                rates[way].append(jobs * turns / seconds)
                growth[way] = (_size(out) - plain[page]) / text
    base = rates["rows in columns (schema 6)"]
    for way, values in rates.items():
        ratios = [a / b for a, b in zip(values, base, strict=True)]  # each repeat's, timed next to each other
        print(
            f"  {way:<28} {statistics.median(values):>8,.0f} committed turns/s "
            f"({min(values):,.0f}-{max(values):,.0f}), / schema 6's {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}); the records grow the file by {growth[way]:.2f}x the text"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-writer", action="store_true")
    args = parser.parse_args()
    print(f"SQLite alone: {args.jobs} jobs x {args.turns} turns, up to {args.tokens} tokens a turn")
    sqlite_layouts(args.jobs, args.turns, args.tokens)
    if not args.skip_writer:
        print(f"The writer: {args.jobs} jobs x {args.turns} turns, {args.repeats} repeats, interleaved")
        writer_layouts(args.jobs, args.turns, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
