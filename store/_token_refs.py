"""A prompt's new ids as references to ids its job generated earlier (schema 6: issue 40).

In a conversation a speaker's later prompt holds, after what its own previous turn kept (``keep``), the
other speakers' answers since: ids some earlier turn of the same job generated and that its ``turn_tokens``
row already holds. Stored literally they were about a fifth of a 256-token debate's records. So the writer
stores a prompt's new ids as runs: ``refs`` (in the row's ``facts_json``) lists ``[lit, src, off, n]``: take
the next ``lit`` ids from the row's ``prompt_ids`` BLOB, then ``n`` ids of turn ``src``'s generated ids
(``ids`` of the same job's row ``src``) from ``off``; what follows the last run is literal too. Only runs
worth more than their few bytes of JSON become references (:data:`MIN_RUN` ids); template tokens and
anything no earlier turn generated (a retokenised boundary, data) stay literal.

A reference is resolved by the reader from the job's rows (:func:`resolve`); the row's digest (over the
record as written, references resolved) tells a reference that no longer reads as written (its source
row damaged or re-recorded) from a whole one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["MIN_RUN", "Index", "find_runs", "index_ids", "inline", "resolve"]

#: The fewest ids a reference replaces: ``[lit,src,off,n],`` is ~12-16 bytes of JSON, 6-8 two-byte ids.
MIN_RUN: Final = 12
_GRAM: Final = 4  # ids per lookup key: runs start where 4 ids in a row match
_PLACES: Final = 16  # the places kept per key: enough for repeated phrases, bounded for repeated tokens


Index = dict[bytes, list[tuple[int, int]]]  # _GRAM ids' bytes → where they start: (turn idx, id offset)


def index_ids(index: Index, src: int, ids: bytes, width: int) -> None:
    """Add turn ``src``'s generated ``ids`` to ``index`` (a job's, kept by the writer between its turns)."""
    key = _GRAM * width
    for at in range(0, len(ids) - key + 1, width):
        places = index.setdefault(ids[at : at + key], [])
        if len(places) < _PLACES:
            places.append((src, at // width))


def find_runs(
    prompt: bytes, width: int, sources: Mapping[int, bytes], index: Index | None = None
) -> tuple[list[list[int]], bytes] | None:
    """``prompt`` (new prompt ids, ``width`` bytes each) as ``(refs, literal bytes)`` against ``sources``
    (turn idx → that turn's generated ids, the same width; ``index``: theirs, built here when not given),
    or None when no run of :data:`MIN_RUN` ids or more is found (the row then stores the ids as they are)."""
    if len(prompt) < MIN_RUN * width or not sources:
        return None
    if index is None:
        index = {}
        for src, data in sources.items():
            index_ids(index, src, data, width)
    key = _GRAM * width
    refs: list[list[int]] = []
    literal = bytearray()
    pos = lit = 0  # in bytes; literal ids since the last run
    while pos < len(prompt):
        best = (0, 0, 0)  # length in ids, src, id offset
        for src, off in index.get(prompt[pos : pos + key], ()):
            source = sources.get(src)
            if source is None:  # a turn the index holds but the row may not refer to (not earlier)
                continue
            n, at = _GRAM, off * width + key
            while pos + n * width < len(prompt) and at < len(source):
                if prompt[pos + n * width : pos + (n + 1) * width] != source[at : at + width]:
                    break
                n, at = n + 1, at + width
            if n > best[0]:
                best = (n, src, off)
        if best[0] >= MIN_RUN:
            refs.append([lit, best[1], best[2], best[0]])
            pos, lit = pos + best[0] * width, 0
        else:
            literal += prompt[pos : pos + width]
            pos, lit = pos + width, lit + 1
    return (refs, bytes(literal)) if refs else None


def resolve(refs: Sequence[Sequence[int]], literal: bytes, width: int, sources: Mapping[int, bytes]) -> bytes:
    """The new prompt ids ``refs`` and ``literal`` stand for; KeyError naming a missing source turn,
    ValueError for a run that is not there (out of its source's range, or past the literal ids)."""
    out = bytearray()
    at = 0
    for lit, src, off, n in refs:
        if lit < 0 or n < 1 or off < 0 or at + lit * width > len(literal):
            raise ValueError(f"a reference [{lit}, {src}, {off}, {n}] that is not well formed")
        out += literal[at : at + lit * width]
        at += lit * width
        if src not in sources:
            raise KeyError(f"turn {src}, whose generated ids it refers to, has no token record")
        source = sources[src]
        if (off + n) * width > len(source):
            raise ValueError(
                f"its reference to ids {off}-{off + n} of turn {src}, which has {len(source) // width}"
            )
        out += source[off * width : (off + n) * width]
    out += literal[at:]
    return bytes(out)


def inline(
    refs: Sequence[Sequence[int]], literal: bytes, width: int, src: int, source: bytes
) -> tuple[list[list[int]], bytes]:
    """``refs`` and ``literal`` with every run of turn ``src`` (its ids: ``source``) made literal again: what
    a later row keeps when turn ``src`` is recorded anew (its job ran again from there)."""
    kept: list[list[int]] = []
    out = bytearray()
    at = pending = 0  # literal bytes consumed; literal ids not yet counted into a kept run
    for lit, run_src, off, n in refs:
        out += literal[at : at + lit * width]
        at += lit * width
        if run_src == src:
            out += source[off * width : (off + n) * width]
            pending += lit + n
        else:
            kept.append([pending + lit, run_src, off, n])
            pending = 0
    out += literal[at:]
    return kept, bytes(out)
