"""Provider batch mode: one batch per round per speaker, rows mapped back, per-row failures, crash re-attach.

Rollouts run against the loopback fake provider through the official SDKs (the fake validates every body and
batch row as the provider would). The crash test kills a real child process with SIGKILL while it polls, then
re-attaches from the real ledger file. The last two exercise the scheduler's side of the seam
(``JobContext.call_gateway``, the run's ledger handed to the gateway, the run's quiescence probe).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from ledger_testkit import as_schema

from interlens import Conversation, dataset_field
from interlens._core._message import Transcript
from interlens._core._view import GenerationOptions
from interlens.participants._api_participant import APIParticipant
from interlens.providers import APIRequest, APISettings
from interlens.providers._base import request_digest
from interlens.providers._registry import request_body
from interlens.scheduler.gateway import BatchPolicy, Gateway, RetryPolicy
from interlens.store import Ledger, LedgerReader
from interlens.testing._fake_provider import FakeProviderServer, default_reply

KEY = "sk-batch-test-0123456789"
QUICK = BatchPolicy(idle_s=0.3, poll_initial_s=0.01, poll_max_s=0.05)
FAST = RetryPolicy(initial_s=0.01, max_s=0.05)


pytestmark = pytest.mark.usefixtures("hermetic_api_env")


@pytest.fixture
def api_key() -> str:
    return KEY


def debate(policy: BatchPolicy = QUICK, turns: int = 4) -> Conversation:
    pro = APIParticipant(
        name="pro",
        provider="openai",
        model_id="gpt-test",
        system_prompt="Argue YES.",
        batch=True,
        batch_policy=policy,
    )
    con = APIParticipant(
        name="con",
        provider="anthropic",
        model_id="claude-test",
        system_prompt="Argue NO.",
        batch=True,
        batch_policy=policy,
    )
    return Conversation([pro, con], shared_context="Is a hot dog a sandwich?").turns(turns)


def assert_replies_match_their_conversation(conv: Conversation, transcript: Transcript) -> None:
    """Each turn is the fake's reply to THAT conversation's history (the reply hashes the whole prompt)."""
    for i in range(1, len(transcript)):
        live = conv.set()
        live.transcript = Transcript(list(transcript)[:i])
        speaker = live.participant(transcript[i].author)
        assert isinstance(speaker, APIParticipant)
        body = request_body(speaker.request(live.view(speaker), GenerationOptions()))
        assert transcript[i].content == default_reply(body), (i, transcript[i].author)


def test_one_batch_per_round_per_speaker_and_rows_map_back(server: FakeProviderServer) -> None:
    conv = debate()
    report = conv.rollout(n=12)
    assert report.failed == [] and len(report.results) == 12
    assert server.batches_created == {"openai": 2, "anthropic": 2, "openrouter": 0}  # 4 rounds, 2 speakers
    assert not [r for r in server.requests if r.path.endswith(("/chat/completions", "/v1/messages"))]
    batch_ids: dict[int, set[str]] = {}
    for res in report.results.values():
        transcript = res.transcript
        assert transcript is not None and [m.author for m in transcript[1:]] == ["pro", "con"] * 2
        assert_replies_match_their_conversation(conv, transcript)
        for i, message in enumerate(transcript[1:]):
            assert message.metadata["batch_id"] in server.batches
            assert message.n_tokens == len(message.content.split()) and message.metadata["prompt_tokens"] > 0
            batch_ids.setdefault(i, set()).add(message.metadata["batch_id"])
    assert all(len(ids) == 1 for ids in batch_ids.values())  # every conversation's round i in ONE batch
    assert {len(server.batches[next(iter(ids))].custom_ids) for ids in batch_ids.values()} == {12}


def test_a_failing_row_fails_only_its_conversation(server: FakeProviderServer) -> None:
    server.fail_batch_rows(
        lambda cid, body: "CURSED" in str(body["messages"]), status=400, message="row refused"
    )
    questions = [{"q": f"Question {i}?"} for i in range(6)]
    questions[2] = {"q": "A CURSED question?"}
    speaker = APIParticipant(
        name="solver", provider="openai", model_id="gpt-test", batch=True, batch_policy=QUICK, retry=FAST
    )
    conv = Conversation([speaker], shared_context=dataset_field("q")).turns(2).data(questions)
    report = conv.rollout()
    assert report.failed == ["row_00002"]
    error = report.results["row_00002"].error
    assert error is not None and "HTTP 400" in error.message and "row refused" in error.message
    assert "not retryable" in error.message
    assert (
        server.batch_count("openai") == 2
    )  # round 1 (six rows), round 2 (five): the refusal was not retried
    for job in ("row_00000", "row_00001", "row_00003", "row_00004", "row_00005"):
        transcript = report.results[job].transcript
        assert transcript is not None and len(transcript) == 3


def test_a_retryable_row_goes_into_a_later_batch(server: FakeProviderServer) -> None:
    seen: set[str] = set()

    def flaky_once(custom_id: str, body: dict[str, Any]) -> bool:
        text = str(body["messages"])
        if "unlucky" in text and text not in seen:
            seen.add(text)
            return True
        return False

    server.fail_batch_rows(flaky_once, status=500, message="overloaded, try later")
    rows = [{"q": "an unlucky question"}, {"q": "a fine question"}, {"q": "another fine one"}]
    speaker = APIParticipant(
        name="s", provider="anthropic", model_id="claude-test", batch=True, batch_policy=QUICK, retry=FAST
    )
    report = Conversation([speaker], shared_context=dataset_field("q")).turns(1).data(rows).rollout()
    assert report.failed == []
    assert server.batch_count("anthropic") == 2  # the round, then the one failed row on its own
    batches = sorted(server.batches.values(), key=lambda b: len(b.custom_ids))
    assert [len(b.custom_ids) for b in batches] == [1, 3]
    unlucky = report.results["row_00000"].transcript
    assert unlucky is not None and unlucky[1].metadata["batch_id"] == batches[0].id


def test_batch_control_calls_retry_and_a_refused_submission_fails_its_rows(
    server: FakeProviderServer,
) -> None:
    speaker = APIParticipant(
        name="s", provider="openai", model_id="gpt-test", batch=True, batch_policy=QUICK, retry=FAST
    )
    conv = Conversation([speaker], shared_context=dataset_field("q")).turns(1).data([{"q": "a"}, {"q": "b"}])
    server.fail_next(1, status=500, path="/v1/files")  # upload: retried
    server.fail_next(1, status=503, retry_after=0.01, path="/v1/batches/*")  # a poll: retried
    report = conv.rollout()
    assert report.failed == [] and server.batch_count("openai") == 1
    server.reset_meters()
    server.fail_next(1, status=400, message="quota exhausted for batches", path="/v1/batches")
    refused = conv.name("again").rollout()
    assert sorted(refused.failed) == ["row_00000", "row_00001"] and server.batch_count("openai") == 0
    error = refused.results["row_00000"].error
    assert error is not None and "submitting an openai batch failed: HTTP 400" in error.message
    assert "quota exhausted" in error.message and "not retryable" in error.message


async def test_rounds_split_at_max_rows_and_a_cancelled_caller_leaves_its_round(
    server: FakeProviderServer,
) -> None:
    def spec(**policy: Any) -> APIParticipant:
        batch_policy = BatchPolicy(poll_initial_s=0.01, poll_max_s=0.05, **policy)
        return APIParticipant(
            name="s", provider="openai", model_id="gpt-test", batch=True, batch_policy=batch_policy
        )

    results: dict[int, Any] = {}
    scopes: dict[int, anyio.CancelScope] = {}

    async def ask(gateway: Gateway, speaker: APIParticipant, i: int) -> None:
        with anyio.CancelScope() as scopes[i]:
            results[i] = await gateway.call(speaker, request(i), owner=f"job{i}")

    async with Gateway() as gateway:
        split = spec(max_rows=4, idle_s=0.2)
        async with anyio.create_task_group() as tg:
            for i in range(9):
                tg.start_soon(ask, gateway, split, i)
        assert sorted(len(b.custom_ids) for b in server.batches.values()) == [1, 4, 4]
        server.reset_meters()
        patient = spec(idle_s=0.3)
        async with anyio.create_task_group() as tg:
            for i in range(10, 15):
                tg.start_soon(ask, gateway, patient, i)
                await anyio.wait_all_tasks_blocked()
            assert gateway.waiting == 5
            scopes[10].cancel()  # the round's first caller drives its flush; cancelled, it hands that on
    assert server.batch_count("openai") == 1
    assert sorted(results) == [*range(9), 11, 12, 13, 14]
    for i, result in results.items():
        assert result.text == default_reply(request_body(request(i))) and result.batch_id in server.batches
    last = next(b for b in server.batches.values() if b.id == results[11].batch_id)
    assert len(last.custom_ids) == 4  # the cancelled row was never sent


def request(i: int, *, system: str | None = None, temperature: float | None = None) -> APIRequest:
    return APIRequest(
        provider="openai",
        model="gpt-test",
        system=system,
        messages=(("user", f"question {i}"),),
        settings=APISettings(max_tokens=16, temperature=temperature, prompt_cache=False),
        turn=0,
    )


_CHILD = textwrap.dedent(
    """
    import sys, anyio
    from interlens.participants._api_participant import APIParticipant
    from interlens.providers import APIRequest, APISettings
    from interlens.scheduler.gateway import BatchPolicy, Gateway
    from interlens.store import Ledger, LedgerReader

    async def main(out_dir):
        spec = APIParticipant(name="s", provider="openai", model_id="gpt-test", batch=True,
                              batch_policy=BatchPolicy(idle_s=0.2, poll_initial_s=0.01, poll_max_s=0.05))
        async with await Ledger.open(out_dir) as ledger, Gateway(store=ledger) as gateway:
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    req = APIRequest(provider="openai", model="gpt-test", system=None,
                                     messages=(("user", f"question {i}"),),
                                     settings=APISettings(max_tokens=16, prompt_cache=False), turn=0)
                    tg.start_soon(lambda r=req, i=i: gateway.call(spec, r, owner=f"job{i}"))

    anyio.run(main, sys.argv[1])
    """
)


async def _kill_while_polling(server: FakeProviderServer, args: list[str]) -> subprocess.Popen[bytes]:
    """Run ``python -c args...``; SIGKILL it once its first batch poll (made to hang) reaches the server."""
    server.timeout_next(1, seconds=60, path="/v1/batches/*")
    child = subprocess.Popen([sys.executable, "-c", *args], env=dict(os.environ))
    try:
        await server.await_until(
            lambda s: any(r.method == "GET" and r.path.startswith("/v1/batches/") for r in s.requests),
            timeout=60,
        )
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    return child


async def test_sigkill_while_polling_then_reattach_without_resubmitting(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    child = await _kill_while_polling(server, [_CHILD, str(tmp_path)])
    assert child.returncode == -signal.SIGKILL
    assert server.batch_count("openai") == 1
    [batch_id] = server.batches
    spec = APIParticipant(
        name="s",
        provider="openai",
        model_id="gpt-test",
        batch=True,
        batch_policy=BatchPolicy(poll_initial_s=0.01),
    )
    async with await Ledger.open(tmp_path) as ledger:
        [record] = await ledger.open_batches()  # recorded before the first poll, durable across SIGKILL
        assert (record.provider, record.batch_id) == ("openai", batch_id)
        assert sorted(record.requests.values()) == [(f"job{i}", 0) for i in range(5)]
        hashes = set(record.request_hashes.values())  # one per row, each a digest of what that row sent
        assert len(hashes) == 5 and all(re.fullmatch("[0-9a-f]{64}", str(h)) for h in hashes)
        async with Gateway(store=ledger) as gateway:
            assert await gateway.load_open_batches() == 5
            results: dict[int, Any] = {}

            async def ask(i: int) -> None:
                results[i] = await gateway.call(spec, request(i), owner=f"job{i}")

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for i in range(5):
                        tg.start_soon(ask, i)
            stats = gateway.stats()
            assert (stats["rows_reattached"], stats["rows_refused"], stats["batches_submitted"]) == (5, 0, 0)
        assert await ledger.open_batches() == []  # collected: a later rerun will not wait on it again
    assert server.batch_count("openai") == 1  # zero new batches: nothing paid twice
    for i, result in results.items():
        assert result.batch_id == batch_id and result.text == default_reply(request_body(request(i)))


async def _rerun(tmp_path: Path, requests: dict[int, APIRequest]) -> tuple[dict[int, Any], dict[str, Any]]:
    """The rerun after the crash: the same five jobs ask again, with ``requests`` as they are now."""
    spec = APIParticipant(
        name="s",
        provider="openai",
        model_id="gpt-test",
        batch=True,
        batch_policy=BatchPolicy(idle_s=0.2, poll_initial_s=0.01, poll_max_s=0.05),
    )
    results: dict[int, Any] = {}
    async with await Ledger.open(tmp_path) as ledger, Gateway(store=ledger) as gateway:
        assert await gateway.load_open_batches() == 5

        async def ask(i: int) -> None:
            results[i] = await gateway.call(spec, requests[i], owner=f"job{i}")

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in requests:
                    tg.start_soon(ask, i)
        return results, gateway.stats()


async def test_a_job_whose_request_changed_since_the_crash_is_sent_anew_not_reattached(
    server: FakeProviderServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _kill_while_polling(server, [_CHILD, str(tmp_path)])
    [old_batch] = server.batches
    # The rerun asks for the same (job, turn) keys, but job1 and job3 now send another question.
    now = {i: request(i) for i in range(5)}
    now[1] = request(1, system="Answer in one word.")
    now[3] = request(3, temperature=0.25)
    sent: list[dict[str, Any]] = []  # every batch row body the provider processes (a rule that fails none)
    server.fail_batch_rows(lambda custom_id, body: sent.append(body) is not None)
    with caplog.at_level("WARNING", logger="interlens.gateway"):
        results, stats = await _rerun(tmp_path, now)
    assert (stats["rows_reattached"], stats["rows_refused"], stats["batches_submitted"]) == (3, 2, 1)
    assert server.batch_count("openai") == 2
    [new_batch] = set(server.batches) - {old_batch}
    assert sorted(server.batches[new_batch].custom_ids) == ["r0", "r1"]  # only the two changed requests
    for i in (0, 2, 4):  # unchanged: answered by the batch already paid for
        assert results[i].batch_id == old_batch and results[i].text == default_reply(request_body(now[i]))
    for i in (1, 3):  # changed: the provider got (and answered) the NEW request, never the old row's answer
        assert results[i].batch_id == new_batch and results[i].text == default_reply(request_body(now[i]))
    assert results[1].text != default_reply(request_body(request(1)))
    # The old batch's five rows, and the two changed requests as they are now (temperature included).
    expected = [request_body(request(i)) for i in range(5)] + [request_body(now[1]), request_body(now[3])]
    assert sorted(map(str, sent)) == sorted(map(str, expected))
    refused = [r.getMessage() for r in caplog.records if "not re-attached" in r.getMessage()]
    assert len(refused) == 2 and all(old_batch in m and "is different" in m for m in refused)
    with LedgerReader(tmp_path) as reader:
        states = {b.batch_id: b.state for b in reader.batches()}
        [new_record] = [b for b in reader.batches() if b.batch_id == new_batch]
    assert states == {old_batch: "collected", new_batch: "collected"}
    assert sorted(new_record.requests.values()) == [("job1", 0), ("job3", 0)]
    # What a later rerun compares: the digest of each row's request as it was sent, to that endpoint.
    sent_as = {cid: request_body(now[int(job[-1])]) for cid, (job, _) in new_record.requests.items()}
    base_url = os.environ["OPENAI_BASE_URL"]
    assert new_record.request_hashes == {
        cid: request_digest("openai", base_url, "/v1/chat/completions", body) for cid, body in sent_as.items()
    }


def test_request_digest_covers_every_parameter_and_no_credential() -> None:
    def digest(req: APIRequest, base_url: str = "https://api.openai.com/v1") -> str:
        return request_digest("openai", base_url, "/v1/chat/completions", request_body(req))

    def tuned(**settings: Any) -> APIRequest:
        return replace(request(0), settings=replace(request(0).settings, **settings))

    base = digest(request(0))
    assert digest(request(0)) == base  # stable
    changed = [
        request(1),
        request(0, system="Be brief."),
        request(0, temperature=0.0),
        replace(request(0), model="gpt-other"),
        tuned(max_tokens=17),
        tuned(top_p=0.9),
        tuned(stop=("END",)),
    ]
    assert len({base, *(digest(r) for r in changed)}) == 1 + len(changed)
    assert digest(request(0), "https://proxy.example/v1") != base  # another endpoint cannot poll that batch
    # What authenticates is not part of it: user info and query parameters of the base URL are dropped.
    assert digest(request(0), "https://user:sk-secret@api.openai.com/v1?api-key=sk-secret") == base
    assert digest(tuned(timeout=5.0)) == base  # a client-side timeout is not sent


def _as_version_1(out_dir: Path) -> None:
    """Turn the crashed run's ledger into what interlens 0.x (schema version 1) wrote: no request hashes."""
    as_schema(out_dir / "ledger.sqlite", 1)


async def test_a_row_recorded_without_a_request_hash_is_never_reattached(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    await _kill_while_polling(server, [_CHILD, str(tmp_path)])
    [old_batch] = server.batches
    _as_version_1(tmp_path)
    with LedgerReader(tmp_path) as reader:  # read as it is: no hash to verify against
        [record] = reader.batches()
    assert len(record.requests) == 5 and set(record.request_hashes.values()) == {None}
    polls = server.batches[old_batch].polls
    # The same requests as before the crash, but nothing proves it: each is sent again.
    results, stats = await _rerun(tmp_path, {i: request(i) for i in range(5)})
    assert (stats["rows_reattached"], stats["rows_refused"], stats["batches_submitted"]) == (0, 5, 1)
    [new_batch] = set(server.batches) - {old_batch}
    assert all(
        r.batch_id == new_batch and r.text == default_reply(request_body(request(i)))
        for i, r in results.items()
    )
    assert server.batches[old_batch].polls == polls  # the unverifiable batch was not even polled
    with LedgerReader(tmp_path) as reader:
        states = {b.batch_id: b.state for b in reader.batches()}
        assert reader.batches(open_only=True) == []
    # Every row of the old batch was refused: superseded, so no later rerun re-checks or waits on it.
    assert states == {old_batch: "superseded", new_batch: "collected"}


# -- the scheduler's side: the run's gateway, its ledger and its quiescence probe


_ROLLOUT_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from test_api_batch import debate
    debate().rollout(n=6, out_dir=sys.argv[1])
    """
)


async def test_rollout_killed_while_polling_resumes_on_the_same_batch(
    server: FakeProviderServer, tmp_path: Path
) -> None:
    await _kill_while_polling(server, [_ROLLOUT_CHILD, str(tmp_path), str(Path(__file__).parent)])
    assert server.batches_created == {"openai": 1, "anthropic": 0, "openrouter": 0}
    conv = debate()
    report = await conv.arollout(n=6, out_dir=tmp_path)
    assert report.failed == []
    assert server.batches_created == {"openai": 2, "anthropic": 2, "openrouter": 0}  # round 1 not paid twice
    for res in report.results.values():
        assert res.transcript is not None
        assert_replies_match_their_conversation(conv, res.transcript)


async def test_quiescence_flushes_each_round_without_waiting_for_idleness(server: FakeProviderServer) -> None:
    patient = BatchPolicy(idle_s=60, max_wait_s=120, poll_initial_s=0.01, poll_max_s=0.05)
    with anyio.fail_after(30):  # an idle-only flush would take a minute per round
        report = await debate(patient, turns=2).arollout(n=10)
    assert report.failed == []
    assert server.batches_created == {"openai": 1, "anthropic": 1, "openrouter": 0}
