"""The rows given to ``.data()``: how a rollout reads them, and the guard on rows that can be read only once.

Apart from ``Conversation`` because the recipe only holds the rows; reading them (a fresh read per rollout,
at most ``n``, a callable called afresh, a one-shot iterator read once) is the rollout's business, and the
rules are the same whoever asks.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from ._exceptions import ConfigurationError, InterlensError

__all__ = ["OnceRows", "RowReader", "row_reader", "warn_no_rows"]


class OnceRows:
    """Rows from an iterator given to ``.data()`` (a generator, an open file): one rollout can read them.

    The recipe holds this in place of the iterator, and every recipe given the same iterator shares it
    (copies included), so a second rollout is refused with a clear error instead of silently running on
    whatever rows the first one left — usually none.
    """

    __slots__ = ("__weakref__", "read", "rows")

    #: id(iterator) → its wrapper, while a recipe holds it (the wrapper holds the iterator: the id stays its).
    _wrappers: ClassVar[weakref.WeakValueDictionary[int, OnceRows]] = weakref.WeakValueDictionary()

    def __init__(self, rows: Iterator[Any]) -> None:
        self.rows = rows
        self.read = False

    @classmethod
    def of(cls, rows: Iterator[Any]) -> OnceRows:
        wrapper = cls._wrappers.get(id(rows))
        if wrapper is None or wrapper.rows is not rows:
            wrapper = cls._wrappers[id(rows)] = cls(rows)
        return wrapper

    def __iter__(self) -> Iterator[Any]:
        if self.read:
            raise self.consumed_error()
        self.read = True
        return self.rows

    @staticmethod
    def consumed_error(lineup: str | None = None) -> InterlensError:
        which = f"lineup {lineup!r}: " if lineup else ""
        return ConfigurationError(
            f"{which}the rows given to .data() are an iterator (a generator, say), which can be read only "
            "once, and an earlier rollout of this recipe (or another lineup of this run) already read it: "
            "this rollout would run on whatever rows are left, maybe none. Pass rows that can be read again: "
            "a list, a datasets.Dataset or IterableDataset, or a zero-argument callable that makes the "
            "iterator, e.g. .data(lambda: make_rows())"
        )


@dataclass(frozen=True)
class RowReader:
    """How to read at most ``n`` rows of a lineup's data."""

    read: Callable[[], Iterator[Any]]  # starts a fresh read
    again: bool  # whether a second read is possible (not for a one-shot iterator)
    total: int | None  # the number of rows, when known


def row_reader(data: Any, n: int | None, lineup: str) -> RowReader:
    """The reader of at most ``n`` rows of ``data`` (as the recipe holds it); a one-shot iterator already
    read is refused here, before anything runs."""
    if isinstance(data, OnceRows):
        if data.read:
            raise OnceRows.consumed_error(lineup)
        return RowReader(lambda: itertools.islice(iter(data), n), False, n)
    if callable(data) and not isinstance(data, Iterable):
        return RowReader(lambda: itertools.islice(iter(_call_rows(data, lineup)), n), True, n)
    if _is_dataframe(data):  # iterating a DataFrame gives its column names: read its rows as records
        frame = data
        data = _Records(lambda: frame.to_dict("records"), len(frame))
    try:
        total: int | None = len(data)
    except TypeError:
        total = None
    if n is not None and total is not None and n > total:
        # n caps a data rollout (one job per row); a larger n is most likely a mistaken expectation
        warnings.warn(
            f"lineup {lineup!r}: n={n} but the data has {total} row(s), so {total} job(s) run (one per row); "
            "pass n=None (every row) or n <= the number of rows",
            UserWarning,
            stacklevel=2,
        )
    if n is not None:
        total = n if total is None else min(n, total)
    if total == 0:
        warn_no_rows(lineup)
    return RowReader(lambda: itertools.islice(iter(data), n), True, total)


def warn_no_rows(lineup: str) -> None:
    """Empty data runs no job: said, not refused (a filtered dataset can be empty in a sweep)."""
    warnings.warn(
        f"lineup {lineup!r}: the data given to .data() has no rows, so no job runs for it",
        UserWarning,
        stacklevel=3,
    )


def _is_dataframe(data: Any) -> bool:
    return type(data).__module__.startswith("pandas") and callable(getattr(data, "to_dict", None))


class _Records:
    """A DataFrame's rows as ``{column: value}`` records, made on each read (``to_dict("records")``)."""

    def __init__(self, make: Callable[[], list[dict[str, Any]]], length: int) -> None:
        self._make, self._length = make, length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._make())

    def __len__(self) -> int:
        return self._length


def _call_rows(make: Callable[[], Any], lineup: str) -> Iterable[Any]:
    rows = make()
    if rows is None or isinstance(rows, str | bytes) or not isinstance(rows, Iterable):
        raise ConfigurationError(
            f"lineup {lineup!r}: the callable given to .data() must return an iterable of rows (a list, a "
            f"generator, a Dataset), got {type(rows).__name__}"
        )
    return rows
