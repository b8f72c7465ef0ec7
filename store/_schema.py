"""The ledger's SQLite schema, and the check that a file is a ledger this code may open.

The check runs on a read-only connection BEFORE any writable one exists, because merely opening a file
read-write can change it (WAL recovery, a checkpoint on close): a corrupt file or one from a newer version
must be reported and left exactly as it was.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

from ._errors import LedgerCorruptError, LedgerSchemaError
from ._token_stream import TOKEN_STREAM

__all__ = [
    "APPLICATION_ID",
    "LEDGER_FILENAME",
    "MIGRATIONS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SPLIT_FUNCTION",
    "check_existing",
    "migration_script",
    "ro_uri",
]

LEDGER_FILENAME: Final = "ledger.sqlite"

#: ``PRAGMA user_version``. Bump it with every schema change and add the step to :data:`MIGRATIONS`.
SCHEMA_VERSION: Final = 7


# Version 5 keeps turns' token records out of their JSON (store/_token_rows.py): one row per recorded turn.
# facts_json: the record's format and small facts; the arrays as little-endian BLOBs, never base64.
_TURN_TOKENS: Final = """CREATE TABLE turn_tokens (
    job_id      TEXT NOT NULL,
    idx         INTEGER NOT NULL,
    facts_json  TEXT NOT NULL,
    ids         BLOB,
    model_logprobs BLOB NOT NULL,
    sampling_logprobs BLOB,
    prompt_ids  BLOB,
    PRIMARY KEY (job_id, idx)
)"""

#: The SQL function the v4 -> v5 step calls (registered by the writer on its connection before it runs):
#: ``SPLIT_FUNCTION(turn_json, part)`` is part ``part`` of ``_token_rows.split_text(turn_json)``: 0 the turn's
#: new JSON, 1-5 its row's values as stored (NULL for a turn without a record the store knows); the v5 -> v6
#: step calls it with part -1: a version-5 turn's JSON without its marker's digest; the v6 -> v7 step with
#: part -2: a version-6 turn's JSON without its local marker.
SPLIT_FUNCTION: Final = "interlens_split_turn"
_HAS_RECORD: Final = "json_valid(turn_json) AND json_type(turn_json, '$.metadata.tokens') = 'object'"
_V4_TO_V5: Final = (
    _TURN_TOKENS,
    "CREATE TEMP TABLE v5_split AS SELECT job_id, idx, "
    + ", ".join(f"{SPLIT_FUNCTION}(turn_json, {k}) AS p{k}" for k in range(6))
    + f" FROM turns WHERE {_HAS_RECORD}",
    "INSERT INTO turn_tokens (job_id, idx, facts_json, ids, model_logprobs, sampling_logprobs, prompt_ids) "
    "SELECT job_id, idx, p1, p2, p3, p4, p5 FROM v5_split WHERE p1 IS NOT NULL",
    "UPDATE turns SET turn_json = (SELECT p0 FROM v5_split s WHERE s.job_id = turns.job_id "
    "AND s.idx = turns.idx) WHERE EXISTS (SELECT 1 FROM v5_split s WHERE s.job_id = turns.job_id "
    "AND s.idx = turns.idx "
    "AND s.p1 IS NOT NULL)",
    "DROP TABLE temp.v5_split",
)

# Version 6 lets a turn_tokens row store its prompt's new ids as references to ids its job's earlier turns
# generated (store/_token_refs.py: "refs" in facts_json), and moves the row's digest from its turn's marker
# (which every reader of turns parses) into its facts_json (read only with the row). The table is the same;
# a version-5 row's ids stay literal (valid in version 6). The step moves each digest: a row whose facts or
# turn do not parse keeps its version-5 form, which readers still take (the marker's digest). An interlens
# that reads version 5 refuses version 6 by its number.
_MOVED: Final = (
    "json_valid(t.turn_json) AND json_valid(k.facts_json) "
    "AND json_type(t.turn_json, '$.metadata.tokens.digest') = 'text'"
)
_V5_TO_V6: Final = (
    "CREATE TEMP TABLE v6_digests AS SELECT k.job_id AS job_id, k.idx AS idx, "
    "json_extract(t.turn_json, '$.metadata.tokens.digest') AS digest "
    f"FROM turn_tokens k JOIN turns t ON t.job_id = k.job_id AND t.idx = k.idx WHERE {_MOVED}",
    "CREATE UNIQUE INDEX temp.v6_digests_key ON v6_digests (job_id, idx)",
    "UPDATE turn_tokens SET facts_json = json_set(facts_json, '$.digest', (SELECT d.digest FROM v6_digests d "
    "WHERE d.job_id = turn_tokens.job_id AND d.idx = turn_tokens.idx)) WHERE EXISTS (SELECT 1 FROM "
    "v6_digests d WHERE d.job_id = turn_tokens.job_id AND d.idx = turn_tokens.idx)",
    f"UPDATE turns SET turn_json = {SPLIT_FUNCTION}(turn_json, -1) WHERE EXISTS (SELECT 1 FROM v6_digests d "
    "WHERE d.job_id = turns.job_id AND d.idx = turns.idx)",
    "DROP TABLE temp.v6_digests",
)

# Version 7 stores a new row's BLOBs in token_stream (store/_token_stream.py: page-sized segments of one
# byte stream, so that rows of ~3 KB no longer fill a 4 KiB page each) and a local turn's marker in its
# turns row (stored_tokens = 1) instead of its JSON, which every reader of turns parses. A version-6 row
# stays in its own columns (valid in version 7); each turn with a row gets stored_tokens = 1 (a hosted
# turn's marker, which show --metadata prints, stays in its JSON); a local marker leaves the JSON (the SQL
# function with part -2). An interlens that reads version 6 refuses version 7 by its number.
_LOCAL_MARKER: Final = (
    "json_valid(turn_json) AND json_extract(turn_json, '$.metadata.tokens') = '{\"stored\":\"turn_tokens\"}'"
)
_NOT_A_MARKER: Final = (  # a record the store did not know, kept in the JSON
    "json_valid(turn_json) AND json_type(turn_json, '$.metadata.tokens') IS NOT NULL "
    "AND coalesce(json_extract(turn_json, '$.metadata.tokens.stored'), '') != 'turn_tokens'"
)
_V6_TO_V7: Final = (
    TOKEN_STREAM,
    "ALTER TABLE turns ADD COLUMN stored_tokens INTEGER",
    "UPDATE turns SET stored_tokens = 1 WHERE EXISTS (SELECT 1 FROM turn_tokens k "
    f"WHERE k.job_id = turns.job_id AND k.idx = turns.idx) AND NOT ({_NOT_A_MARKER})",
    f"UPDATE turns SET turn_json = {SPLIT_FUNCTION}(turn_json, -2) "
    f"WHERE stored_tokens = 1 AND {_LOCAL_MARKER}",
)

# Version 4 keeps every result a later one replaced (see SCHEMA): one table, empty in a migrated ledger (the
# results version 3 replaced are gone).
_SUPERSEDED: Final = """CREATE TABLE superseded_results (
    job_id      TEXT NOT NULL REFERENCES jobs(job_id),
    state_json  TEXT NOT NULL,
    analysis_json TEXT,
    replaced_at REAL NOT NULL
)"""

# Version 3 stores a result's transcript once (as turns rows) and its recipe once per lineup. A v2 result
# keeps what cannot move exactly: a transcript with an element that is not a JSON object or array (SQLite
# renders top-level numbers through a double) stays in its state_json, and a recipe that is not its
# lineup's stays there too. Each message of a v2 transcript becomes a reference to a committed turn with the
# same text (the k-th occurrence of a text to its k-th committed turn: equal texts are interchangeable), or
# a new turns row with a negative idx. Temporary tables live in the connection's temp schema and are dropped.
_V2_TO_V3: Final = (
    "CREATE TEMP TABLE v3_moved (job_id TEXT PRIMARY KEY)",
    """INSERT INTO v3_moved SELECT r.job_id FROM results r
    WHERE json_type(r.conversation_json, '$.transcript') = 'array' AND NOT EXISTS (
        SELECT 1 FROM json_each(r.conversation_json, '$.transcript') e
        WHERE e.type NOT IN ('object', 'array'))""",
    """CREATE TEMP TABLE v3_committed AS SELECT t.job_id AS job_id, t.idx AS idx, json(t.turn_json) AS body,
        row_number() OVER (PARTITION BY t.job_id, json(t.turn_json) ORDER BY t.idx) AS occurrence
    FROM turns t JOIN v3_moved m ON m.job_id = t.job_id WHERE t.idx >= 0""",
    "CREATE INDEX temp.v3_committed_by_job ON v3_committed (job_id, occurrence, length(body))",
    """CREATE TEMP TABLE v3_messages AS SELECT job_id, pos, body,
        coalesce(matched, -sum(matched IS NULL) OVER (PARTITION BY job_id ORDER BY pos)) AS idx
    FROM (SELECT e.job_id AS job_id, e.pos AS pos, e.body AS body, (SELECT c.idx FROM v3_committed c
            WHERE c.job_id = e.job_id AND c.occurrence = e.occurrence AND length(c.body) = length(e.body)
            AND c.body = e.body) AS matched
        FROM (SELECT r.job_id AS job_id, j.key AS pos, j.value AS body,
                row_number() OVER (PARTITION BY r.job_id, j.value ORDER BY j.key) AS occurrence
            FROM results r JOIN v3_moved m ON m.job_id = r.job_id,
                json_each(r.conversation_json, '$.transcript') j) e)""",
    "CREATE INDEX temp.v3_messages_by_job ON v3_messages (job_id, pos)",
    """INSERT INTO turns (job_id, idx, turn_json, committed_at)
    SELECT m.job_id, m.idx, m.body, coalesce(j.finished_at, j.started_at, j.created_at)
    FROM v3_messages m JOIN jobs j ON j.job_id = m.job_id WHERE m.idx < 0""",
    """CREATE TABLE results_v3 (
        job_id TEXT PRIMARY KEY REFERENCES jobs(job_id),
        state_json TEXT NOT NULL,
        lineup_recipe INTEGER NOT NULL DEFAULT 0 CHECK (lineup_recipe IN (0, 1)),
        turn_order TEXT,
        analysis_json TEXT
    )""",
    """INSERT INTO results_v3 (job_id, state_json, lineup_recipe, turn_order, analysis_json)
    SELECT job_id,
        CASE WHEN shared AND moved THEN json_remove(conversation_json, '$.recipe', '$.transcript')
             WHEN shared THEN json_remove(conversation_json, '$.recipe')
             WHEN moved THEN json_remove(conversation_json, '$.transcript')
             ELSE conversation_json END,
        shared,
        CASE WHEN moved THEN (SELECT json_group_array(idx) FROM
            (SELECT idx FROM v3_messages m WHERE m.job_id = x.job_id ORDER BY m.pos)) END,
        analysis_json
    FROM (SELECT r.job_id AS job_id, r.conversation_json AS conversation_json,
            r.analysis_json AS analysis_json,
            coalesce(json_type(r.conversation_json, '$.recipe') IN ('object', 'array')
                AND json_extract(r.conversation_json, '$.recipe') = json(l.describe_json), 0) AS shared,
            r.job_id IN (SELECT job_id FROM v3_moved) AS moved
        FROM results r LEFT JOIN jobs j ON j.job_id = r.job_id LEFT JOIN lineups l ON l.name = j.lineup) x""",
    "DROP TABLE results",
    "ALTER TABLE results_v3 RENAME TO results",
    "DROP TABLE temp.v3_moved",
    "DROP TABLE temp.v3_messages",
    "DROP TABLE temp.v3_committed",
)

#: How a ledger of an older schema version is brought up to date, one step per version: ``MIGRATIONS[v]``
#: takes version ``v`` to ``v + 1``. Applied by the writer at open, in one transaction with the new
#: ``user_version``; readers open older ledgers as they are (they ask which version they read).
#: Version 2 adds what a rerun compares: each job's input fingerprint and each provider batch row's request
#: hash (NULL on rows written by version 1, which recorded neither). Version 3 stops storing a result's
#: transcript and recipe again per job (see :data:`SCHEMA`). Version 4 keeps the results later ones replaced
#: (``superseded_results``), so that what they recorded (an analyzer's paid samples) stays counted. Version 5
#: moves turns' token records out of their JSON into ``turn_tokens`` (calls :data:`SPLIT_FUNCTION`); version 6
#: lets its rows refer to the ids of their job's earlier rows; version 7 adds ``token_stream`` and
#: ``turns.stored_tokens``.
MIGRATIONS: Final[dict[int, tuple[str, ...]]] = {
    1: (
        "ALTER TABLE jobs ADD COLUMN input_fp TEXT",
        "ALTER TABLE batch_requests ADD COLUMN request_hash TEXT",
    ),
    2: _V2_TO_V3,
    3: (_SUPERSEDED,),
    4: _V4_TO_V5,
    5: _V5_TO_V6,
    6: _V6_TO_V7,
}

#: ``PRAGMA application_id`` ("ILNS"): tells an interlens ledger from any other SQLite file.
APPLICATION_ID: Final = 0x494C4E53

_SQLITE_MAGIC: Final = b"SQLite format 3\x00"

_TABLES: Final = frozenset(
    {"runs", "lineups", "run_lineups", "jobs", "turns", "results", "batches", "batch_requests"}
)
#: The tables a ledger has from a version on (older ones lack them until the writer upgrades the file).
_TABLES_SINCE: Final = {
    4: frozenset({"superseded_results"}),
    5: frozenset({"turn_tokens"}),
    7: frozenset({"token_stream"}),
}

# Text columns holding JSON are named *_json. Times are UNIX seconds (REAL). Job order is jobs.seq, the
# rowid, i.e. the order add_jobs inserted them — not the lexical order of the ids. turns and results are
# rowid tables on purpose: their rows are KBs of JSON, and WITHOUT ROWID b-trees spill rows over ~1/20 of a
# page into an overflow page each (measured: ~3x the file size).
SCHEMA: Final = f"""
CREATE TABLE runs (
    run_id      INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at  REAL NOT NULL,
    ended_at    REAL,
    status      TEXT NOT NULL,
    pid         INTEGER NOT NULL,
    host        TEXT NOT NULL,
    versions_json TEXT NOT NULL
);
-- describe_json: the lineup's recipe as the caller described it at its first run (diffed when a rerun's
-- fingerprint differs); also the recipe of every result that has the same one (results.lineup_recipe).
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
-- Covers the resume scan (done ids) and per-state listings without touching the table.
CREATE INDEX jobs_by_state ON jobs(state, job_id);
-- Every message of a job, each stored once. idx >= 0: a turn the job committed as it ran (record_turn),
-- replayed when the job resumes. idx < 0: a message of a stored result that no turn row held (a seeded
-- context, messages the conversation had before the run, messages added after its last turn), written with
-- the result and never replayed. stored_tokens = 1: the message's token record is a turn_tokens row (a
-- local turn's JSON then holds nothing of it: readers put its marker back; schema 7).
CREATE TABLE turns (
    job_id      TEXT NOT NULL REFERENCES jobs(job_id),
    idx         INTEGER NOT NULL,
    turn_json   TEXT NOT NULL,
    committed_at REAL NOT NULL,
    stored_tokens INTEGER,
    PRIMARY KEY (job_id, idx)
);
-- A job's result: its conversation is state_json plus what is stored once elsewhere. lineup_recipe = 1: its
-- "recipe" is its lineup's (lineups.describe_json, text-identical), else any recipe stays in state_json.
-- turn_order: its "transcript", as the JSON list of the turns idx of each message in order; NULL when the
-- conversation had no transcript list (then state_json holds whatever it had).
CREATE TABLE results (
    job_id      TEXT PRIMARY KEY REFERENCES jobs(job_id),
    state_json  TEXT NOT NULL,
    lineup_recipe INTEGER NOT NULL DEFAULT 0 CHECK (lineup_recipe IN (0, 1)),
    turn_order  TEXT,
    analysis_json TEXT
);
-- A result a later one replaced for the same job (a failed analyzer's kept conversation, then the rerun's
-- result), in the order they were replaced: its state_json and analysis_json as they were stored, never its
-- transcript (the turns rows stay the job's own and are not copied). Kept because a result records what was
-- computed and paid for (interlens: the metadata of an analyzer's API samples), which a total over every
-- result must still count (LedgerReader.result_values); whatever reads "the" result reads results only.
{_SUPERSEDED};
-- A turns row's token record (store/_token_rows.py): written with its turns row, in the same transaction;
-- the row's BLOBs in token_stream (store/_token_stream.py) where its facts_json says "stream". Read only
-- by what asks for tokens.
{_TURN_TOKENS};
{TOKEN_STREAM};
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
PRAGMA application_id = {APPLICATION_ID};
PRAGMA user_version = {SCHEMA_VERSION};
"""


def ro_uri(path: Path) -> str:
    """A read-only SQLite URI for ``path`` (percent-escaping what URIs reserve)."""
    from urllib.parse import quote

    return f"file:{quote(str(path.resolve()))}?mode=ro"


def migration_script(version: int) -> str:
    """The SQL that takes a ledger of schema ``version`` to :data:`SCHEMA_VERSION`, in one transaction."""
    steps = [stmt for v in range(version, SCHEMA_VERSION) for stmt in MIGRATIONS[v]]
    return (
        "BEGIN IMMEDIATE;"
        + "".join(f"{stmt};" for stmt in steps)
        + (f"PRAGMA user_version = {SCHEMA_VERSION};COMMIT;")
    )


def check_existing(path: Path, *, deep: bool) -> int:
    """Validate an existing ledger file without writing to it; return its schema version, 0 when new/empty.

    Raises :class:`LedgerCorruptError` for a file that is not SQLite, is damaged, or is some other
    application's database, and :class:`LedgerSchemaError` for a ledger written by a newer schema.
    ``deep`` adds ``PRAGMA quick_check`` (reads every page): the writer does it once per run, so a damaged
    file is refused at open rather than half-way through a run; readers skip it to open fast.
    """
    if not path.exists() or path.stat().st_size == 0:
        return 0
    fix = (
        f"It was left untouched. To start a new ledger in {path.parent}, move the file away yourself, or "
        f"rerun with resume=False (rollout()/run(); Ledger.open(..., fresh=True) for the ledger on its own), "
        f"which moves it aside to ledger.<UTC timestamp>.sqlite instead of deleting it; or use another "
        f"out_dir."
    )
    with path.open("rb") as fh:
        header = fh.read(len(_SQLITE_MAGIC))
    if header != _SQLITE_MAGIC:
        raise LedgerCorruptError(f"{path} is not an SQLite database (its header is {header[:16]!r}). {fix}")
    try:
        conn = sqlite3.connect(ro_uri(path), uri=True)
    except sqlite3.Error as exc:
        raise LedgerCorruptError(f"{path} cannot be opened as SQLite: {exc}. {fix}") from exc
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app_id == 0 and version == 0 and not tables:
            return 0  # an empty SQLite file: nothing to protect, initialise it
        if app_id != APPLICATION_ID:
            raise LedgerCorruptError(
                f"{path} is an SQLite database but not an interlens ledger (application_id {app_id:#x}, "
                f"tables {sorted(tables)[:8]}). {fix}"
            )
        if version > SCHEMA_VERSION:
            raise LedgerSchemaError(
                f"{path} was written by a newer interlens (ledger schema version {version}; this version "
                f"understands up to {SCHEMA_VERSION}). Upgrade interlens to resume it, or start over: use "
                f"another out_dir, or rerun with resume=False (rollout()/run(); Ledger.open(..., fresh=True) "
                f"for the ledger on its own), which moves it aside. It was left untouched."
            )
        required = _TABLES.union(*(t for since, t in _TABLES_SINCE.items() if version >= since))
        missing = required - tables
        if version < 1 or missing:
            raise LedgerCorruptError(
                f"{path} is an incomplete interlens ledger (schema version {version}, missing tables "
                f"{sorted(missing)}). {fix}"
            )
        if deep:
            problems = [r[0] for r in conn.execute("PRAGMA quick_check(20)")]
            if problems != ["ok"]:
                raise LedgerCorruptError(f"{path} is damaged: {'; '.join(problems)}. {fix}")
    except sqlite3.DatabaseError as exc:
        raise LedgerCorruptError(f"{path} is not a readable SQLite ledger: {exc}. {fix}") from exc
    finally:
        conn.close()
    return int(version)
