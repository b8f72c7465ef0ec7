"""A 100,000-row streaming rollout keeps memory flat: rows are pulled lazily, results live in the ledger."""

from __future__ import annotations

import tracemalloc

from interlens import Conversation, ScriptedParticipant, dataset_field
from interlens.store import LedgerReader

N_ROWS = 100_000


def test_100k_row_streaming_rollout_has_flat_memory(tmp_path):
    samples: dict[int, int] = {}

    def rows():
        for i in range(N_ROWS):
            if i in (10_000, N_ROWS - 1):
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
    growth = samples[N_ROWS - 1] - samples[10_000]
    # 90,000 more rows went through; O(rows) state would be tens of MB. Allow a little noise.
    assert growth < 8_000_000, f"memory grew by {growth / 1e6:.1f} MB over 90,000 rows"
    assert report.counts["done"] == N_ROWS
    with LedgerReader(tmp_path) as reader:
        assert reader.counts()["done"] == N_ROWS
    last = report.results[f"row_{N_ROWS - 1:05d}"]
    assert last.transcript[0].content == f"question {N_ROWS - 1}"
