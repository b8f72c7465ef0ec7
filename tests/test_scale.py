"""A streaming rollout keeps memory flat: rows are pulled lazily, results live in the ledger.

Sized to hold on a loaded 2-core machine (tracemalloc slows every allocation): 30,000 one-turn jobs, memory
compared between job 5,000 and the last. Measured growth is ~0 (-0.06 MB here); state kept per job (a job id
in a list, ~65 bytes) would grow it by ~1.6 MB, past the 1 MB allowed.
"""

from __future__ import annotations

import tracemalloc

from interlens import Conversation, ScriptedParticipant, dataset_field
from interlens.store import LedgerReader

N_ROWS = 30_000
FIRST = 5_000  # the first sample: after the pools, buffers and caches have filled


def test_a_30k_row_streaming_rollout_has_flat_memory(tmp_path):
    samples: dict[int, int] = {}

    def rows():
        for i in range(N_ROWS):
            if i in (FIRST, N_ROWS - 1):
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
    growth = samples[N_ROWS - 1] - samples[FIRST]
    # 25,000 more rows went through; O(rows) state of even 40 bytes a row would be 1 MB.
    assert growth < 1_000_000, f"memory grew by {growth / 1e6:.2f} MB over {N_ROWS - FIRST:,} rows"
    assert report.counts["done"] == N_ROWS
    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == N_ROWS
    last = report.results[f"row_{N_ROWS - 1:05d}"]
    assert last.transcript[0].content == f"question {N_ROWS - 1}"
