"""The run's API gateway, wired into the scheduler: one gateway in the parent serves every worker.

Real worker processes (``devices=["cpu", "cpu"]``) and the in-process device worker run jobs whose API calls
cross to the parent's gateway and hit the loopback fake provider through the official SDK; provider batches
go to the run's real SQLite ledger. Quiescence is checked by its absence of waiting: the fallback delays are
set far beyond the test's deadline, so only the wiring's quiescence can end each round in time.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from api_wiring_testkit import MixedJob, ask, lineup

from interlens.participants._api_participant import APIParticipant
from interlens.providers._registry import request_body
from interlens.scheduler import RunConfig, run_jobs
from interlens.scheduler.gateway import BatchPolicy
from interlens.store import Ledger
from interlens.testing._fake_provider import FakeProviderServer, default_reply

KEY = "sk-wiring-test-0123456789"
#: An idle-only round would take a minute: only the run's quiescence probe flushes in time.
PATIENT = BatchPolicy(idle_s=60, max_wait_s=120, poll_initial_s=0.01, poll_max_s=0.05)


pytestmark = pytest.mark.usefixtures("hermetic_api_env")


@pytest.fixture
def api_key() -> str:
    return KEY


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["in-process", "worker-processes"])
async def test_workers_share_the_parents_gateway_batches_and_ledger(
    server: FakeProviderServer, tmp_path: Path, devices: list[str]
) -> None:
    server.fail_batch_rows(lambda cid, body: "CURSED" in str(body["messages"]), status=400, message="refused")
    speaker = APIParticipant(
        name="s", provider="openai", model_id="gpt-test", batch=True, batch_policy=PATIENT
    )
    jobs = [
        MixedJob(speaker, "question 0", api_first=True),
        MixedJob(speaker, "question 1", api_first=True),
        MixedJob(speaker, "question 2", api_first=False),
        MixedJob(speaker, "question 3", api_first=False),
        MixedJob(speaker, "a CURSED question", api_first=True, local=False),
    ]
    with anyio.fail_after(30):  # the batcher's fallback alone would take 100 s per local round
        outcome = await run_jobs(
            [lineup("mixed", jobs)], RunConfig(devices=devices, out_dir=tmp_path, max_batch_wait=100)
        )
    cursed = "mixed/0004"
    assert outcome.failed == [cursed]
    error = outcome.outcome(cursed).error
    assert error is not None and error.type == "ProviderCallError"  # raised in the parent, typed in the job
    assert "HTTP 400" in error.message and "refused" in error.message and "not retryable" in error.message
    # Every worker's rows went into ONE provider batch: the gateway and its rounds are the parent's.
    [batch] = server.batches.values()
    assert len(batch.custom_ids) == 5 and server.batch_count("openai") == 1
    pids = set()
    for i in range(4):
        conv = outcome.outcome(f"mixed/{i:04d}").conversation
        assert (
            conv["text"] == default_reply(request_body(ask(f"question {i}"))) and conv["batch_id"] == batch.id
        )
        # Jobs blocked on the provider batch count as blocked for their device batcher: the local-first
        # jobs of a worker generate at once without the api-first ones, which generate together later.
        assert conv["local"]["batch"] == 2 // len(devices)
        pids.add(conv["pid"])
    assert len(pids) == len(devices) and (os.getpid() in pids) == (len(devices) == 1)
    assert outcome.api["batches_submitted"] == 1 and outcome.api["clients"][0]["provider"] == "openai"
    async with await Ledger.open(tmp_path) as ledger:
        assert await ledger.open_batches() == []  # recorded, then marked collected
    data = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert batch.id.encode() in data and KEY.encode() not in data  # the batch is in the ledger, the key never


async def test_a_rerun_reattaches_to_a_batch_left_open_and_pays_nothing_twice(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    speaker = APIParticipant(
        name="s", provider="openai", model_id="gpt-test", batch=True, batch_policy=PATIENT
    )
    jobs = [MixedJob(speaker, f"question {i}", api_first=True, local=False) for i in range(3)]
    server.timeout_next(1, seconds=60, path="/v1/batches/*")  # the first poll hangs: the run is cancelled

    async def first_run() -> None:
        await run_jobs([lineup("api", jobs)], RunConfig(devices=["cpu"], out_dir=tmp_path))

    async with anyio.create_task_group() as tg:
        tg.start_soon(first_run)
        await server.await_until(
            lambda s: any(r.method == "GET" and r.path.startswith("/v1/batches/") for r in s.requests),
            timeout=30,
        )
        tg.cancel_scope.cancel()
    [batch_id] = server.batches
    with anyio.fail_after(30):
        outcome = await run_jobs([lineup("api", jobs)], RunConfig(devices=["cpu"], out_dir=tmp_path))
    assert outcome.failed == [] and server.batch_count("openai") == 1  # no second batch
    assert outcome.api["rows_reattached"] == 3 and outcome.api["batches_submitted"] == 0
    for i in range(3):
        conv = outcome.outcome(f"api/{i:04d}").conversation
        assert conv["batch_id"] == batch_id and conv["text"] == default_reply(
            request_body(ask(f"question {i}"))
        )
