"""The per-engine batch budget: a batcher that ran out of memory settles on a size that fits."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
from scheduler_testkit import EchoSpec, OutOfMemoryError, TurnsJob, lineup

from interlens.scheduler import ExecutionMode, JobContext, RunConfig, run_jobs
from interlens.scheduler._batch_budget import BatchBudget

NO_TIMER = 60.0  # quiescence alone forms the batches


class TightEngine:
    """A device that holds ``capacity`` tokens: a batch costing more (rows × widest row) runs out of memory.

    Each request is ``"<job>:<turn>:<tokens>"``; ``request_tokens`` reads the cost from it, as a real engine
    counts prompt + max_new tokens. Every call is logged as (turn of its first row, rows, cost, ok).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.calls: list[tuple[int, int, int, bool]] = []
        self.released = 0

    def request_tokens(self, request: str) -> int:
        return int(request.rsplit(":", 1)[1])

    def generate_batch(
        self, requests: Sequence[Any], *, mode: ExecutionMode, cancelled: threading.Event | None = None
    ) -> list[Any]:
        cost = len(requests) * max(self.request_tokens(r) for r in requests)
        turn = int(requests[0].split(":")[-2])
        fits = cost <= self.capacity
        self.calls.append((turn, len(requests), cost, fits))
        if not fits:
            raise OutOfMemoryError(f"CUDA out of memory: {cost} tokens > {self.capacity}")
        return [f"ok({r})" for r in requests]

    def release_memory(self) -> None:
        self.released += 1

    def ooms(self) -> list[tuple[int, int, int, bool]]:
        return [c for c in self.calls if not c[3]]


def tight_spec(engine: TightEngine) -> EchoSpec:
    return EchoSpec("m", make=lambda name, dev: engine)  # type: ignore[arg-type, return-value]


async def uniform_run(engine: TightEngine, *, jobs: int, turns: int, max_batch_size: int) -> Any:
    """``jobs`` jobs of ``turns`` turns on ``engine``, every row costing 100 tokens; batches formed by
    quiescence alone."""

    def request(ctx: JobContext, i: int) -> str:
        return f"{ctx.job_id}:{i}:100"

    spec = tight_spec(engine)
    lineups = [lineup("a", [TurnsJob([spec], turns=turns, request=request) for _ in range(jobs)])]
    config = RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER, max_batch_size=max_batch_size)
    with anyio.fail_after(60):
        return await run_jobs(lineups, config)


async def test_batcher_settles_on_a_size_that_fits_and_stops_running_out_of_memory() -> None:
    engine = TightEngine(capacity=550)  # five rows of 100 tokens fit, six do not
    out = await uniform_run(engine, jobs=32, turns=8, max_batch_size=32)
    assert len(out.done) == 32 and out.failed == []
    for job in ("a/0000", "a/0017", "a/0031"):
        texts = [t["text"] for t in out.outcome(job).conversation["turns"]]
        assert texts == [f"ok({job}:{i}:100)" for i in range(8)]
    ooms = engine.ooms()
    # the first round halves 32 → 16 → 8 → 4 (three errors), then the budget grows towards the ceiling
    # by halving the gap and overshoots at most a couple of times before it converges
    assert 3 <= len(ooms) <= 6, ooms
    assert {turn for turn, *_ in ooms} <= {0, 1, 2}, ooms  # none once it has settled
    assert engine.calls[0][:3] == (0, 32, 3200)
    late = [rows for turn, rows, _, _ in engine.calls if turn >= 5]
    assert max(late) == 5 and late.count(5) >= len(late) - 4  # the size that fits, not a cautious 1 or 2
    assert engine.released == len(ooms)  # the allocator's cache is returned after every error


async def test_the_twin_of_a_failed_half_is_split_without_being_tried() -> None:
    engine = TightEngine(capacity=350)
    spec = tight_spec(engine)

    def request(ctx: JobContext, i: int) -> str:
        return f"{ctx.job_id}:{i}:100"

    jobs = [TurnsJob([spec], turns=1, request=request) for _ in range(8)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert len(out.done) == 8
    # 8 fails → 4 fails → 2, 2; the other 4 costs as much as the half that just failed: split unasked
    assert [(rows, ok) for _, rows, _, ok in engine.calls] == [
        (8, False),
        (4, False),
        (2, True),
        (2, True),
        (2, True),
        (2, True),
    ]


async def test_a_wide_row_takes_a_batch_of_its_own_under_a_token_budget() -> None:
    engine = TightEngine(capacity=450)
    spec = tight_spec(engine)

    def request(ctx: JobContext, i: int) -> str:
        tokens = 400 if ctx.job_id == "a/0002" else 100
        return f"{ctx.job_id}:{i}:{tokens}"

    jobs = [TurnsJob([spec], turns=3, request=request) for _ in range(4)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert len(out.done) == 4
    # the first round learns (4 × 400 fails, 2 × 100 and 2 × 400...); later rounds never fail again
    assert {turn for turn, *_ in engine.ooms()} == {0}
    assert all(ok for turn, _, _, ok in engine.calls if turn >= 1)


def test_budget_shrinks_to_what_fit_and_grows_back_below_the_ceiling() -> None:
    budget = BatchBudget(grow_after=2)
    assert budget.limit is None and budget.allows(10**9)
    budget.failed(3200, rows=32)
    assert (budget.ceiling, budget.limit) == (3200, 1600)
    budget.failed(1600, rows=16)
    budget.succeeded(800)
    assert (budget.ceiling, budget.limit) == (1600, 800)
    assert not budget.allows(1600) and budget.allows(800) and not budget.allows(900)
    budget.succeeded(800)  # second success in a row: half-way to the ceiling
    assert budget.limit == 1200
    budget.failed(1100, rows=11)  # overshoot: back to what fit, a new ceiling
    assert (budget.ceiling, budget.limit) == (1100, 800)
    for _ in range(20):
        budget.succeeded(budget.limit)
    assert budget.limit is not None and 1000 < budget.limit < 1100  # converged just below the ceiling
    assert budget.ooms == 3


def test_a_single_row_or_a_size_that_fit_before_does_not_shrink_the_budget() -> None:
    budget = BatchBudget()
    budget.failed(500, rows=1)  # that row alone: nothing learnt about batches
    assert budget.limit is None and budget.ceiling is None
    budget.succeeded(400)
    budget.failed(300, rows=3)  # 400 fit: this batch had a bad row in it
    assert budget.limit is None and budget.ceiling is None and budget.ooms == 0


def test_a_success_above_a_ceiling_lifts_it() -> None:
    budget = BatchBudget()
    budget.failed(800, rows=8)
    budget.failed(400, rows=4)
    assert budget.ceiling == 400
    budget.succeeded(500)  # a single wide row of 500 fit: 400 was not about memory
    assert budget.ceiling == 800 and budget.limit == 500
    budget.succeeded(900)
    assert budget.ceiling is None and budget.limit is None


class EstimatingEngine(TightEngine):
    """A TightEngine that, like a CUDA LocalEngine, estimates what fits before its first batch."""

    def token_budget(self) -> int:
        return 300


async def test_an_engine_estimate_bounds_the_first_batch_and_then_grows() -> None:
    engine = EstimatingEngine(capacity=550)
    spec = tight_spec(engine)

    def request(ctx: JobContext, i: int) -> str:
        return f"{ctx.job_id}:{i}:100"

    jobs = [TurnsJob([spec], turns=16, request=request) for _ in range(12)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert len(out.done) == 12
    sizes = [rows for _, rows, _, _ in engine.calls]
    assert sizes[:4] == [3, 3, 3, 3]  # the estimate, not max_batch_size: no failed prefill to learn from
    # grown by quarters until an error set a ceiling, then settled on what fits
    assert max(rows for _, rows, _, ok in engine.calls if ok) == 5 and 1 <= len(engine.ooms()) <= 3
    settled = engine.calls[len(engine.calls) // 2 :]
    assert all(ok for *_, ok in settled) and max(rows for _, rows, _, _ in settled) == 5


def test_an_estimate_without_a_ceiling_grows_by_a_quarter() -> None:
    budget = BatchBudget(grow_after=1, limit=400)
    budget.succeeded(300)
    assert budget.limit == 500
    budget.failed(600, rows=6)
    assert (budget.ceiling, budget.limit) == (600, 300)  # back to what fit


def test_small_batches_do_not_grow_the_limit() -> None:
    budget = BatchBudget(grow_after=1, limit=400)
    for _ in range(10):
        budget.succeeded(100)  # a quiet engine: a quarter of the limit each time
    assert budget.limit == 400
    budget.succeeded(200)
    assert budget.limit == 500


def test_a_ceiling_is_probed_again_after_a_quiet_spell_and_waits_longer_when_it_was_real() -> None:
    budget = BatchBudget(grow_after=1, probe_after=8)
    budget.succeeded(500)
    budget.failed(600, rows=6)  # say a neighbour held memory for a moment
    assert (budget.ceiling, budget.limit) == (600, 500)
    for _ in range(7):
        budget.succeeded(budget.limit)
    assert budget.ceiling == 600 and budget.limit is not None and budget.limit < 600  # not yet
    budget.succeeded(budget.limit)  # the 8th full batch without an error: probe upward
    assert budget.ceiling is None and budget.limit >= 600
    budget.failed(budget.limit, rows=6)  # the ceiling was real after all
    assert budget.ceiling is not None and budget.probe_after == 16
    limit = budget.limit
    for _ in range(15):
        budget.succeeded(budget.limit)
    assert budget.ceiling is not None  # the next probe waits twice as long
    budget.succeeded(budget.limit)
    assert budget.ceiling is None and limit is not None and budget.limit > limit


async def test_a_batch_size_cut_by_a_neighbours_memory_grows_back_once_it_is_free() -> None:
    """A transient out-of-memory (another process held the GPU for a while) must not keep the batches small
    for the rest of the run: after a quiet spell the budget probes upward and the full size returns."""

    class Neighboured(TightEngine):
        def generate_batch(self, requests: Sequence[Any], **kwargs: Any) -> list[Any]:
            if len(self.calls) >= 12:
                self.capacity = 10**9  # the neighbour has gone
            return super().generate_batch(requests, **kwargs)

    engine = Neighboured(capacity=550)
    out = await uniform_run(engine, jobs=16, turns=40, max_batch_size=16)
    assert len(out.done) == 16 and out.failed == []
    assert engine.ooms() and all(turn <= 2 for turn, *_ in engine.ooms())
    assert max(rows for turn, rows, _, ok in engine.calls if 2 <= turn <= 4) <= 5  # it had been cut
    last_turns = [rows for turn, rows, _, _ in engine.calls if turn >= 36]
    # whole rounds in one batch again (a batch that straddles two turns is the odd one out)
    assert max(last_turns) == 16 and last_turns.count(16) >= len(last_turns) - 1, engine.calls[-20:]
