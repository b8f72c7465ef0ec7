"""A streaming rollout keeps memory flat: rows are pulled lazily, results live in the ledger.

Sized to hold on a loaded 2-core machine (tracemalloc slows every allocation): 12,000 one-turn jobs, memory
compared between jobs 2,000-3,000 and the last 1,000, each window's least traced memory (one sample alone
can catch a transient: an in-flight commit, 0.6 MB once). Measured growth is ~0; state kept per job (a job
id in a list, ~65 bytes) grows it by ~0.6 MB (seen, by keeping one), past the 0.3 MB allowed.
"""

from __future__ import annotations

import tracemalloc

from interlens import Conversation, ScriptedParticipant, dataset_field
from interlens.store import LedgerReader

N_ROWS = 12_000
FIRST = range(2_000, 3_000, 100)  # after the pools, buffers and caches have filled
LAST = range(N_ROWS - 1_000, N_ROWS, 100)


def test_a_12k_row_streaming_rollout_has_flat_memory(tmp_path):
    samples: dict[int, int] = {}

    def rows():
        for i in range(N_ROWS):
            if i in FIRST or i in LAST:
                samples[i] = tracemalloc.get_traced_memory()[0]
            yield {"q": f"question {i}"}

    conv = (
        Conversation(participants=[ScriptedParticipant("s", ["ok"])], shared_context=dataset_field("q"))
        .turns(1)
        .data(rows())
    )
    tracemalloc.start()
    try:
        report = conv.rollout(out_dir=tmp_path, progress=False)
    finally:
        tracemalloc.stop()
    growth = min(samples[i] for i in LAST) - min(samples[i] for i in FIRST)
    # 9,000 more rows went through; O(rows) state of even 35 bytes a row would be 0.3 MB.
    assert growth < 300_000, f"memory grew by {growth / 1e6:.2f} MB over 9,000 rows"
    assert report.counts["done"] == N_ROWS
    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == N_ROWS
    last = report.results[f"row_{N_ROWS - 1:05d}"]
    assert last.transcript[0].content == f"question {N_ROWS - 1}"
