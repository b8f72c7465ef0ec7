"""``interlens.run`` and ``arun``: many lineups (Conversations) in one pool under one ``out_dir``.

Apart from ``_rollout`` because it checks that it was given Conversations, so it imports ``conversation``,
which ``_rollout`` (imported by ``Conversation.rollout``) must not. It imports it when called, never at module
level: the facade's import of ``rollouts._rollout`` runs this package's ``__init__``, which imports this
module, and ``conversation`` there would close the cycle (``tests/test_import_floor.py`` runs that import).
Each lineup expands through ``_rollout.lineup_spec`` and all run together through ``_rollout.execute``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Unpack

from .._core import ConfigurationError, ConfigurationTypeError, OnceRows
from ._options import Options, RunOptions, parse_options
from ._rollout import execute, lineup_spec

if TYPE_CHECKING:
    from interlens.scheduler import LineupSpec

    from ..conversation import Conversation
    from ..report import RunReport

__all__ = ["arun", "run"]


def _lineups(
    conversations: Iterable[Conversation], options: Options
) -> list[tuple[Conversation, LineupSpec]]:
    from ..conversation import Conversation  # when called: see the module's docstring

    convs = list(conversations) if not isinstance(conversations, Conversation) else [conversations]
    if not convs:
        raise ConfigurationError("run() needs at least one Conversation")
    out = []
    for i, conv in enumerate(convs):
        if not isinstance(conv, Conversation):
            raise ConfigurationError(
                f"run() takes Conversation objects, got {type(conv).__name__} at index {i}"
            )
        name = conv.name() or f"conv{i}"
        single = name if conv.data_source is None else None
        spec = lineup_spec(
            conv,
            None,
            seed=options.seed,
            mode=options.run.mode,
            prefix=f"{name}/",
            single_job_id=single,
            lineup=name,
            record_tokens=options.record_tokens,
            limits=options.limits,
            seed_given=options.seed_given,
        )
        out.append((conv, spec))
    # one iterator read by two lineups: the second would get what the first left (a recipe holds one
    # OnceRows wrapper per iterator, so the same iterator is the same wrapper)
    once = [conv.data_source for conv, _ in out if isinstance(conv.data_source, Iterator)]
    if len({id(rows) for rows in once}) < len(once):
        raise OnceRows.consumed_error()
    names = [spec.name for _, spec in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(
            f"two lineups share the name(s) {duplicates}: give each a distinct .name(...)"
        )
    return out


async def _arun(conversations: Iterable[Conversation], options: Options) -> RunReport:
    from ..conversation import Conversation  # when called: see the module's docstring

    if not isinstance(conversations, Conversation) and (
        isinstance(conversations, str | bytes | Mapping) or not isinstance(conversations, Iterable)
    ):
        raise ConfigurationTypeError(
            f"{options.caller}() takes a list of Conversation objects (one per lineup), got "
            f"{type(conversations).__name__}; e.g. {options.caller}([pair, solo], out_dir='runs/x')"
        )
    lineups = _lineups(conversations, options)
    return await execute(lineups, options)


async def arun(conversations: Iterable[Conversation], **options: Unpack[RunOptions]) -> RunReport:
    """Async twin of :func:`run` (works under top-level await)."""
    return await _arun(conversations, parse_options("arun", options))


def run(conversations: Iterable[Conversation], **options: Unpack[RunOptions]) -> RunReport:
    """Run many lineups in one pool under one ``out_dir``/resume namespace.

    Each conversation expands to its own jobs (one per ``.data()`` row, else a single job), namespaced by its
    ``.name()``: ``pair_7b``, ``gpqa/row_00000``... (unnamed lineups are ``conv0``, ``conv1``...).

    Options (keyword only; checked before anything runs, an unknown one is refused):
    ``devices`` (None: every visible GPU, or the CPU when no local model; else a list such as
    ``["cuda:0", "cuda:1"]``), ``out_dir`` (None: in memory; a directory: checkpointed and resumable),
    ``seed`` (0; per-job seeds are seed, seed+1, ...), ``resume`` (True; False moves an old ledger aside and
    starts fresh), ``batched`` (True) or ``mode`` (``ExecutionMode.BATCHED``; ``DETERMINISTIC`` is
    ``batched=False``), ``max_batch_size`` (64), ``max_concurrency`` (256), ``max_attempts`` (3), ``progress``
    (None: a bar when interactive), ``max_batch_wait`` (0.05 s), ``worker_start_timeout`` (300 s),
    ``api_budget`` (None), ``cluster`` (None: this machine; ``"ray"``: the device workers are Ray actors, one
    per GPU of the cluster, or one per ``"cpu"``/``"cuda"`` entry of ``devices``; see docs/ray.md),
    ``record_tokens`` (False; True: every participant that can keeps each turn's tokens and their
    log-probabilities, ``message.tokens``, as its own ``record_tokens=True`` would; the turns of those
    that cannot, such as Anthropic's, say why in ``metadata["tokens_missing"]``; docs/rollouts.md),
    ``turn_timeout`` and ``analyzer_timeout`` (None: no limit; seconds a turn or an analyzer may take before
    its job fails, the others going on). Failed jobs do not raise: they are in ``report.failed``, and a
    warning on the ``interlens`` logger says how many failed and why the first did.
    """
    from interlens.scheduler import run_sync

    return run_sync(_arun, conversations, parse_options("run", options))
