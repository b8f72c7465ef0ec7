"""A 12,000-row streaming rollout in a process of its own, tracing its memory (tests/test_scale.py).

Its own process: tracemalloc counts every thread's allocations, and a test process that ran other tests
first still has their threads (servers, pools) allocating beside the rollout. Each sample is taken after a
full garbage collection (finished jobs leave reference cycles that wait for the cyclic collector, whose
timing depends on allocation counts), with 32 jobs at once instead of the default 256: each job in flight
holds ~2 KB (its task, its transcript, its pending commit) and how many of them sit between start and commit
at a sample follows the commit pace, which load changes; at 256 that swung the windows by +-0.6 MB (the
test's flake), at 32 by ~0.1 MB. Concurrency bounds that state, not the rows. Prints one JSON line:
{"growth": bytes, "done": jobs done, "last": the last job's first message}.
"""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc

from interlens import Conversation, ScriptedParticipant, dataset_field

N_ROWS = 12_000
FIRST = range(2_000, 3_000, 100)  # after the pools, buffers and caches have filled
LAST = range(N_ROWS - 1_000, N_ROWS, 100)


def main(out_dir: str, keep_per_row: bool) -> None:
    samples: dict[int, int] = {}
    kept: list[str] = []  # what O(rows) state would look like (the test's check that growth is seen)

    def rows():  # type: ignore[no-untyped-def]
        for i in range(N_ROWS):
            if i in FIRST or i in LAST:
                gc.collect()
                samples[i] = tracemalloc.get_traced_memory()[0]
            if keep_per_row:
                kept.append(f"row_{i:05d}")
            yield {"q": f"question {i}"}

    conv = (
        Conversation(participants=[ScriptedParticipant("s", ["ok"])], shared_context=dataset_field("q"))
        .turns(1)
        .data(rows())
    )
    tracemalloc.start()
    try:
        report = conv.rollout(out_dir=out_dir, progress=False, max_concurrency=32)
    finally:
        tracemalloc.stop()
    growth = min(samples[i] for i in LAST) - min(samples[i] for i in FIRST)
    last = report.results[f"row_{N_ROWS - 1:05d}"].transcript[0].content
    print(json.dumps({"growth": growth, "done": report.counts["done"], "last": last}))


if __name__ == "__main__":
    main(sys.argv[1], keep_per_row=sys.argv[2:] == ["--keep-per-row"])
