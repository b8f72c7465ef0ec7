"""Co-stepping, quiescence, the device lock, out-of-memory splitting and engine loading."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import anyio
import torch
from scheduler_testkit import Device, EchoEngine, EchoSpec, OutOfMemoryError, TurnsJob, lineup

from interlens.scheduler import (
    EngineLoadError,
    ExecutionMode,
    JobContext,
    JobResult,
    NoDeviceError,
    RunConfig,
    run_jobs,
)

# Quiescence alone must form the batches: with a huge fallback delay, a batch that waited for the timer
# instead of dispatching when every live job is blocked would make these tests time out.
NO_TIMER = 60.0


async def test_64_jobs_by_3_turns_co_step_in_batches_of_64() -> None:
    spec = EchoSpec("m")
    jobs = [TurnsJob([spec], turns=3) for _ in range(64)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert spec.engine.sizes == [64, 64, 64]
    assert spec.loads == ["cpu"]
    assert out.counts == {"total": 64, "done": 64, "failed": 0, "skipped": 0}
    res = out.outcome("a/0007")
    assert res.state == "done" and res.device == "cpu" and res.attempts == 1
    assert [t["text"] for t in res.conversation["turns"]] == [f"m(a/0007:{i})" for i in range(3)]
    assert res.tokens_generated == 30 and res.analysis == {"n_turns": 3}


async def test_more_jobs_than_slots_keep_batches_full() -> None:
    spec = EchoSpec("m")
    jobs = [TurnsJob([spec], turns=2) for _ in range(48)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)],
            RunConfig(devices=["cpu"], out_dir=None, max_batch_size=16, max_batch_wait=NO_TIMER),
        )
    assert len(out.done) == 48
    assert max(spec.engine.sizes) == 16 and sum(spec.engine.sizes) == 96
    assert spec.engine.sizes.count(16) >= 5  # slots refill as jobs end; most batches stay full


async def test_two_engines_share_the_device_one_batch_at_a_time() -> None:
    device = Device()
    a, b = EchoSpec("a", device), EchoSpec("b", device)
    # A debate between two models: turns alternate a, b, a, b. Half the jobs speak b first.
    jobs = [TurnsJob([a, b], turns=4) for _ in range(16)] + [TurnsJob([b, a], turns=4) for _ in range(16)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("debate", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert len(out.done) == 32
    assert device.overlaps == 0
    assert sum(a.engine.sizes) == sum(b.engine.sizes) == 64
    # The device serves the model with the most waiting turns, whole, once every job is waiting: after the
    # first round (a tie: whichever model loaded first goes first) the two halves fall into step.
    first, second = device.log[0][0], device.log[1][0]
    assert {first, second} == {"a", "b"}
    assert device.log == [(first, 16), (second, 32), (first, 32), (second, 32), (first, 16)]
    turns = out.outcome("debate/0000").conversation["turns"]
    assert [t["text"] for t in turns] == [
        "a(debate/0000:0)",
        "b(debate/0000:1)",
        "a(debate/0000:2)",
        "b(debate/0000:3)",
    ]


async def test_deterministic_mode_coalesces_and_leaves_co_stepping_to_the_engine() -> None:
    """The batcher batches deterministic turns as it does batched ones and passes the mode on: whether the
    rows may share a forward pass is the engine's to know (LocalEngine's batch-invariance self-test)."""
    spec = EchoSpec("m")
    jobs = [TurnsJob([spec], turns=2) for _ in range(8)]
    out = await run_jobs(
        [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, mode=ExecutionMode.DETERMINISTIC)
    )
    assert spec.engine.sizes == [8, 8]
    assert spec.engine.modes == {ExecutionMode.DETERMINISTIC}
    assert {j.seen[0]["mode"] for j in jobs} == {ExecutionMode.DETERMINISTIC}
    assert len(out.done) == 8


async def test_out_of_memory_batch_is_halved_until_only_the_poisoned_row_fails() -> None:
    spec = EchoSpec("m", make=lambda name, dev: EchoEngine(name, dev, poison="poison:0"))

    def request(ctx: JobContext, i: int) -> str:
        return "poison:0" if ctx.job_id == "a/0005" else f"{ctx.job_id}:{i}"

    jobs = [TurnsJob([spec], turns=1, request=request) for _ in range(16)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert len(out.done) == 15 and out.failed == ["a/0005"]
    err = out.outcome("a/0005").error
    assert err is not None and err.type == "OutOfMemoryError" and "out of memory" in err.message
    # 16 → 8+8, the poisoned half → 4+4, its poisoned half → 2+2 → 1+1: every clean half succeeds once.
    # The clean twin of the first failed 8 is not tried at 8 (a size that just failed): it runs as 4+4.
    assert spec.engine.sizes == [16, 8, 4, 4, 2, 1, 1, 2, 4, 4]


class MemoryHungryEngine:
    """Each batch allocates real tensors; a batch of more than ``fits`` rows runs out of memory holding them.

    It remembers weak references to the tensors of every failed batch and records, at each later call, how
    many are still alive: a retry that starts while they are would meet the same memory pressure.
    """

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.failed: list[weakref.ref[torch.Tensor]] = []
        self.calls: list[tuple[str, int, int]] = []  # (what, batch size, failed tensors still alive)

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.failed)

    def generate_batch(
        self, requests: Sequence[Any], *, mode: ExecutionMode, cancelled: threading.Event | None = None
    ) -> list[Any]:
        self.calls.append(("generate", len(requests), self.alive()))
        activations = torch.zeros(len(requests), 4096)  # the batch's working memory, held by this frame
        if len(requests) > self.fits:
            self.failed.append(weakref.ref(activations))
            self._forward(activations)
        return [f"ok({r})" for r in requests]

    def _forward(self, activations: torch.Tensor) -> None:
        hidden = activations + 1  # a deeper frame holding more
        self.failed.append(weakref.ref(hidden))
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def release_memory(self) -> None:
        self.calls.append(("release", 0, self.alive()))


async def test_out_of_memory_retry_starts_after_the_failed_batch_is_freed() -> None:
    engine = MemoryHungryEngine(fits=2)
    spec = EchoSpec("m", make=lambda name, dev: engine)  # type: ignore[arg-type, return-value]
    jobs = [TurnsJob([spec], turns=1) for _ in range(8)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert len(out.done) == 8
    assert out.outcome("a/0003").conversation["turns"][0]["text"] == "ok(a/0003:0)"
    # 8 fails → freed, released → 4 fails → freed, released → 2, 2 → the other 4 (a size that just
    # failed) is split unasked → 2, 2.
    assert [c[:2] for c in engine.calls] == [
        ("generate", 8),
        ("release", 0),
        ("generate", 4),
        ("release", 0),
        ("generate", 2),
        ("generate", 2),
        ("generate", 2),
        ("generate", 2),
    ]
    assert len(engine.failed) == 4
    assert [c[2] for c in engine.calls] == [0] * len(engine.calls)  # nothing of a failed batch outlived it


async def test_a_row_that_fails_alone_keeps_no_tensor_alive_and_memory_is_released() -> None:
    engine = MemoryHungryEngine(fits=0)  # even one row runs out of memory
    spec = EchoSpec("m", make=lambda name, dev: engine)  # type: ignore[arg-type, return-value]
    jobs = [TurnsJob([spec], turns=1) for _ in range(2)]
    with anyio.fail_after(20):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
        )
    assert out.failed == ["a/0000", "a/0001"]
    assert out.outcome("a/0001").error.type == "OutOfMemoryError"
    # 2 fails → released → 1 fails → released → 1 fails → released: the error each row keeps (and its
    # traceback) holds none of the failed batch's tensors
    assert [c[:2] for c in engine.calls] == [
        ("generate", 2),
        ("release", 0),
        ("generate", 1),
        ("release", 0),
        ("generate", 1),
        ("release", 0),
    ]
    assert len(engine.failed) == 6 and engine.alive() == 0


async def test_other_batch_exception_fails_every_caller_of_that_batch_only() -> None:
    spec = EchoSpec(
        "m", make=lambda name, dev: EchoEngine(name, dev, fail_batch=RuntimeError("CUDA kernel broke"))
    )
    other = EchoSpec("ok")
    jobs = [TurnsJob([spec], turns=1) for _ in range(4)] + [TurnsJob([other], turns=1) for _ in range(4)]
    out = await run_jobs([lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None))
    assert out.failed == [f"a/{i:04d}" for i in range(4)]
    assert spec.engine.sizes == [4]  # not split: only out-of-memory is retried
    assert {out.outcome(j).error.message for j in out.failed} == {"CUDA kernel broke"}
    assert len(out.done) == 4


async def test_exception_returned_in_place_reaches_only_its_caller() -> None:
    spec = EchoSpec("m")

    def request(ctx: JobContext, i: int) -> str:
        return "bad-row" if ctx.job_id == "a/0002" else f"ok:{i}"

    jobs = [TurnsJob([spec], turns=1, request=request) for _ in range(6)]
    out = await run_jobs([lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None))
    assert out.failed == ["a/0002"] and len(out.done) == 5
    assert out.outcome("a/0002").error.type == "ValueError"
    assert spec.engine.sizes == [6]


async def test_engine_loads_once_however_many_jobs_ask_at_once() -> None:
    gate = threading.Event()
    spec = EchoSpec("m", load_gate=gate)
    jobs = [TurnsJob([spec], turns=1) for _ in range(20)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: run_jobs(
                [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=NO_TIMER)
            )
        )
        await anyio.wait_all_tasks_blocked()  # every job is now waiting on the one load in flight
        gate.set()
    assert spec.loads == ["cpu"] and spec.engine.sizes == [20]


async def test_engine_load_failure_fails_only_the_jobs_that_need_it() -> None:
    broken = EchoSpec("broken", fail_load=OSError("weights not found: /nowhere"))
    fine = EchoSpec("fine")
    jobs = [TurnsJob([broken]) for _ in range(3)] + [TurnsJob([fine]) for _ in range(3)]
    out = await run_jobs([lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None))
    assert out.failed == ["a/0000", "a/0001", "a/0002"] and len(out.done) == 3
    err = out.outcome("a/0001").error
    assert err is not None and err.type == EngineLoadError.__qualname__
    assert "weights not found: /nowhere" in err.message and "'broken'" in err.message
    assert broken.loads == ["cpu"]  # the failure is remembered for the run, not retried per job


async def test_fallback_timer_dispatches_when_a_job_waits_on_something_unseen() -> None:
    spec = EchoSpec("m")
    released = anyio.Event()

    class Waiter(TurnsJob):
        async def run(self, ctx):
            await released.wait()  # something the scheduler cannot see (a file, a raw socket)
            return await super().run(ctx)

    class Releaser(TurnsJob):
        async def run(self, ctx):
            result = await super().run(ctx)  # its generate cannot wait for the Waiter to join the batch
            released.set()
            return result

    jobs = [Waiter([spec], turns=1), Releaser([spec], turns=1)]
    with anyio.fail_after(10):
        out = await run_jobs(
            [lineup("a", jobs)], RunConfig(devices=["cpu"], out_dir=None, max_batch_wait=0.05)
        )
    assert len(out.done) == 2 and spec.engine.sizes == [1, 1]


async def test_job_without_device_that_generates_gets_a_clear_error() -> None:
    spec = EchoSpec("m")
    out = await run_jobs(
        [lineup("a", [TurnsJob([spec], needs_device=False)])], RunConfig(devices=["cpu"], out_dir=None)
    )
    err = out.outcome("a/0000").error
    assert err is not None and err.type == NoDeviceError.__qualname__ and "needs_device=True" in err.message
    assert spec.loads == []


# Several devices (worker processes) are covered in test_scheduler_workers.py.


async def test_jobs_holding_every_shared_worker_thread_do_not_starve_the_engine() -> None:
    """Like a sync analyzer calling ``conv.sample``: a thread per job waits on a generation."""
    spec = EchoSpec("m")
    n = int(anyio.to_thread.current_default_thread_limiter().total_tokens) + 8

    class SyncAnalyzer(TurnsJob):
        async def run(self, ctx):
            def analyze() -> str:
                return anyio.from_thread.run(ctx.generate, spec, f"{ctx.job_id}:sync")

            text = await anyio.to_thread.run_sync(analyze)
            return JobResult(conversation={"text": text})

    with anyio.fail_after(30):
        out = await run_jobs(
            [lineup("a", [SyncAnalyzer() for _ in range(n)])], RunConfig(devices=["cpu"], out_dir=None)
        )
    assert len(out.done) == n and sum(spec.engine.sizes) == n
    assert out.outcome("a/0003").conversation == {"text": "m(a/0003:sync)"}
