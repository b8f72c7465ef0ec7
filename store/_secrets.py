"""Credentials from the environment: refused in values the ledger stores, redacted in text that is kept.

The values of credential-looking environment variables (``*_API_KEY``, ``*TOKEN*``, ``*SECRET*``, ...) are
what must never leave the environment. Two treatments, one list of secrets:

- **Refuse** (:meth:`SecretGuard.check`): a value the ledger would store as a result (a turn, a conversation,
  an analysis, batch metadata) that contains a key is refused with an error naming the variable, never its
  value. Silently changing a result would change the answer; refusing fails that one job loudly.
- **Redact** (:meth:`SecretGuard.redact`): text that only *describes* a failure (an
  error message, a traceback, a log line) keeps its meaning with the key replaced by ``[redacted:VARNAME]``,
  so a provider error that echoes the key fails its job like any other error instead of aborting the run.
  The scheduler redacts where an exception becomes text (in a worker process too, so a traceback never
  crosses a pipe unredacted), the ledger again before it writes an error, and :class:`RedactSecrets` on the
  project's loggers before a record reaches any handler.

The environment is read when a guard is made (cheap: a scan of ``os.environ``), so a key set after
``import interlens`` is covered too.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Final

from ._errors import StoreError

__all__ = ["RedactSecrets", "SecretGuard", "redacting_logger"]

_SECRET_NAME: Final = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD)", re.IGNORECASE)
_MIN_SECRET_LEN: Final = 12  # shorter values ("true", "1", a short username) would flag innocent text


class SecretGuard:
    """The credential-looking environment variables of this moment, to refuse or redact their values."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        found = [
            (name, value.strip())
            for name, value in env.items()
            if _SECRET_NAME.search(name) and len(value.strip()) >= _MIN_SECRET_LEN
        ]
        # Longest first: a key that contains another one is replaced whole, not left half-redacted.
        self._secrets: tuple[tuple[str, str], ...] = tuple(sorted(found, key=lambda s: -len(s[1])))

    def __bool__(self) -> bool:
        return bool(self._secrets)

    @property
    def names(self) -> tuple[str, ...]:
        """The credential-looking variables' names (e.g. to keep them out of a process's environment)."""
        return tuple(name for name, _ in self._secrets)

    def check(self, payload: str, *, what: str) -> None:
        """Raise StoreError naming the variable (never the value) if ``payload`` contains a secret; ``what``
        is redacted too (it names the record, and a job id or lineup name can hold the key itself)."""
        for name, value in self._secrets:
            if value in payload:
                raise StoreError(
                    f"refusing to store {self.redact(what)}: it contains the value of the environment "
                    f"variable {name}, which looks like a credential. The ledger never stores secrets; find "
                    f"where the key leaked into this value (a participant's repr, a prompt, request "
                    f"metadata) and remove it."
                )

    def redact(self, text: str) -> str:
        """``text`` with every secret's value replaced by ``[redacted:VARNAME]``."""
        for name, value in self._secrets:
            if value in text:
                text = text.replace(value, f"[redacted:{name}]")
        return text


class RedactSecrets(logging.Filter):
    """Redacts secrets from a record's message, arguments, traceback and stack before any handler sees it.

    A logger's filters apply only to records logged on that very logger, not to those its children
    propagate, so it is installed on each logger the project logs to (:func:`redacting_logger`). A record
    without a secret is left exactly as it was (its ``msg``/``args``/``exc_info`` intact for handlers that
    use them); one with a secret gets its message pre-formatted and its traceback pre-rendered, redacted.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        guard = SecretGuard()
        if not guard:
            return True
        message = record.getMessage()
        redacted = guard.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and record.exc_info[0] is not None:
            rendered = record.exc_text or logging.Formatter().formatException(record.exc_info)
            text = guard.redact(rendered)
            if text != rendered:
                # The exception object still holds the key: handlers must render the redacted text instead.
                record.exc_text, record.exc_info = text, None
        elif record.exc_text:
            record.exc_text = guard.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = guard.redact(record.stack_info)
        return True


_FILTER: Final = RedactSecrets()


def redacting_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with :class:`RedactSecrets` installed (once)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
