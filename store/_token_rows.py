"""Turns' token records in their own table (``turn_tokens``, schema 5-7), read only by what asks for tokens.

A generated turn's token record (interlens' ``TokenRecord``: ids, two float32 log-probabilities per id and
the prompt ids, or a hosted turn's token texts and its provider's log-probabilities) is several times the
turn's text. Kept in the turn's JSON (base64 in ``metadata["tokens"]``, as schemas 1-4 did) it cost every
reader of the turn — ``status``, ``show``, reports, the resume scan, a plain export — its decoding and a
third more bytes than the binary. So the writer takes it out where the turn is written (:func:`split`, in
the same transaction as its turns row: no turn without its record, no record without its turn) into a
``turn_tokens`` row (its arrays' bytes in the ``token_stream``, schema 7: ``_token_stream``) and leaves
what says it is there:

- a local turn (schema 7): nothing in its JSON; its turns row's ``stored_tokens`` column is 1, and the
  readers put the marker ``{"stored": "turn_tokens"}`` back into the message they return (:func:`put_marker`)
  without parsing it, unless asked not to (a plain export, which has no use for it:
  ``LedgerReader.iter_results(token_markers=False)``). Schemas 5-6 kept it in the JSON, which every reader
  of turns parses: a plain export paid ~5 % for it (``benchmarks/bench_token_reads.py``);
- a hosted turn: the marker ``{"stored": "turn_tokens", "n", "reported_by"}`` in its JSON (what ``show
  --metadata`` prints of it without reading the table), and ``stored_tokens`` 1 too.

The row's ``digest`` (32 bits of a hash of the record's bytes, references resolved) is in its
``facts_json`` (schema 6): it lets a reader tell a damaged row (truncated, wrong length, overwritten, a
reference or a stream segment that no longer reads) from a whole one, and keeps two turns that differ only
in their records apart where a result's messages are matched to committed turns (``_results``: by text and
digest).

The prompt ids stay as the turn's JSON stored them: a speaker's later prompt as a difference from its
previous recorded turn (``keep`` leading ids, then its own); those new ids go to the ``prompt_ids`` BLOB,
where runs of them that an earlier turn of the job generated (the other speakers' answers) are stored as
references to that turn's row (schema 6, :func:`stored_values`, ``_token_refs``; the writer remembers each
running job's generated ids in :class:`GeneratedIds`). A reference only points back, to a turn of a lower
index: dropping a job's tail of turns never breaks one, and a turn recorded anew first makes later rows' runs
of it literal (:func:`detach_later`).

:func:`join` is the inverse: the record's JSON exactly as it was written (the same base64 of the same
bytes), so everything above the store (``expand_turns``, ``TokenRecord.from_json``) reads it unchanged. The
store knows the record only by its JSON form (it imports nothing of interlens); a record it does not know
(another format, damaged base64) stays in the JSON as it was.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeGuard

from ._token_refs import Index, find_runs, index_ids, inline, resolve
from ._token_stream import STREAM_TABLE, filled, segments_of

if TYPE_CHECKING:
    import aiosqlite

__all__ = [
    "MARKER_KEY",
    "TOKENS_KEY",
    "TOKENS_TABLE",
    "GeneratedIds",
    "TokenRow",
    "TokenRowError",
    "detach_later",
    "is_marker",
    "join",
    "local_marker",
    "marked",
    "put_marker",
    "read_rows",
    "resolved",
    "restore",
    "split",
    "split_text",
    "stored_values",
    "unmarked_digest",
    "unmarked_local",
]

TOKENS_KEY: Final = "tokens"  # the message metadata key a record rides under (interlens' TOKENS_KEY)
TOKENS_TABLE: Final = "turn_tokens"
MARKER_KEY: Final = "stored"  # a marker's key, its value the table's name
_CERTAIN, _MODEL, _ARRAY = "certain", "model", "array"
_REFS: Final = "refs"  # schema 6: a stored row's references to its job's generated ids (_token_refs)
_DIGEST: Final = "digest"  # schema 6: in a stored row's facts (schema 5 kept it in the turn's marker)


class TokenRowError(ValueError):
    """A ``turn_tokens`` row that does not decode to the record its marker names."""


@dataclass(frozen=True, slots=True)
class TokenRow:
    """One ``turn_tokens`` row's values (job and idx are the caller's)."""

    facts_json: str  # format, id_bytes, how sampling is stored, the prompt's keep; a hosted turn's texts
    ids: bytes | None
    model_logprobs: bytes
    sampling_logprobs: bytes | None
    prompt_ids: bytes | None

    def values(self) -> tuple[Any, ...]:
        return (self.facts_json, self.ids, self.model_logprobs, self.sampling_logprobs, self.prompt_ids)

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=4)
        for part in self.values():
            data = part.encode() if isinstance(part, str) else (part or b"")
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _bytes(text: Any) -> bytes:
    if not isinstance(text, str):
        raise TypeError("not base64 text")
    return base64.b64decode(text, validate=True)


def _b64(data: bytes | None) -> str:
    return base64.b64encode(data or b"").decode("ascii")


def _row(record: Mapping[str, Any]) -> TokenRow | None:
    """The row for a record's JSON, or None for one the store does not know (it then stays in the JSON)."""
    try:
        form = record.get("format")
        if form == 2:
            texts = record["texts"]
            if not isinstance(texts, list) or not isinstance(record["reported_by"], str):
                return None
            facts = {"format": 2, "reported_by": record["reported_by"], "texts": texts}
            return TokenRow(_dumps(facts), None, _bytes(record["model_logprobs"]), None, None)
        if form != 1 or record["id_bytes"] not in (2, 4):
            return None
        facts = {"format": 1, "id_bytes": record["id_bytes"]}
        sampling_text = record["sampling_logprobs"]
        sampling = None
        if sampling_text in (_CERTAIN, _MODEL):
            facts["sampling"] = sampling_text
        else:
            facts["sampling"], sampling = _ARRAY, _bytes(sampling_text)
        prompt = record["prompt_ids"]
        if isinstance(prompt, Mapping):  # a difference from its speaker's previous turn
            if not isinstance(prompt.get("keep"), int) or set(prompt) != {"keep", "ids"}:
                return None
            facts["keep"], prompt = prompt["keep"], prompt["ids"]
        extra = set(record) - {
            "format",
            "id_bytes",
            "ids",
            "model_logprobs",
            "sampling_logprobs",
            "prompt_ids",
        }
        if extra:
            return None
        return TokenRow(
            _dumps(facts), _bytes(record["ids"]), _bytes(record["model_logprobs"]), sampling, _bytes(prompt)
        )
    except (KeyError, TypeError, ValueError, binascii.Error):
        return None


def local_marker() -> dict[str, Any]:
    """The marker of a local turn's record, which its JSON does not keep (schema 7): readers put it back."""
    return {MARKER_KEY: TOKENS_TABLE}


def marked(row: TokenRow) -> dict[str, Any] | None:
    """The marker a turn's JSON keeps in place of the record ``row`` holds: a hosted turn's (what show
    --metadata prints of it; of a local one it prints the turn's n_tokens), None for a local turn's (its
    turns row's ``stored_tokens`` says it, schema 7)."""
    facts = json.loads(row.facts_json)
    if facts["format"] == 2:
        return {
            MARKER_KEY: TOKENS_TABLE,
            "n": len(row.model_logprobs) // 4,
            "reported_by": facts["reported_by"],
        }
    return None


def put_marker(turn: Any) -> Any:
    """``turn`` (a message's parsed JSON whose turns row says it has a record) with the local marker put back
    where its JSON has none: what a reader returns, as schemas 5-6 stored it."""
    if isinstance(turn, dict):
        metadata = turn.get("metadata")
        if not isinstance(metadata, dict):
            turn["metadata"] = {TOKENS_KEY: local_marker()}
        elif TOKENS_KEY not in metadata:
            metadata[TOKENS_KEY] = local_marker()
    return turn


def split(turn: Mapping[str, Any]) -> tuple[Mapping[str, Any], TokenRow | None]:
    """``turn`` (a message's JSON) with its record replaced by a marker, and the record's row; ``turn``
    itself and None when it holds no record the store knows."""
    metadata = turn.get("metadata") if isinstance(turn, Mapping) else None
    record = metadata.get(TOKENS_KEY) if isinstance(metadata, Mapping) else None
    if not isinstance(record, Mapping) or record.get(MARKER_KEY) == TOKENS_TABLE:
        return turn, None
    row = _row(record)
    if row is None:
        return turn, None
    assert isinstance(metadata, Mapping)  # it holds the record
    marker = marked(row)
    if marker is None:  # a local turn's: its JSON keeps nothing of it (schema 7)
        return {**turn, "metadata": {k: v for k, v in metadata.items() if k != TOKENS_KEY}}, row
    return {**turn, "metadata": {**metadata, TOKENS_KEY: marker}}, row


def unmarked_digest(text: str) -> str:
    """A version-5 turn's JSON with its marker as version 6 writes it: no digest (the row's facts keep it),
    and a local turn's without its count."""
    turn = json.loads(text)
    marker = turn["metadata"][TOKENS_KEY]
    dropped = (_DIGEST,) if "reported_by" in marker else (_DIGEST, "n")
    turn["metadata"][TOKENS_KEY] = {k: v for k, v in marker.items() if k not in dropped}
    return _dumps(turn)


def unmarked_local(text: str) -> str:
    """A version-6 turn's JSON as version 7 writes it: without its local marker (its row says it)."""
    turn = json.loads(text)
    del turn["metadata"][TOKENS_KEY]
    return _dumps(turn)


def split_text(text: str) -> tuple[str, TokenRow | None]:
    """:func:`split` of a turn's JSON text (the migration's, and what ``split`` would write)."""
    try:
        turn = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text, None  # a damaged record stays as it is, for the readers to name
    out, row = split(turn)
    return (text, None) if row is None else (_dumps(out), row)


def join(
    marker: Mapping[str, Any], values: Sequence[Any], sources: Mapping[int, bytes] | None = None
) -> dict[str, Any]:
    """The record's JSON as it was written, from its marker and its stored row's values (``TokenRow.values()``
    order; ``sources``: the generated ids of its job's rows, idx → ``ids``, which its references name);
    :class:`TokenRowError` when the row is not the one the marker names (damaged, cut short, a reference
    that no longer reads as written)."""
    try:
        row = resolved(values, sources, marker.get(_DIGEST))
        facts = json.loads(row.facts_json)
        n = len(row.model_logprobs) // 4
        if len(row.model_logprobs) % 4 or n != marker.get("n", n):  # schema 6: "n" for a hosted turn only
            raise TokenRowError(f"{len(row.model_logprobs)} bytes of log-probabilities for {marker.get('n')}")
        if facts["format"] == 2:
            return {
                "format": 2,
                "reported_by": facts["reported_by"],
                "texts": facts["texts"],
                "model_logprobs": _b64(row.model_logprobs),
            }
        width = facts["id_bytes"]
        if len(row.ids or b"") != n * width or len(row.prompt_ids or b"") % width:
            raise TokenRowError(f"ids of {len(row.ids or b'')} bytes for {n} tokens of {width} bytes")
        if facts["sampling"] == _ARRAY:
            if len(row.sampling_logprobs or b"") != 4 * n:
                raise TokenRowError(
                    f"{len(row.sampling_logprobs or b'')} bytes of sampling log-probabilities"
                )
            sampling: str = _b64(row.sampling_logprobs)
        else:
            sampling = facts["sampling"]
        prompt: Any = _b64(row.prompt_ids)
        if "keep" in facts:
            prompt = {"keep": facts["keep"], "ids": prompt}
        return {
            "format": 1,
            "ids": _b64(row.ids),
            "id_bytes": width,
            "model_logprobs": _b64(row.model_logprobs),
            "sampling_logprobs": sampling,
            "prompt_ids": prompt,
        }
    except TokenRowError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise TokenRowError(f"it does not decode ({type(exc).__name__}: {exc})") from exc


def stored_values(row: TokenRow, sources: Mapping[int, bytes], index: Index | None = None) -> tuple[Any, ...]:
    """``row``'s values as the table stores them (schema 6): its digest in its facts, and its prompt's new
    ids as references to ``sources`` (idx → generated ids of earlier turns of its job, of its id width;
    ``index``: theirs, see :class:`GeneratedIds`) where runs of them match (``_token_refs``), the rest
    literal."""
    facts = json.loads(row.facts_json)
    facts[_DIGEST] = row.digest()
    values = row.values()
    found = None
    if row.prompt_ids is not None and sources:
        found = find_runs(row.prompt_ids, facts.get("id_bytes", 0), sources, index)
    if found is None:
        return (_dumps(facts), *values[1:])
    refs, literal = found
    return (_dumps({**facts, _REFS: refs}), *values[1:4], literal)


def resolved(
    values: Sequence[Any], sources: Mapping[int, bytes] | None, digest: str | None = None
) -> TokenRow:
    """The record's row from a stored row's values: its references (if any) resolved against ``sources``,
    checked against the digest it was written with (in its facts; ``digest``: a version-5 row's, which its
    turn's marker kept). :class:`TokenRowError` when it does not read as written."""
    try:
        row = TokenRow(*values)
        facts = json.loads(row.facts_json)
        refs, digest = facts.pop(_REFS, None), facts.pop(_DIGEST, digest)
        prompt = row.prompt_ids
        if refs is not None:
            prompt = resolve(refs, row.prompt_ids or b"", facts["id_bytes"], sources or {})
    except KeyError as exc:
        raise TokenRowError(str(exc.args[0])) from exc
    except (TypeError, ValueError) as exc:
        raise TokenRowError(f"it does not decode ({type(exc).__name__}: {exc})") from exc
    row = TokenRow(_dumps(facts), row.ids, row.model_logprobs, row.sampling_logprobs, prompt)
    if row.digest() != digest:
        raise TokenRowError("its bytes are not the ones written (digest differs)")
    return row


class GeneratedIds:
    """The writer's memory of each running job's generated ids (idx → (id width, ids bytes)) and their
    index (``_token_refs.index_ids``, built once per turn), what a later turn's prompt may refer to. Filled as
    turns commit (and as a resumed job replays them), dropped when the job ends: memory bounded by the jobs
    running at once."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[int, tuple[int, bytes]]] = {}
        self._indices: dict[tuple[str, int], Index] = {}  # (job, id width) → its known ids' index
        self._last: dict[str, int] = {}  # per job: the highest turn index committed (or replayed)

    def appends(self, job_id: str, index: int) -> bool:
        """Whether turn ``index`` follows every turn ``job_id`` is known to have: no later row that may
        refer to the turn it replaces (else the writer runs :func:`detach_later` first)."""
        return index > self._last.get(job_id, index)

    def sources(self, job_id: str, index: int, row: TokenRow | None) -> tuple[dict[int, bytes], Index]:
        """The earlier turns (idx < ``index``) of ``job_id`` whose ids ``row`` may refer to, and their index
        (which may list later ones too: ``find_runs`` skips what ``sources`` does not hold)."""
        if row is None or row.ids is None:
            return {}, {}
        width = json.loads(row.facts_json).get("id_bytes", 0)
        known = self._jobs.get(job_id, {})
        found = {idx: ids for idx, (w, ids) in known.items() if idx < index and w == width}
        if (job_id, width) not in self._indices:
            self._indices[job_id, width] = {}
            for idx, (w, ids) in known.items():
                if w == width:
                    index_ids(self._indices[job_id, width], idx, ids, width)
        return found, self._indices[job_id, width]

    def remember(self, job_id: str, index: int, row: TokenRow | None) -> None:
        """Turn ``index`` committed with ``row``: the job's later turns (re-recorded from here on) forget
        what followed it."""
        known = self._jobs.setdefault(job_id, {})
        if any(i >= index for i in known):
            for idx in [i for i in known if i >= index]:
                del known[idx]
            self._drop_indices(job_id)  # rebuilt on the next ask
        self._last[job_id] = max(index, self._last.get(job_id, index))  # later rows stay in the file
        if row is not None and row.ids is not None:
            width = json.loads(row.facts_json)["id_bytes"]
            known[index] = (width, row.ids)
            if (job_id, width) in self._indices:
                index_ids(self._indices[job_id, width], index, row.ids, width)

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._last.pop(job_id, None)
        self._drop_indices(job_id)

    def _drop_indices(self, job_id: str) -> None:
        for width in (2, 4):
            self._indices.pop((job_id, width), None)


async def read_rows(conn: aiosqlite.Connection, rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """Stored rows' values (``TokenRow.values()`` order) with their BLOBs, streamed ones read from the
    stream (schema 7, ``_token_stream``)."""
    keys = segments_of(rows)
    segments: dict[int, bytes] = {}
    for start in range(0, len(keys), 500):
        piece = keys[start : start + 500]
        sql = f"SELECT k, data FROM {STREAM_TABLE} WHERE k IN ({', '.join('?' * len(piece))})"
        segments.update((int(k), bytes(data)) for k, data in await conn.execute_fetchall(sql, piece))
    return [filled(values, segments) for values in rows]


_VALUES: Final = "facts_json, ids, model_logprobs, sampling_logprobs, prompt_ids"


async def detach_later(conn: aiosqlite.Connection, job_id: str, index: int) -> None:
    """Before turn ``index`` of ``job_id`` is recorded anew: every later row of the job that refers to the
    ids it had takes them as literal ids (references point back only, so only later rows can); such a row
    is stored in its own columns from then on (its old bytes stay in the stream)."""
    old = await read_rows(
        conn,
        list(
            await conn.execute_fetchall(
                f"SELECT {_VALUES} FROM {TOKENS_TABLE} WHERE job_id = ? AND idx = ?", (job_id, index)
            )
        ),
    )
    if not old or old[0][1] is None:
        return
    later = await conn.execute_fetchall(
        f"SELECT idx, {_VALUES} FROM {TOKENS_TABLE} WHERE job_id = ? AND idx > ? "
        "AND instr(facts_json, '\"refs\"') AND json_valid(facts_json)",  # a damaged row: left for readers
        (job_id, index),
    )
    whole = await read_rows(conn, [tuple(row[1:]) for row in later])
    for (idx, *_), values in zip(later, whole, strict=True):
        facts = json.loads(values[0])
        try:
            refs, literal = inline(facts[_REFS], values[4] or b"", facts["id_bytes"], index, old[0][1])
        except (KeyError, TypeError, ValueError):
            continue  # a damaged row: left as it is, for its readers to name
        facts = {k: v for k, v in facts.items() if k != _REFS} | ({_REFS: refs} if refs else {})
        await conn.execute(
            f"UPDATE {TOKENS_TABLE} SET facts_json = ?, ids = ?, model_logprobs = ?, sampling_logprobs = ?, "
            "prompt_ids = ? WHERE job_id = ? AND idx = ?",
            (_dumps(facts), values[1], values[2], values[3], literal, job_id, idx),
        )


def is_marker(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """Whether a metadata value is a marker (its record is in ``turn_tokens``)."""
    return isinstance(value, Mapping) and value.get(MARKER_KEY) == TOKENS_TABLE


def restore(
    messages: Iterable[Mapping[str, Any]], records: Iterable[Mapping[str, Any] | None]
) -> list[dict[str, Any]]:
    """``messages`` with each marker replaced by its record's JSON (``records``: one per message, aligned;
    None where the message has none or it was not read)."""
    out: list[dict[str, Any]] = []
    for message, record in zip(messages, records, strict=True):
        metadata = message.get("metadata") or {}
        if record is not None and is_marker(metadata.get(TOKENS_KEY)):
            out.append({**message, "metadata": {**metadata, TOKENS_KEY: dict(record)}})
        else:
            out.append(dict(message))
    return out
