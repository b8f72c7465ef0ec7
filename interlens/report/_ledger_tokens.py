"""Token records read from the ledger only when asked for, job by job (schema 5-6: issue 40).

A ledger keeps each turn's token record in its own table (``turn_tokens``) and only a marker in the turn's
JSON, so whatever reads results — ``status``, ``show``, reports, a plain export, a ``RunResult``'s
transcript — never reads the records. What asks for tokens reads them here: the exporters
(:func:`with_records`: a job's records put back in its conversation before its token rows are made) and a
message read from the ledger (:func:`attach`: its :attr:`~interlens.Message.tokens` reads its job's
records on first use, once for the whole transcript, since a speaker's later prompts are stored as a
difference from its earlier turns, and in schema 6 partly as references to the job's other turns' ids). A
ledger of an older schema, or a run without an ``out_dir``, keeps its records in the JSON; nothing is read
then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from interlens.store import LedgerReader, restore_tokens

from .._core import TOKENS_KEY, TOKENS_TABLE, Message, expand_turns

__all__ = ["attach", "has_markers", "with_records"]


def _marked(message: Mapping[str, Any]) -> bool:
    data = (message.get("metadata") or {}).get(TOKENS_KEY)
    return isinstance(data, Mapping) and data.get("stored") == TOKENS_TABLE


def has_markers(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(_marked(m) for m in messages)


def with_records(
    reader: LedgerReader, job_id: str, conversation: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """``conversation`` (a job's result as ``reader`` read it) with its token records in its transcript."""
    transcript = (conversation or {}).get("transcript")
    if conversation is None or not isinstance(transcript, list) or not has_markers(transcript):
        return conversation
    records = reader.result_tokens(job_id)
    if records is None:
        return conversation
    return {**conversation, "transcript": restore_tokens(transcript, records)}


class _JobRecords:
    """One job's records, read from the ledger on the first message's ask, for every message at once."""

    def __init__(self, out_dir: Path, job_id: str, messages: Sequence[Mapping[str, Any]]) -> None:
        self._out_dir, self._job_id, self._messages = out_dir, job_id, list(messages)
        self._records: list[Any] | None = None

    def record(self, position: int) -> Mapping[str, Any] | None:
        if self._records is None:
            with LedgerReader(self._out_dir) as reader:
                conversation = with_records(reader, self._job_id, {"transcript": self._messages})
            whole = expand_turns((conversation or {}).get("transcript") or [])
            self._records = [(m.get("metadata") or {}).get(TOKENS_KEY) for m in whole]
        found = self._records[position]
        return None if found is None or _marked({"metadata": {TOKENS_KEY: found}}) else found


def attach(
    messages: Sequence[Message], state: Sequence[Mapping[str, Any]], *, out_dir: Path, job_id: str
) -> None:
    """Let each of ``messages`` (a job's transcript as read from its ledger in ``out_dir``; ``state``: the
    same messages' JSON as stored) whose record is in the ledger's table read it when asked."""
    if not has_markers(state):
        return
    records = _JobRecords(out_dir, job_id, state)
    for position, message in enumerate(messages):
        if _marked(message.to_json()):
            message.token_source = lambda p=position: records.record(p)
