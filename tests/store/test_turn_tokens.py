"""Token records in their own table (schema 5, issue 40): written with their turn, read only when asked.

A turn's record leaves its JSON for ``turn_tokens`` (little-endian BLOBs) in the turn's own transaction and
comes back bit for bit where tokens are asked for; an old ledger's base64 records move there when a writer
opens it; a damaged row is named by job and turn while the rest reads; a SIGKILL mid-burst leaves no turn
without its record; and readers that do not ask for tokens never read the table.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from crash_testkit import lines
from ledger_testkit import as_schema, inline_records

from interlens import ConfigurationError, Message, TokenRecord, Transcript
from interlens.report import ledger_rows, ledger_token_rows
from interlens.store import JobRecord, Ledger, LedgerReader, UnreadableRecordError, restore_tokens

CHILD = Path(__file__).parent.parent / "scripts" / "token_burst_child.py"


def _local(author: str, prompt: list[int], ids: list[int], *, greedy: bool = False) -> dict[str, Any]:
    record = TokenRecord.build(
        ids, [-0.1 * (k + 1) for k in range(len(ids))], [0.0 if greedy else -0.3] * len(ids), prompt
    )
    return Message(
        author, f"{author} says {ids}", {"n_tokens": len(ids), "tokens": record.to_json()}
    ).to_json()


def _hosted(author: str) -> dict[str, Any]:
    record = TokenRecord.reported("openai", ["Hel", "lo", " there"], [-0.25, -1.5, -3.0625])
    return Message(author, "Hello there", {"n_tokens": 3, "tokens": record.to_json()}).to_json()


def _transcript() -> list[dict[str, Any]]:
    """A seeded context with a record (a message no turn row holds) and committed turns of every kind."""
    return Transcript.from_json(
        [
            _local("seed", [1, 2], [3, 4, 70_000]),  # ids past 2**16: 4-byte ids
            _local("a", [1, 2, 3], [4, 5]),
            _local("b", [9, 1, 2], [6], greedy=True),
            _local("a", [1, 2, 3, 4, 5, 7, 6, 8], [10]),  # a difference from a's first turn
            _hosted("c"),
            Message("moderator", "no record").to_json(),
        ]
    ).to_json()


async def _write(out_dir: Path, jobs: int = 2) -> list[dict[str, Any]]:
    transcript = _transcript()
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"job_{j}", "l", seed=j) for j in range(jobs))
        for j in range(jobs):
            await ledger.start_job(f"job_{j}", device="cpu")
            for i, turn in enumerate(transcript[1:]):
                await ledger.record_turn(f"job_{j}", i, turn)
            conversation = {"transcript": transcript, "seed": j}
            await ledger.finish_job(f"job_{j}", conversation=conversation, analysis=None, tokens_generated=1)
        await ledger.end_run("completed")
    return transcript


def _tokens(reader: LedgerReader, job_id: str) -> list[TokenRecord | None]:
    result = reader.result(job_id)
    assert result is not None
    messages = result["conversation"]["transcript"]
    records = reader.result_tokens(job_id)
    restored = messages if records is None else restore_tokens(messages, records)
    return [m.tokens for m in Transcript.from_json(restored)]


async def test_records_round_trip_bit_for_bit_and_leave_the_turns_json(tmp_path: Path) -> None:
    written = await _write(tmp_path)
    expected = [m.tokens for m in Transcript.from_json(written)]
    assert sum(r is not None for r in expected) == 5
    with LedgerReader(tmp_path) as reader:
        for job in ("job_0", "job_1"):
            assert _tokens(reader, job) == expected  # float32 arrays, ids, prompts, texts: equal
            stored = reader.result(job)["conversation"]["transcript"]
            assert restore_tokens(stored, reader.result_tokens(job)) == written  # the very JSON written
            markers = [m["metadata"].get("tokens") for m in stored]
            assert [m and m["stored"] for m in markers] == ["turn_tokens"] * 5 + [None]
            assert markers[4]["reported_by"] == "openai" and markers[4]["n"] == 3
    exported = json.loads(next(iter(ledger_rows(tmp_path)))["transcript"])  # a plain export: no records,
    hosted = {"stored": "turn_tokens", "n": 3, "reported_by": "openai"}  # so no local turn's marker either
    assert [m["metadata"].get("tokens") for m in exported] == [None] * 4 + [hosted, None]
    async with await Ledger.open(tmp_path) as ledger:  # what a resumed attempt replays: the records whole
        assert await ledger.committed_turns("job_0") == written[1:]
    with pytest.raises(ConfigurationError, match="stored in the ledger's turn_tokens table"):
        Message.from_json(stored[1]).tokens  # noqa: B018  (a marker read on its own: says where to read it)
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        assert db.execute("SELECT count(*) FROM turn_tokens").fetchone()[0] == 10  # one per record
        assert (
            db.execute("SELECT count(*) FROM turns WHERE turn_json LIKE '%model_logprobs%'").fetchone()[0]
            == 0
        )
    rows = list(ledger_token_rows(tmp_path))
    assert len(rows) == 10 and {r["logprobs_source"] for r in rows} == {"local", "openai"}


async def test_an_old_ledger_with_base64_records_is_read_as_it_is_and_upgraded_in_place(
    tmp_path: Path,
) -> None:
    written = await _write(tmp_path)
    expected = [m.tokens for m in Transcript.from_json(written)]
    path = tmp_path / "ledger.sqlite"
    as_schema(path, 4)  # what interlens wrote before: base64 in the turn's JSON, no turn_tokens
    with LedgerReader(tmp_path) as reader:
        assert reader.result("job_0")["conversation"]["transcript"] == written
        assert reader.result_tokens("job_0") is None and _tokens(reader, "job_0") == expected
    async with await Ledger.open(tmp_path) as ledger:  # 4 → 5 at open, in its transaction
        await ledger.begin_run({"l": "fp"}, versions={})
        assert await ledger.committed_turns("job_1") == written[1:]
        await ledger.end_run("completed")
    with LedgerReader(tmp_path) as reader:
        assert reader.summary()["schema_version"] == 7
        assert _tokens(reader, "job_0") == _tokens(reader, "job_1") == expected
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM turn_tokens").fetchone()[0] == 10
        assert (
            db.execute("SELECT count(*) FROM turns WHERE turn_json LIKE '%model_logprobs%'").fetchone()[0]
            == 0
        )


async def test_a_version_6_ledger_is_upgraded_in_place_and_an_older_interlens_refuses_version_7(
    tmp_path: Path,
) -> None:
    written = await _write(tmp_path)
    expected = [m.tokens for m in Transcript.from_json(written)]
    path = tmp_path / "ledger.sqlite"
    as_schema(path, 6)  # rows in their own columns, every marker in its turn's JSON
    with sqlite3.connect(path) as db:
        in_json = db.execute("SELECT count(*) FROM turns WHERE turn_json LIKE '%\"stored\"%'").fetchone()[0]
    assert in_json == 10  # 4 local and 1 hosted marker per job (the seeded context's included)
    with LedgerReader(tmp_path) as reader:  # read as it is
        assert reader.summary()["schema_version"] == 6 and _tokens(reader, "job_0") == expected
    async with await Ledger.open(tmp_path) as ledger:  # 6 → 7 at open, in its transaction
        await ledger.begin_run({"l": "fp"}, versions={})
        assert await ledger.committed_turns("job_1") == written[1:]
        await ledger.record_turn("job_1", 5, _local("a", [1, 2, 3], [11, 12]))  # a new row: streamed
        await ledger.end_run("completed")
    with sqlite3.connect(path) as db:
        markers = dict(
            ((job, idx), (flag, json.loads(text)["metadata"].get("tokens")))
            for job, idx, flag, text in db.execute("SELECT job_id, idx, stored_tokens, turn_json FROM turns")
        )
        facts = {
            (j, i): json.loads(f) for j, i, f in db.execute("SELECT job_id, idx, facts_json FROM turn_tokens")
        }
    assert markers["job_0", 0] == (1, None)  # a local turn's marker left its JSON for the flag
    assert markers["job_0", 3] == (
        1,
        {"stored": "turn_tokens", "n": 3, "reported_by": "openai"},
    )  # hosted: kept
    assert markers["job_0", 4] == (None, None) and markers["job_0", -1] == (
        1,
        None,
    )  # no record; seeded context
    assert (
        "stream" not in facts["job_0", 0] and "stream" in facts["job_1", 5]
    )  # old rows stay in their columns
    with LedgerReader(tmp_path) as reader:
        assert reader.summary()["schema_version"] == 7
        assert _tokens(reader, "job_0") == _tokens(reader, "job_1") == expected
        assert (
            restore_tokens(
                reader.result("job_0")["conversation"]["transcript"], reader.result_tokens("job_0")
            )
            == written
        )  # the markers put back: what was written, record for record
        assert reader.turns("job_1")[5]["metadata"]["tokens"] == {"stored": "turn_tokens"}
    import store._schema as schema

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schema, "SCHEMA_VERSION", schema.SCHEMA_VERSION - 1)  # what an interlens of 6 checks
        with pytest.raises(
            schema.LedgerSchemaError, match="ledger schema version 7; this version understands up to 6"
        ):
            schema.check_existing(path, deep=False)


async def test_records_fill_the_stream_s_pages_whatever_their_size(tmp_path: Path) -> None:
    """Records of ~2.7 KB (256 tokens) and of a few bytes, interleaved: every page of the stream but its last
    is full to within a few bytes (a row of its own per record left a third of each 4 KiB page empty), and
    every record, most of them across two segments, reads back bit for bit."""
    from store._token_stream import SEGMENT

    transcript = [
        _local("ab"[k % 2], [1, 2, 3], [(97 * k + j) % 50_000 for j in range(256 if k % 3 else 5)])
        for k in range(24)
    ]
    async with await Ledger.open(tmp_path) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"job_{j}", "l", seed=j) for j in range(2))
        for j in range(2):
            await ledger.start_job(f"job_{j}", device="cpu")
        for k, turn in enumerate(transcript):
            for j in range(2):  # two jobs' turns interleaved, as a rollout commits them
                await ledger.record_turn(f"job_{j}", k, turn)
        for j in range(2):
            await ledger.finish_job(
                f"job_{j}", conversation={"transcript": transcript}, analysis=None, tokens_generated=1
            )
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        sizes = [n for (n,) in db.execute("SELECT length(data) FROM token_stream ORDER BY k")]
        pages = db.execute(
            "SELECT unused FROM dbstat WHERE name = 'token_stream' AND pagetype = 'leaf' ORDER BY pageno"
        ).fetchall()
    assert len(sizes) > 20 and set(sizes[:-1]) == {SEGMENT}  # ~65 KB of records: whole segments
    assert len(pages) == len(sizes) and sorted(u for (u,) in pages)[-2] < 40  # each page full but the last
    with LedgerReader(tmp_path) as reader:
        for j in range(2):
            restored = restore_tokens(
                reader.result(f"job_{j}")["conversation"]["transcript"], reader.result_tokens(f"job_{j}")
            )
            assert restored == transcript


def _overwrite_stream(db: sqlite3.Connection, job_id: str, idx: int, cut: bool) -> None:
    """Zero the stream's bytes of one row (or cut the stream short from them: ``cut``)."""
    (facts,) = db.execute(
        "SELECT facts_json FROM turn_tokens WHERE job_id = ? AND idx = ?", (job_id, idx)
    ).fetchone()
    at, *sizes = json.loads(facts)["stream"]
    key, data = db.execute("SELECT k, data FROM token_stream ORDER BY k DESC LIMIT 1").fetchone()
    assert key == 0  # these records are small: one segment holds them all
    end = at + sum(max(n, 0) for n in sizes)
    data = data[:at] if cut else data[:at] + bytes(end - at) + data[end:]
    db.execute("UPDATE token_stream SET data = ? WHERE k = 0", (data,))


@pytest.mark.parametrize(
    "damage",
    [
        "model_logprobs = substr(model_logprobs, 1, 5)",  # cut short (a row in its own columns)
        "ids = ids || x'0000'",  # a wrong length
        "sampling_logprobs = zeroblob(length(sampling_logprobs))",  # right length, wrong bytes
        "stream overwritten",  # schema 7: the row's bytes in the stream, zeroed
        "stream cut",  # the stream ends before the row's bytes
        "row missing",  # the turns row says it has a record; its turn_tokens row is gone
    ],
)
async def test_a_damaged_record_is_named_by_job_and_turn_and_the_rest_reads(
    tmp_path: Path, damage: str
) -> None:
    written = await _write(tmp_path)
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        if damage.startswith("stream"):
            _overwrite_stream(db, "job_1", 0, cut=damage == "stream cut")
        elif damage == "row missing":
            db.execute("DELETE FROM turn_tokens WHERE job_id = 'job_1' AND idx = 0")
        else:
            inline_records(db)  # as schema 6 stored rows (and a migrated ledger keeps them)
            db.execute(f"UPDATE turn_tokens SET {damage} WHERE job_id = 'job_1' AND idx = 0")
    with LedgerReader(tmp_path) as reader:
        with pytest.raises(UnreadableRecordError, match=r"job 'job_1'.s turn 0 .*turn_tokens") as caught:
            reader.result_tokens("job_1")
        assert (caught.value.job_id, caught.value.idx) == ("job_1", 0)
        assert reader.result("job_1")["conversation"]["transcript"][1]["content"] == written[1]["content"]
        assert _tokens(reader, "job_0") == [m.tokens for m in Transcript.from_json(written)]  # before it
        assert reader.unreadable_records() == []  # the turn's JSON itself reads
    async with await Ledger.open(tmp_path) as ledger:  # a resume that would replay it names it too
        with pytest.raises(UnreadableRecordError, match=r"job 'job_1'.s turn 0: its token record"):
            await ledger.committed_turns("job_1")
    assert len(list(ledger_rows(tmp_path))) == 2  # a plain export does not read records


def test_a_sigkill_mid_burst_loses_no_acknowledged_turn_and_leaves_none_without_its_record(
    tmp_path: Path,
) -> None:
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path), "8", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    acked: set[tuple[str, int]] = set()
    try:
        events = lines(child)
        while len(acked) < 300:  # killed in the middle of the burst, on the child's own events
            line = events.get(timeout=120)
            assert line is not None, "the child ended before the kill"
            _, job, idx = line.split()
            acked.add((job, int(idx)))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    sys.path.insert(0, str(CHILD.parent))
    try:
        from token_burst_child import turn
    finally:
        sys.path.pop(0)
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        turns = {(j, i): json.loads(t) for j, i, t in db.execute("SELECT job_id, idx, turn_json FROM turns")}
        tokens = {(j, i) for j, i in db.execute("SELECT job_id, idx FROM turn_tokens")}
        referring = db.execute("SELECT count(*) FROM turn_tokens WHERE facts_json LIKE '%refs%'").fetchone()
    assert referring[0] > 100  # later prompts refer to earlier answers (schema 6), and replay below
    assert acked <= set(turns)  # nothing acknowledged is lost
    assert set(turns) == tokens and len(turns) < 8 * 400  # no turn without its record, nor a record alone
    async_ok = []

    async def replayed() -> None:
        async with await Ledger.open(tmp_path) as ledger:
            for job in sorted({j for j, _ in turns}):
                committed = await ledger.committed_turns(job)
                number = int(job.split("_")[1])
                async_ok.append(committed == [turn(number, i) for i in range(len(committed))])

    import anyio

    anyio.run(replayed)
    assert async_ok and all(async_ok)  # every committed turn replays with its record, bit for bit


def _denying_reads_of_turn_tokens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every SQLite connection made from here on refuses to read turn_tokens and token_stream (and lists who
    tried)."""
    tried: list[str] = []
    connect = sqlite3.connect

    def guarded(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)

        def authorizer(action: int, table: str | None, *_: Any) -> int:
            if action == sqlite3.SQLITE_READ and table in ("turn_tokens", "token_stream"):
                tried.append(table)
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK

        conn.set_authorizer(authorizer)
        return conn

    monkeypatch.setattr(sqlite3, "connect", guarded)
    return tried


async def test_readers_that_do_not_ask_for_tokens_never_read_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    await _write(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(tmp_path / "ledger.sqlite", copy / "ledger.sqlite")
    tried = _denying_reads_of_turn_tokens(monkeypatch)
    from interlens.cli._commands import status

    with LedgerReader(copy) as reader:
        assert reader.summary()["jobs"] == 2 and reader.counts()["done"] == 2
        assert all(result is not None for _, result in reader.iter_results())
        assert len(reader.turns("job_0")) == 5 and reader.result("job_1") is not None
    assert len(list(ledger_rows(copy))) == 2
    status(copy)
    assert tried == []
    with LedgerReader(copy) as reader, pytest.raises(Exception, match="turn_tokens"):
        reader.result_tokens("job_0")  # the guard works: the one reader that asks for tokens is refused
    assert tried == ["turn_tokens"]
