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

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["MIN_RUN", "find_runs", "inline", "resolve"]

#: The fewest ids a reference replaces: ``[lit,src,off,n],`` is ~12-16 bytes of JSON, 6-8 two-byte ids.
MIN_RUN: Final = 12
_GRAM: Final = 4  # ids per lookup key: runs start where 4 ids in a row match


def _ids(data: bytes, width: int) -> array[int]:
    values = array("H" if width == 2 else "I")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _bytes(values: array[int]) -> bytes:
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def find_runs(
    prompt: bytes, width: int, sources: Mapping[int, bytes]
) -> tuple[list[list[int]], bytes] | None:
    """``prompt`` (new prompt ids, ``width`` bytes each) as ``(refs, literal bytes)`` against ``sources``
    (turn idx → that turn's generated ids, the same width), or None when no run of :data:`MIN_RUN` ids or
    more is found (the row then stores the ids as they are)."""
    if len(prompt) < MIN_RUN * width or not sources:
        return None
    wanted = _ids(prompt, width)
    index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    decoded: dict[int, array[int]] = {}
    for src, data in sources.items():
        ids = decoded[src] = _ids(data, width)
        for off in range(len(ids) - _GRAM + 1):
            index.setdefault(tuple(ids[off : off + _GRAM]), []).append((src, off))
    refs: list[list[int]] = []
    literal = array(wanted.typecode)
    pos = lit = 0
    while pos < len(wanted):
        best = (0, 0, 0)  # length, src, off
        for src, off in index.get(tuple(wanted[pos : pos + _GRAM]), ()):
            ids = decoded[src]
            n = _GRAM
            while pos + n < len(wanted) and off + n < len(ids) and wanted[pos + n] == ids[off + n]:
                n += 1
            if n > best[0]:
                best = (n, src, off)
        if best[0] >= MIN_RUN:
            refs.append([lit, best[1], best[2], best[0]])
            pos, lit = pos + best[0], 0
        else:
            literal.append(wanted[pos])
            pos, lit = pos + 1, lit + 1
    return (refs, _bytes(literal)) if refs else None


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
