"""Device memory over a run: an engine no remaining job needs is evicted (one still needed stays), and a
failed load keeps no half-loaded weights alive."""

from __future__ import annotations

from collections.abc import Hashable

import anyio
import pytest
from workers_testkit import EVICTED, EvictableSpec, WorkerJob, one_slot_worker

from interlens.scheduler import JobSpec, LineupSpec, RunConfig, run_jobs
from interlens.scheduler._eviction import EngineNeeds


@pytest.fixture(autouse=True)
def _clear() -> object:
    EVICTED.clear()
    yield
    EVICTED.clear()


def _lineup(
    name: str, engine: str, n: int, *, keys: frozenset[Hashable] | str | None = "declared"
) -> LineupSpec:
    specs = [
        JobSpec(f"{name}/{i}", name, seed=i, job=WorkerJob(turns=2, engine=EvictableSpec(engine)))
        for i in range(n)
    ]
    declared = frozenset({engine}) if keys == "declared" else keys
    assert not isinstance(declared, str)
    return LineupSpec(name=name, fingerprint=name, jobs=iter(specs), n_jobs=n, engine_keys=declared)


async def test_a_model_is_evicted_once_no_remaining_lineup_needs_it() -> None:
    lineups = [_lineup("a", "m1", 2), _lineup("b", "m2", 2), _lineup("c", "m2", 2), _lineup("d", "m3", 1)]
    with anyio.fail_after(30):
        out = await run_jobs(lineups, RunConfig(devices=["cpu"], out_dir=None, max_batch_size=1))
    assert len(out.done) == 7
    # m1 goes when "a" ends, m2 when "c" ends (not when "b" does); m3 is kept: the run has nothing left.
    assert EVICTED == ["m1", "m2"]


async def test_nothing_is_evicted_while_a_lineup_that_names_no_engines_remains() -> None:
    lineups = [_lineup("a", "m1", 2), _lineup("x", "m2", 2, keys=None), _lineup("y", "m3", 1)]
    with anyio.fail_after(30):
        out = await run_jobs(lineups, RunConfig(devices=["cpu"], out_dir=None, max_batch_size=1))
    assert len(out.done) == 5
    assert EVICTED == ["m1"]  # evicted only once "x", which could use any engine, is over


async def test_an_evicted_engine_a_later_job_asks_for_is_loaded_afresh() -> None:
    # "b" does not declare m1 but uses it (as an analyzer could): it gets a fresh engine, not the evicted one.
    lineups = [_lineup("a", "m1", 1), _lineup("b", "m1", 1, keys=frozenset({"m2"})), _lineup("c", "m2", 1)]
    with anyio.fail_after(30):
        out = await run_jobs(lineups, RunConfig(devices=["cpu"], out_dir=None, max_batch_size=1))
    assert len(out.done) == 3 and EVICTED == ["m1"]
    assert [t["text"] for t in out.outcome("b/0").conversation["turns"]] == ["m1(b/0:0)", "m1(b/0:1)"]


def test_engine_needs_counts_pulled_and_ended_jobs() -> None:
    needs = EngineNeeds([_lineup("a", "m1", 0), _lineup("b", "m2", 0)])
    needs.pulled("a")
    needs.pulled("a")
    assert needs.exhausted("a") == frozenset()  # two of its jobs are still running
    assert needs.ended("a") == frozenset()
    assert needs.ended("a") == frozenset({"m1"})
    needs.pulled("b")
    assert needs.exhausted("b") == frozenset() and needs.ended("b") == frozenset()  # the run is over


async def test_a_worker_process_evicts_when_told_before_its_next_job() -> None:
    from workers_testkit import children

    async def record(index: int, turn: object) -> None:
        pass

    def spec(job_id: str, engine: str) -> JobSpec:
        return JobSpec(job_id, "e", seed=0, job=WorkerJob(turns=1, engine=EvictableSpec(engine)))

    worker = one_slot_worker("cpu")
    with anyio.fail_after(60):
        async with worker:
            await worker.started()
            first = await worker.run_attempt(
                spec("e/0", "m1"), attempt=1, committed_turns=[], record_turn=record
            )
            await worker.evict(frozenset({"m1", "never-loaded"}))
            second = await worker.run_attempt(
                spec("e/1", "m2"), attempt=1, committed_turns=[], record_turn=record
            )
    assert first.analysis["evicted"] == [] and second.analysis["evicted"] == ["m1"]
    assert first.analysis["pid"] == second.analysis["pid"] and EVICTED == []  # it happened in the worker
    assert children() == set()


async def test_a_failed_load_keeps_no_half_loaded_weights_alive_for_the_rest_of_the_run() -> None:
    from workers_testkit import HALF_LOADED, GcJob, HalfLoadSpec

    HALF_LOADED.clear()
    specs = [
        JobSpec("h/0", "h", seed=0, job=WorkerJob(turns=1, engine=HalfLoadSpec("huge"))),
        JobSpec("h/1", "h", seed=1, job=GcJob()),
    ]
    lineup = LineupSpec(name="h", fingerprint="h", jobs=iter(specs), n_jobs=2)
    with anyio.fail_after(30):
        out = await run_jobs([lineup], RunConfig(devices=["cpu"], out_dir=None, max_batch_size=1))
    error = out.outcome("h/0").error
    assert error is not None and "ran out of memory loading huge" in error.message  # the error is kept ...
    assert out.outcome("h/1").analysis == {"alive": [False]}  # ... its frames' weights are not
    HALF_LOADED.clear()
