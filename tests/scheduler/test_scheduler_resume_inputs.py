"""``run_jobs`` compares each recorded job's input fingerprint (``JobSpec.input_fp``) before resuming it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
from scheduler_testkit import TurnsJob

from interlens.scheduler import JobSpec, LineupSpec, RunConfig, run_jobs
from interlens.store import FingerprintMismatchError, LedgerReader


def _lineup(questions: Iterable[str | None], *, once: bool = False) -> tuple[LineupSpec, list[TurnsJob]]:
    jobs = [TurnsJob(needs_device=False, turns=1) for _ in questions]
    specs = [
        JobSpec(f"a/{i:04d}", "a", seed=i, job=job, input_fp=q)
        for i, (q, job) in enumerate(zip(questions, jobs, strict=True))
    ]
    # A list can be iterated again (checked before any job starts); an iterator only as it is pulled.
    return LineupSpec(name="a", fingerprint="fp-a", jobs=iter(specs) if once else specs), jobs


async def test_a_recorded_job_asked_something_else_refuses_the_run_before_any_job_starts(
    tmp_path: Path,
) -> None:
    first, _ = _lineup(["q0", "q1", "q2"])
    await run_jobs([first], RunConfig(devices=["cpu"], out_dir=tmp_path))

    changed, jobs = _lineup(["q0", "Q1", "q2", "q3"])
    with pytest.raises(FingerprintMismatchError) as excinfo:
        await run_jobs([changed], RunConfig(devices=["cpu"], out_dir=tmp_path))
    message = str(excinfo.value)
    assert "1 job already recorded" in message
    assert "- a/0001: input fingerprint 'q1' → 'Q1'" in message  # no explain_input: shown as they are
    assert "Nothing was run" in message and "pass resume=False" in message and "fresh=True" not in message
    assert [job.seen for job in jobs] == [[], [], [], []]  # not even the new job started
    with LedgerReader(tmp_path) as reader:
        assert len(reader.runs()) == 1 and reader.job("a/0001").input_fp == "q1"

    # From an iterator, compared as pulled: the run stops before the changed job starts.
    once, jobs = _lineup(["q0", "Q1"], once=True)
    with pytest.raises(FingerprintMismatchError, match=r"a/0001: input fingerprint 'q1' → 'Q1'(.|\n)*once"):
        await run_jobs([once], RunConfig(devices=["cpu"], out_dir=tmp_path))
    assert jobs[1].seen == []

    # Same inputs, and a job without a fingerprint (not compared): skipped as done; new ones run.
    same, jobs = _lineup(["q0", None, "q2", "q3"])
    out = await run_jobs([same], RunConfig(devices=["cpu"], out_dir=tmp_path))
    assert out.skipped == ["a/0000", "a/0001", "a/0002"] and out.done == ["a/0003"]
    assert [len(job.seen) for job in jobs] == [0, 0, 0, 1]
    with LedgerReader(tmp_path) as reader:
        assert reader.job("a/0003").input_fp == "q3"
