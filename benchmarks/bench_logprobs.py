"""What recording each token's log-probabilities costs a batch (issue 27: at most 5 % of batched throughput).

    python benchmarks/bench_logprobs.py [--model real] [--rows 16] [--max-new 128] [--repeats 3]
    python benchmarks/bench_logprobs.py --ledger [--model real] [--ledger-tokens 64] [--debates 16]
    python benchmarks/bench_logprobs.py --ledger --ledger-from OUT_DIR

``--ledger`` measures the records' size instead: ``--debates`` debates x 8 turns x up to ``--ledger-tokens``
tokens (``_common.debate``, T = 0.9) run into a fresh ledger with ``record_tokens`` on; prints the ledger's
size after ``VACUUM``, the turns' text, the records (their ``turn_tokens`` rows' bytes by part and the
markers their turns keep: schema 6, prompts' ids by reference where they can be) and what the records add
against the same ledger stripped of them (as a run without ``record_tokens`` writes it: recording changes
no token). ``--ledger-from`` measures an existing debate ledger instead (one a ``--ledger`` run, even one
still running, is writing): its committed turns, records whole, recorded again in order by this version's
writer into a fresh ledger, so a slow machine can measure the shape from the turns a run got through.

One ``LocalEngine.generate_batch`` of ``--rows`` chat questions on the real model (dtype: bfloat16 where
the CPU has it), each allowed ``--max-new`` tokens and ending at its own end-of-turn token, T = 0.9, seeded.
Timed with ``record_logprobs`` off and on, interleaved after a warm-up of each, each run in a fresh thread.
Recording changes no token (the tokens of every run are compared), so both ways do the same work but the
recording: a log-sum-exp over each row's logits per step, and one read of the values per batch. Prints
tok/s (median (min-max)) each way and the ratio. This machine's noise between runs is larger than the cost,
so the sampler's step is timed on its own too (``Sampler.choose`` on the batch's rows x the model's vocabulary
in the model's dtype, 200 calls, recording off and on): the added milliseconds against the batch's step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import (
    add_batch_options,
    cpu_summary,
    debate,
    fast_dtype,
    in_thread,
    model_path,
    question_batch,
    spread,
)


def _strip_records(src: str, dst: str) -> None:
    """``dst``: the ledger at ``src`` as a run without ``record_tokens`` would have written it (no
    ``turn_tokens`` rows, no marker in the turns' JSON). Recording changes no token (the batch measurement
    compares them), so this is that run's ledger without running the debates a second time."""
    import shutil
    import sqlite3

    shutil.copy(src, dst)
    db = sqlite3.connect(dst, isolation_level=None)
    db.execute("DELETE FROM turn_tokens")
    db.execute("DELETE FROM token_stream")
    db.execute("UPDATE turns SET stored_tokens = NULL")
    db.execute(
        "UPDATE turns SET turn_json = json_remove(turn_json, '$.metadata.tokens') "
        "WHERE json_type(turn_json, '$.metadata.tokens') IS NOT NULL"
    )
    db.execute("VACUUM")
    db.close()


def _in_columns(src: str, dst: str) -> int:
    """The size of the ledger at ``src`` as schema 6 stored the same records (each ``turn_tokens`` row's
    BLOBs in its own columns, a local turn's marker in its JSON: ``tests/ledger_testkit``'s downgrade),
    after ``VACUUM``."""
    import os
    import shutil
    import sqlite3
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ledger_testkit import as_schema

    shutil.copy(src, dst)
    as_schema(Path(dst), 6)
    db = sqlite3.connect(dst, isolation_level=None)
    db.execute("VACUUM")
    db.close()
    return os.path.getsize(dst)


def _rerecord(source: str, out: str) -> int:
    """``--ledger-from``: every committed turn of the ledger at ``source`` (a consistent copy is read, so a
    run may still be writing it; the records whole, as a resume replays them) recorded again, job by job and
    in order, by this version's writer into ``out``, each job finished with its turns as its transcript.
    Returns the jobs. The turns, ids and log-probabilities are the ones the model produced there."""
    import os
    import sqlite3
    import tempfile

    import anyio

    from interlens.store import JobRecord, Ledger

    async def copy(src: str, jobs: list[str]) -> None:
        async with await Ledger.open(src) as old, await Ledger.open(out) as new:
            await new.begin_run({"debate": "fp"}, versions={})
            await new.add_jobs(JobRecord(job, "debate", seed=k) for k, job in enumerate(jobs))
            for job in jobs:
                turns = await old.committed_turns(job)
                await new.start_job(job, device="cpu")
                for i, turn in enumerate(turns):
                    await new.record_turn(job, i, turn)
                transcript = {"transcript": turns}
                await new.finish_job(job, conversation=transcript, analysis=None, tokens_generated=0)
            await new.end_run("completed")

    with tempfile.TemporaryDirectory() as src:
        with sqlite3.connect(f"file:{os.path.join(source, 'ledger.sqlite')}?mode=ro", uri=True) as live:
            snapshot = sqlite3.connect(os.path.join(src, "ledger.sqlite"))
            live.backup(snapshot)
            query = "SELECT DISTINCT job_id FROM turns WHERE idx >= 0 ORDER BY job_id"
            jobs = [job for (job,) in snapshot.execute(query)]
            snapshot.close()
        anyio.run(copy, src, jobs)
    return len(jobs)


def ledger_sizes(path: str, dtype: str, new_tokens: int, debates: int, source: str | None = None) -> None:
    """The ``--ledger`` measurement (see the module docstring)."""
    import json
    import os
    import sqlite3
    import tempfile

    from interlens.store._token_rows import resolved
    from interlens.store._token_stream import filled

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        if source is None:
            conv = debate(path, turns=8, new_tokens=new_tokens, dtype=dtype, record_tokens=True)
            conv.rollout(n=debates, out_dir=out, seed=1, progress=False)
        else:
            debates = _rerecord(source, out)
        seconds = time.perf_counter() - start
        ledger = os.path.join(out, "ledger.sqlite")
        db = sqlite3.connect(ledger)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        live = os.path.getsize(ledger)  # as the run left it (schema 7: records' bytes in token_stream)
        turns = [json.loads(text) for (text,) in db.execute("SELECT turn_json FROM turns")]
        stored = db.execute(
            "SELECT job_id, idx, facts_json, ids, model_logprobs, sampling_logprobs, prompt_ids "
            "FROM turn_tokens"
        ).fetchall()
        segments = {int(k): bytes(data) for k, data in db.execute("SELECT k, data FROM token_stream")}
        rows = [(job, idx, *filled(values, segments)) for job, idx, *values in stored]
        db.execute("VACUUM")
        db.close()  # the write-ahead log folded in: the file's size is the ledger's
        size = os.path.getsize(ledger)
        _strip_records(ledger, os.path.join(out, "plain.sqlite"))
        plain = os.path.getsize(os.path.join(out, "plain.sqlite"))
        v6 = _in_columns(ledger, os.path.join(out, "v6.sqlite"))
    sources: dict[str, dict[int, bytes]] = {}
    for job, idx, _, ids, *_ in rows:
        if ids is not None:
            sources.setdefault(job, {})[idx] = ids
    parts = {"ids + both log-probability arrays": 0, "prompts (literal ids)": 0, "facts (references)": 0}
    literal_prompts = 0  # the prompts' new ids had every one been stored literally (schema 5)
    for (job, _, facts, ids, model, sampling, prompt), row in zip(rows, stored, strict=True):
        parts["ids + both log-probability arrays"] += len(ids or b"") + len(model) + len(sampling or b"")
        parts["prompts (literal ids)"] += len(prompt or b"")
        parts["facts (references)"] += len(row[2])  # as stored: with the stream's pointer
        whole = resolved((facts, ids, model, sampling, prompt), sources.get(job, {}))
        literal_prompts += len(whole.prompt_ids or b"")
    markers = sum(len(json.dumps(t["metadata"]["tokens"])) for t in turns if "tokens" in t["metadata"])
    parts["markers in the turns' JSON (hosted turns' only, schema 7)"] = markers
    text = sum(len(t["content"].encode()) for t in turns)
    records = sum(parts.values())
    tokens = sum(t["metadata"].get("n_tokens", 0) for t in turns)
    print(
        f"  {debates} debates, {len(turns)} turns, {tokens} tokens ({seconds:.0f} s); "
        f"turn text {text / 1024:.1f} KiB; "
        f"ledger with records {size / 1024:.0f} KiB, without {plain / 1024:.0f} KiB (the same, stripped)"
    )
    print(f"  records {records / 1024:.1f} KiB: {records / text:.2f}x the text")
    for name, n in parts.items():
        print(f"    {name}: {n / 1024:.1f} KiB ({n / text:.2f}x)")
    saved = literal_prompts - parts["prompts (literal ids)"]
    print(
        f"    the prompts' new ids stored literally would be {literal_prompts / 1024:.1f} KiB "
        f"({literal_prompts / text:.2f}x); references save {saved / 1024:.1f} KiB ({saved / text:.2f}x)"
    )
    print(
        f"  the records grow the ledger by {(size - plain) / 1024:.0f} KiB: {(size - plain) / plain:.2f}x "
        f"the ledger without them, {(size - plain) / text:.2f}x the turns' text (as written, before VACUUM: "
        f"{live / 1024:.0f} KiB)"
    )
    print(
        f"  the same records as schema 6 stored them (each row in its own columns, the marker in the JSON) "
        f"grow it by {(v6 - plain) / 1024:.0f} KiB: {(v6 - plain) / text:.2f}x the turns' text"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_options(parser, max_new=128)
    parser.add_argument("--ledger", action="store_true", help="measure the records' size in the ledger")
    parser.add_argument("--ledger-tokens", type=int, default=64, help="--ledger: tokens per turn at most")
    parser.add_argument("--debates", type=int, default=16, help="--ledger: debates (each 8 turns)")
    parser.add_argument(
        "--ledger-from",
        metavar="OUT_DIR",
        help="--ledger: measure the committed turns of this (debate) ledger, recorded again by this version",
    )
    args = parser.parse_args()
    if args.ledger:
        path, label = model_path(parser, args.model)
        dtype = fast_dtype(args.dtype)
        print(f"{label}, {dtype}; CPU: {cpu_summary()}")
        ledger_sizes(path, dtype, args.ledger_tokens, args.debates, args.ledger_from)
        return
    engine, prompts = question_batch(parser, args)

    import torch

    from interlens.engine._generation import GenerationRequest

    model = engine.model

    def run(record: bool) -> tuple[float, list[tuple[int, ...]]]:
        requests = [
            GenerationRequest(
                p,
                sampling=SamplingSettings(max_new_tokens=args.max_new, temperature=0.9, seed=i),
                record_logprobs=record,
            )
            for i, p in enumerate(prompts)
        ]
        start = time.perf_counter()
        results: list[Any] = engine.generate_batch(requests)
        seconds = time.perf_counter() - start
        return sum(r.n_tokens for r in results) / seconds, [tuple(r.token_ids) for r in results]

    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, set[Any]] = {False: set(), True: set()}
    for record in (False, True):
        in_thread(lambda r=record: run(r))  # warm-up
    for _ in range(args.repeats):
        for record in (False, True):
            rate, ids = in_thread(lambda r=record: run(r))
            rates[record].append(rate)
            tokens[record].add(tuple(ids))
    from interlens.engine._sampler import Sampler
    from interlens.engine._sampling import SamplingSettings

    logits = torch.randn(args.rows, model.config.vocab_size).to(model.dtype)
    settings = [SamplingSettings(max_new_tokens=1, temperature=0.9, seed=i) for i in range(args.rows)]

    def choose(record: bool) -> float:
        sampler = Sampler(settings, "cpu", record=record)
        start = time.perf_counter()
        for _ in range(200):
            sampler.choose(logits)
        return (time.perf_counter() - start) / 200 * 1000

    step_ms = {
        record: statistics.median(in_thread(lambda r=record: choose(r)) for _ in range(3))
        for record in (False, True)
    }
    same = tokens[False] == tokens[True] and len(tokens[True]) == 1
    total = sum(len(t) for t in next(iter(tokens[True])))
    for record, name in ((False, "not recorded"), (True, "recorded")):
        print(f"  {name:12s} {spread(rates[record])} tok/s")
    ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    print(f"  recorded / not = {spread(ratios, '.3f')} (median {statistics.median(ratios):.3f}x)")
    print(f"  {total} tokens a run; the same tokens every run, both ways: {same}")
    steps = max(len(t) for t in next(iter(tokens[True])))  # the batch's decode steps: its longest row's
    batch_ms = 1000 * total / statistics.median(rates[False]) / steps
    added = step_ms[True] - step_ms[False]
    print(
        f"  sampler step: {step_ms[False]:.2f} ms, recording {step_ms[True]:.2f} ms (+{added:.2f} ms) "
        f"against a batch step of ~{batch_ms:.0f} ms: {100 * added / batch_ms:.1f} % (3 x 200 calls)"
    )


if __name__ == "__main__":
    main()
