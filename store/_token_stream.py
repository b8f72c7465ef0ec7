"""Token records' bytes in one append-only stream of page-sized segments (schema 7: issue 40).

A 256-token record is ~2.7 KB of arrays (2-byte ids, two float32 log-probabilities per id). As a row of its
own (schemas 5-6) it filled a 4 KiB page alone: SQLite keeps a row under ~4 KB whole on one page, and two do
not fit, so a third of every ``turn_tokens`` page was empty and the file grew by ~3.4x the turns' text where
the records were ~2.3x (``benchmarks/RESULTS.md``, 2026-12-05). A larger page size packs more rows per page
but only ever loses less than a row per page (so it depends on the record's size), and it changes every
table and every commit's write-ahead-log frames; rows cut into sub-page pieces lose a piece per page and pay
a key per piece. So the writer appends each record's bytes to a byte stream instead (``token_stream``), cut
into segments of :data:`SEGMENT` bytes, each the largest row that fills a 4 KiB page's leaf without
spilling into an overflow page: every segment but the last is a page filled to within a few bytes, whatever
the records' sizes, and its writes stay appends to the table's last page, as before.

A ``turn_tokens`` row then keeps its small facts and where its bytes are: ``"stream": [at, ids, model,
sampling, prompt]`` in its ``facts_json`` (the offset of its first byte, then each BLOB's length, -1 for
none; its BLOB columns are NULL, ``model_logprobs`` empty). Rows stored in their own columns (written by
schemas 5-6, a result's own messages, rows a re-recorded turn detached) read as they are. The stream is
append-only: a replaced record's bytes stay where they were (a turn is recorded again only when its job
runs again from it). The row's digest covers the record's bytes, so a damaged or missing segment reads as a
damaged record, named by job and turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import aiosqlite

__all__ = [
    "SEGMENT",
    "STREAM_KEY",
    "STREAM_TABLE",
    "TOKEN_STREAM",
    "append",
    "filled",
    "segments_of",
    "streamed",
]

STREAM_TABLE: Final = "token_stream"
#: Bytes per segment: a 4 KiB page's largest local payload is 4,061 bytes (page - 35), of which a BLOB's
#: record takes 3 bytes of header: 4,058. Two fewer keep a margin; a larger page holds several.
SEGMENT: Final = 4056
STREAM_KEY: Final = "stream"  # in a streamed row's facts_json

TOKEN_STREAM: Final = f"""CREATE TABLE {STREAM_TABLE} (
    k           INTEGER PRIMARY KEY,
    data        BLOB NOT NULL
)"""


def _lengths(values: Sequence[Any]) -> list[int]:
    return [-1 if part is None else len(part) for part in values[1:]]


async def append(conn: aiosqlite.Connection, rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """``rows`` (stored values, ``TokenRow.values()`` order) as the writer stores them: their BLOBs appended
    to the stream, in order, inside the caller's transaction, and each row's values pointing there."""
    if not rows:
        return []
    tail = list(await conn.execute_fetchall(f"SELECT k, data FROM {STREAM_TABLE} ORDER BY k DESC LIMIT 1"))
    key, buffer = (tail[0][0], bytearray(tail[0][1])) if tail else (0, bytearray())
    if len(buffer) >= SEGMENT:  # the last segment is full: the next starts a new one
        key, buffer = key + 1, bytearray()
    base, out = key * SEGMENT, []  # buffer[i] is the stream's byte base + i
    for values in rows:
        facts = json.loads(values[0])
        facts[STREAM_KEY] = [base + len(buffer), *_lengths(values)]
        for part in values[1:]:
            buffer += part or b""
        out.append((json.dumps(facts, ensure_ascii=False, separators=(",", ":")), None, b"", None, None))
    pieces = [(key + i, bytes(buffer[o : o + SEGMENT])) for i, o in enumerate(range(0, len(buffer), SEGMENT))]
    await conn.executemany(f"INSERT OR REPLACE INTO {STREAM_TABLE} (k, data) VALUES (?, ?)", pieces)
    return out


def _pointer(facts_json: Any) -> list[int] | None:
    if not isinstance(facts_json, str) or f'"{STREAM_KEY}"' not in facts_json:
        return None
    try:
        found = json.loads(facts_json).get(STREAM_KEY)
    except (ValueError, AttributeError):
        return None  # a damaged row: its readers name it
    return found if isinstance(found, list) and len(found) == 5 else None


def streamed(values: Sequence[Any]) -> bool:
    """Whether a stored row's bytes are in the stream (a row of values, ``TokenRow.values()`` order)."""
    return _pointer(values[0]) is not None


def segments_of(rows: Iterable[Sequence[Any]]) -> list[int]:
    """The segment keys the streamed ones of ``rows`` (stored values) need, sorted."""
    keys: set[int] = set()
    for values in rows:
        pointer = _pointer(values[0])
        if pointer is None or not all(isinstance(n, int) for n in pointer):
            continue
        at, size = pointer[0], sum(max(n, 0) for n in pointer[1:])
        if at >= 0 and size > 0:
            keys.update(range(at // SEGMENT, (at + size - 1) // SEGMENT + 1))
    return sorted(keys)


def filled(values: Sequence[Any], segments: Mapping[int, bytes]) -> tuple[Any, ...]:
    """A stored row's values with its BLOBs read from ``segments`` (key → data) where it is streamed, its
    facts without the pointer; as it is otherwise. What is missing reads short: the digest then differs."""
    pointer = _pointer(values[0])
    if pointer is None:
        return tuple(values)
    facts = json.loads(values[0])
    del facts[STREAM_KEY]
    at, parts = pointer[0], list[bytes | None]()
    for size in pointer[1:]:
        if not isinstance(size, int) or size < 0:
            parts.append(None)
            continue
        data = bytearray()
        for key in range(at // SEGMENT, (at + size - 1) // SEGMENT + 1) if size else ():
            segment = segments.get(key, b"")
            lo, hi = max(at - key * SEGMENT, 0), min(at + size - key * SEGMENT, SEGMENT)
            data += segment[lo:hi]
        parts.append(bytes(data))
        at += size
    return (json.dumps(facts, ensure_ascii=False, separators=(",", ":")), *parts)
