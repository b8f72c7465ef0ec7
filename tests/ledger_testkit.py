"""Older ledger files, for the tests of what opens them: the schema-2 SQL as version 2 created it, and a
rewrite of a ledger written now into what version 3, 2 or 1 would have written for the same run.

Kept in the tests on purpose: the store keeps only the way forward (``MIGRATIONS``), and a test that built
its "old" file with the code under test could not notice that code changing.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

__all__ = ["V2_RESULTS", "V2_SCHEMA", "as_schema", "inline_records", "token_rows"]

#: The tables of schema version 2 that version 3 changed (every other table is unchanged).
V2_RESULTS = """
CREATE TABLE results (
    job_id      TEXT PRIMARY KEY REFERENCES jobs(job_id),
    conversation_json TEXT NOT NULL,
    analysis_json TEXT
);
"""

#: ``store/_schema.py``'s SCHEMA as version 2 shipped it.
V2_SCHEMA = (
    """
CREATE TABLE runs (
    run_id      INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at  REAL NOT NULL,
    ended_at    REAL,
    status      TEXT NOT NULL,
    pid         INTEGER NOT NULL,
    host        TEXT NOT NULL,
    versions_json TEXT NOT NULL
);
CREATE TABLE lineups (
    name        TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    describe_json TEXT NOT NULL,
    first_run   INTEGER NOT NULL REFERENCES runs(run_id)
);
CREATE TABLE run_lineups (
    run_id      INTEGER NOT NULL REFERENCES runs(run_id),
    lineup      TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    PRIMARY KEY (run_id, lineup)
) WITHOUT ROWID;
CREATE TABLE jobs (
    seq         INTEGER PRIMARY KEY,
    job_id      TEXT NOT NULL UNIQUE,
    lineup      TEXT NOT NULL,
    seed        INTEGER NOT NULL,
    row_index   INTEGER,
    state       TEXT NOT NULL CHECK (state IN ('pending', 'running', 'done', 'failed')),
    attempts    INTEGER NOT NULL DEFAULT 0,
    device      TEXT,
    created_at  REAL NOT NULL,
    started_at  REAL,
    finished_at REAL,
    tokens_generated INTEGER NOT NULL DEFAULT 0,
    error_type  TEXT,
    error_message TEXT,
    error_traceback TEXT,
    run_id      INTEGER REFERENCES runs(run_id),
    input_fp    TEXT
);
CREATE INDEX jobs_by_state ON jobs(state, job_id);
CREATE TABLE turns (
    job_id      TEXT NOT NULL REFERENCES jobs(job_id),
    idx         INTEGER NOT NULL,
    turn_json   TEXT NOT NULL,
    committed_at REAL NOT NULL,
    PRIMARY KEY (job_id, idx)
);
"""
    + V2_RESULTS
    + """
CREATE TABLE batches (
    provider    TEXT NOT NULL,
    batch_id    TEXT NOT NULL,
    state       TEXT NOT NULL,
    meta_json   TEXT NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    PRIMARY KEY (provider, batch_id)
) WITHOUT ROWID;
CREATE TABLE batch_requests (
    provider    TEXT NOT NULL,
    batch_id    TEXT NOT NULL,
    custom_id   TEXT NOT NULL,
    job_id      TEXT NOT NULL,
    turn_index  INTEGER NOT NULL,
    request_hash TEXT,
    PRIMARY KEY (provider, batch_id, custom_id),
    FOREIGN KEY (provider, batch_id) REFERENCES batches(provider, batch_id)
) WITHOUT ROWID;
PRAGMA application_id = 1229737555;
PRAGMA user_version = 2;
"""
)

# Version 4 added the table of replaced results; version 3 kept none (a replaced result was gone).
_TO_V3 = "DROP TABLE superseded_results; PRAGMA user_version = 3;"

# A version-3 result put back together in SQL, as version 2 stored it: one conversation_json per job.
_TO_V2 = (
    "ALTER TABLE results RENAME TO results_v3;"
    + V2_RESULTS
    + """
INSERT INTO results (job_id, conversation_json, analysis_json)
SELECT r.job_id,
    CASE WHEN r.turn_order IS NULL THEN with_recipe ELSE json_set(with_recipe, '$.transcript', json(
        (SELECT json_group_array(json(turn_json)) FROM (SELECT t.turn_json FROM json_each(r.turn_order) o
            JOIN turns t ON t.job_id = r.job_id AND t.idx = o.value ORDER BY o.key)))) END,
    r.analysis_json
FROM (SELECT r.*, CASE WHEN r.lineup_recipe THEN json_set(r.state_json, '$.recipe', json(l.describe_json))
        ELSE r.state_json END AS with_recipe
    FROM results_v3 r JOIN jobs j ON j.job_id = r.job_id LEFT JOIN lineups l ON l.name = j.lineup) r;
DROP TABLE results_v3;
DELETE FROM turns WHERE idx < 0;
PRAGMA user_version = 2;
"""
)

_TO_V1 = (
    "ALTER TABLE jobs DROP COLUMN input_fp; ALTER TABLE batch_requests DROP COLUMN request_hash; "
    "PRAGMA user_version = 1;"
)


def _to_v4(conn: sqlite3.Connection) -> None:
    """Version 5 keeps token records in turn_tokens; version 4 kept them in the turn's JSON (base64)."""
    from interlens.store._token_rows import join

    rows = conn.execute(
        "SELECT t.job_id, t.idx, t.turn_json, k.facts_json, k.ids, k.model_logprobs, k.sampling_logprobs, "
        "k.prompt_ids FROM turn_tokens k JOIN turns t ON t.job_id = k.job_id AND t.idx = k.idx"
    ).fetchall()
    for job_id, idx, text, *values in rows:
        turn = json.loads(text)
        turn["metadata"]["tokens"] = join(turn["metadata"]["tokens"], values)
        conn.execute(
            "UPDATE turns SET turn_json = ? WHERE job_id = ? AND idx = ?",
            (json.dumps(turn, ensure_ascii=False, separators=(",", ":")), job_id, idx),
        )
    conn.execute("DROP TABLE turn_tokens")
    conn.execute("PRAGMA user_version = 4")


def inline_records(conn: sqlite3.Connection) -> None:
    """Every ``turn_tokens`` row whose bytes are in ``token_stream`` (schema 7) stored in its own columns
    instead, as schema 6 wrote rows (valid in schema 7 too: migrated rows stay so), the stream emptied."""
    from interlens.store._token_stream import SEGMENT

    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "token_stream" not in tables:
        return  # an older schema's ledger: its rows are in their columns
    stream = b"".join(data for (data,) in conn.execute("SELECT data FROM token_stream ORDER BY k"))
    first = conn.execute("SELECT min(k) FROM token_stream").fetchone()[0] or 0
    rows = conn.execute("SELECT job_id, idx, facts_json FROM turn_tokens").fetchall()
    for job_id, idx, facts_json in rows:
        facts = json.loads(facts_json)
        if "stream" not in facts:
            continue
        at, *sizes = facts.pop("stream")
        at -= first * SEGMENT
        parts: list[bytes | None] = []
        for size in sizes:
            parts.append(None if size < 0 else stream[at : at + size])
            at += max(size, 0)
        conn.execute(
            "UPDATE turn_tokens SET facts_json = ?, ids = ?, model_logprobs = ?, sampling_logprobs = ?, "
            "prompt_ids = ? WHERE job_id = ? AND idx = ?",
            (json.dumps(facts, ensure_ascii=False, separators=(",", ":")), *parts, job_id, idx),
        )
    conn.execute("DELETE FROM token_stream")


def token_rows(path: Path, job_id: str) -> dict[int, tuple[Any, ...]]:
    """``job_id``'s ``turn_tokens`` rows (idx → values, ``TokenRow.values()`` order) with their bytes, as
    stored: in their columns or in the stream."""
    with sqlite3.connect(path) as conn:
        conn.execute("BEGIN")
        inline_records(conn)
        rows = conn.execute(
            "SELECT idx, facts_json, ids, model_logprobs, sampling_logprobs, prompt_ids FROM turn_tokens "
            "WHERE job_id = ?",
            (job_id,),
        ).fetchall()
        conn.rollback()
    return {idx: tuple(values) for idx, *values in rows}


def _to_v6(conn: sqlite3.Connection) -> None:
    """Version 7 keeps a new row's BLOBs in token_stream and a local turn's marker in turns.stored_tokens;
    version 6 kept the BLOBs in the row's columns and the marker in the turn's JSON."""
    inline_records(conn)
    flagged = conn.execute("SELECT job_id, idx, turn_json FROM turns WHERE stored_tokens = 1").fetchall()
    for job_id, idx, text in flagged:
        turn = json.loads(text)
        if "tokens" not in turn["metadata"]:
            turn["metadata"]["tokens"] = {"stored": "turn_tokens"}
            conn.execute(
                "UPDATE turns SET turn_json = ? WHERE job_id = ? AND idx = ?",
                (json.dumps(turn, ensure_ascii=False, separators=(",", ":")), job_id, idx),
            )
    conn.execute("ALTER TABLE turns DROP COLUMN stored_tokens")
    conn.execute("DROP TABLE token_stream")
    conn.execute("PRAGMA user_version = 6")


def _to_v5(conn: sqlite3.Connection) -> None:
    """Version 6 may store a prompt's ids as references to its job's earlier rows and keeps each row's digest
    in its facts; version 5 stored every id and kept the digest in the turn's marker."""
    from interlens.store._token_rows import TokenRow, resolved

    rows = conn.execute(
        "SELECT k.job_id, k.idx, t.turn_json, k.facts_json, k.ids, k.model_logprobs, k.sampling_logprobs, "
        "k.prompt_ids FROM turn_tokens k JOIN turns t ON t.job_id = k.job_id AND t.idx = k.idx"
    ).fetchall()
    sources: dict[str, dict[int, bytes]] = {}
    for job_id, idx, _, _, ids, *_ in rows:
        if ids is not None:
            sources.setdefault(job_id, {})[idx] = ids
    for job_id, idx, text, *values in rows:
        row: TokenRow = resolved(values, sources.get(job_id, {}))
        turn = json.loads(text)
        marker = turn["metadata"]["tokens"]
        rest = {k: v for k, v in marker.items() if k not in ("stored", "n")}
        n = len(row.model_logprobs) // 4  # version 5 kept every record's count and digest in its marker
        turn["metadata"]["tokens"] = {"stored": marker["stored"], "n": n, "digest": row.digest(), **rest}
        conn.execute(
            "UPDATE turn_tokens SET facts_json = ?, prompt_ids = ? WHERE job_id = ? AND idx = ?",
            (row.facts_json, row.prompt_ids, job_id, idx),
        )
        conn.execute(
            "UPDATE turns SET turn_json = ? WHERE job_id = ? AND idx = ?",
            (json.dumps(turn, ensure_ascii=False, separators=(",", ":")), job_id, idx),
        )
    conn.execute("PRAGMA user_version = 5")


def as_schema(path: Path, version: int) -> None:
    """Rewrite the closed ledger at ``path`` (schema 7) as schema ``version`` (6, 5, 4, 3, 2 or 1) would hold
    it."""
    assert version in (1, 2, 3, 4, 5, 6), version
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 7
        conn.execute("BEGIN")
        _to_v6(conn)
        if version < 6:
            _to_v5(conn)
        if version < 5:
            _to_v4(conn)
        conn.execute("COMMIT")
        steps = [_TO_V3, _TO_V2, _TO_V1][: max(0, 4 - version)]
        if steps:
            conn.executescript("BEGIN;" + "".join(steps) + "COMMIT;")
    finally:
        conn.close()
