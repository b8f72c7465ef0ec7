"""``Conversation``: the recipe, the live dialogue and the rollout driver in one object.

The recipe (participants, framing, turns, data, analyzer, name, stop conditions) is an immutable record;
every modifier returns a new Conversation around a new record and leaves the original untouched
(copy-on-write). Participants are shared between copies, so loaded weights are shared by reference.

Live use mutates the dialogue: ``run``/``step`` append turns to ``transcript``; ``sample`` generates without
committing. ``rollout`` never mutates: it runs independent copies (see ``_rollout``), each made by
:meth:`Conversation.for_row` and run by the same turn loop as ``run`` (:meth:`Conversation.advance`).

Imports run one way (ARCHITECTURE.md): ``run`` → ``report`` → this package → ``participants`` → ... →
``_core``; the only import back up is the lazy one of ``run._rollout`` in the ``rollout`` facade (that module
does not import this package, so it closes no cycle). The JSON form lives in ``_persist``, the reading of
``.data()`` rows in ``_core._rows``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import anyio.lowlevel

from .._core import (
    MODERATOR,
    BranchError,
    BranchPoints,
    ConfigurationError,
    GenerationOptions,
    MaxTurns,
    Message,
    OnceRows,
    RowReader,
    StopCondition,
    Template,
    Transcript,
    TurnWatch,
    UnknownParticipantError,
    UnrunConversationError,
    View,
    ViewMessage,
    ambient_conditions,
    expand_turns,
    first_turns,
    is_templated,
    record_sample,
    resolve,
    row_reader,
    turn_cap,
    turn_seed,
    turns_on_this_seed_rule,
)
from ..interp import ActivationCache, CaptureTarget, steering_from
from ..participants import Participant
from ._interp_calls import InterpCalls, run_sync
from ._persist import SCHEMA_VERSION, check_schema, json_safe, load, recipe_json, save, storable_row
from ._recipe import FIELDS, Recipe, participants_tuple, stop_tuple, validate

if TYPE_CHECKING:
    from ..report import RunReport
    from ..rollouts import RunOptions

__all__ = ["SCHEMA_VERSION", "Conversation"]

_UNSET: Any = object()


class Conversation(InterpCalls):
    """A multi-agent conversation recipe that can also be run live and rolled out many times.

    ``shared_context`` seeds the transcript as its first message, authored ``"moderator"`` and seen by
    everyone. Turns go round-robin from the first participant. Each speaker sees the shared system prompt and
    its own system prompt, then the transcript with its own turns as ``assistant`` and everybody else's as
    ``user`` (labelled with the author's name when more than two participants speak).
    """

    def __init__(
        self,
        participants: Sequence[Participant],
        shared_context: Template = None,
        shared_system_prompt: Template = None,
        *,
        turns: int | None = None,
        data: Any = None,
        analyzer: Callable[[Conversation], Any] | str | None = None,
        name: str | None = None,
        stop: Sequence[StopCondition] = (),
    ) -> None:
        recipe = Recipe(
            participants=participants_tuple(participants),
            shared_context=shared_context,
            shared_system_prompt=shared_system_prompt,
            turns=turns,
            data=data,
            analyzer=analyzer,
            name=name,
            stop=stop_tuple(stop),
        )
        validate(recipe)
        self._recipe = recipe
        self.transcript = Transcript()
        self.row: dict[str, Any] | None = None
        self.seed: int | None = None
        self._stream_id = uuid.uuid4().hex
        self._samples_taken = 0  # numbers each sample()'s random stream (see turn_seed)
        self._capture: ActivationCache | None = None  # the open conv.capture() block, if any
        self._upto: int | None = None  # upto(k)'s k: the turns a rollout continues from (see upto)
        self._seed_transcript()

    # ------------------------------------------------------------------ recipe fields (read-only)
    @property
    def participants(self) -> tuple[Participant, ...]:
        return self._recipe.participants

    @property
    def shared_context(self) -> Template:
        return self._recipe.shared_context

    @property
    def shared_system_prompt(self) -> Template:
        return self._recipe.shared_system_prompt

    @property
    def stop_conditions(self) -> tuple[StopCondition, ...]:
        return self._recipe.stop

    @property
    def data_source(self) -> Any:
        """The data attached with ``.data(...)`` (``None`` when there is none)."""
        data = self._recipe.data
        return data.rows if isinstance(data, OnceRows) else data

    @property
    def analyzer_fn(self) -> Callable[[Conversation], Any] | str | None:
        return self._recipe.analyzer

    def participant(self, name: str) -> Participant:
        for p in self._recipe.participants:
            if p.name == name:
                return p
        raise UnknownParticipantError(
            f"no participant named {name!r}; participants: {[p.name for p in self._recipe.participants]}"
        )

    # ------------------------------------------------------------------ copy-on-write modifiers
    def _copy(self, **changes: Any) -> Conversation:
        recipe = dataclasses.replace(self._recipe, **changes)
        validate(recipe)
        clone = object.__new__(Conversation)
        clone._recipe = recipe
        clone.transcript = self.transcript.copy()
        clone.row = dict(self.row) if self.row is not None else None
        clone.seed = self.seed
        clone._stream_id = uuid.uuid4().hex
        clone._samples_taken = 0
        clone._capture = None  # a capture block records the conversation it was opened on, not its copies
        clone._upto = self._upto
        if "shared_context" in changes:
            clone._seed_transcript()
        return clone

    def turns(self, n: Any = _UNSET) -> Any:
        """``.turns(n)``: a copy that runs ``n`` generated turns (``None``: until a stop condition).

        ``.turns()`` with no argument returns the current setting.
        """
        if n is _UNSET:
            return self._recipe.turns
        return self._copy(turns=n)

    def data(self, rows: Any) -> Conversation:
        """A copy that expands to one conversation per row of ``rows`` in a rollout.

        ``rows`` may be a ``datasets.Dataset``, a streaming ``IterableDataset``, a list of dicts, any
        iterable, or a zero-argument callable that returns one (``.data(lambda: read_rows(path))``): it is
        called afresh each time the rows are read. Rows are streamed, never materialized.

        A bare iterator (a generator) can be read only once: one rollout of this recipe (or of a copy of it)
        consumes it, and a second is refused with an error. On a resumed rollout into an ``out_dir`` it is
        also compared job by job as it is read, rather than all up front (see the README's "Resume"): pass a
        list, a Dataset or a callable to rerun the rows and have a changed row refused before anything runs.
        """
        return self._copy(data=rows)

    def analyzer(self, fn_or_name: Callable[[Conversation], Any] | str | None) -> Conversation:
        """A copy whose rollouts call ``fn_or_name(conv)`` on each finished conversation, models resident.

        A name refers to a function registered with ``register_analyzer``. The return value must be
        JSON-serializable; it becomes ``RunResult.analysis``.
        """
        return self._copy(analyzer=fn_or_name)

    def name(self, value: Any = _UNSET) -> Any:
        """``.name("x")``: a copy whose rollout job ids are namespaced ``x/...``; ``.name()`` returns it."""
        if value is _UNSET:
            return self._recipe.name
        return self._copy(name=value)

    def run_until(self, *conditions: StopCondition) -> Conversation:
        """A copy that also stops when any of ``conditions`` holds (added to the existing ones)."""
        return self._copy(stop=(*self._recipe.stop, *conditions))

    def set(self, **fields: Any) -> Conversation:
        """A copy with any constructor field replaced, e.g. ``.set(participants=[solver])``."""
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise ConfigurationError(f"Conversation has no field(s) {unknown}; fields: {list(FIELDS)}")
        if "participants" in fields:
            fields["participants"] = participants_tuple(fields["participants"])
        if "stop" in fields:
            fields["stop"] = stop_tuple(fields["stop"])
        return self._copy(**fields)

    def recipe(self) -> Conversation:
        """The unrun recipe of this conversation, whatever it ran: its participants, framing, modifiers
        and data, with a transcript holding only the shared context.

        A conversation that belongs to one data row (a rollout's result, ``report.results[j].conversation``)
        keeps it: its recipe carries the row as its data (``.data([row])``), so that rolling it out resolves
        the same prompts (one job, ``row_00000``).
        """
        clone = self._copy()
        clone.transcript = Transcript()
        clone._upto = None
        if clone.row is not None and self._recipe.data is None:
            clone = clone.data([clone.row])
        clone._seed_transcript()
        return clone

    def upto(self, k: int) -> Conversation:
        """The conversation as it stood after its first ``k`` turns: the recipe plus those turns, a branch
        point. ``k`` counts generated turns as ``generated_turns`` does (the shared context is no turn; a
        moderator's note before turn ``k`` is kept); ``upto(0)`` is the recipe with its shared context.

        Rolling it out continues every copy from those turns (they are part of what a resume compares); each
        copy draws from the rollout's seeds (``seed + i``), so to regenerate a recorded job's own later turns
        branch its report instead: ``report.branch(at_turn=k)``.
        """
        length = self.generated_turns
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise BranchError(
                f"upto(k): k must be a non-negative int (a count of generated turns), got {k!r}"
            )
        if k > length:
            raise BranchError(
                f"upto({k}): this conversation has {length} generated turn(s), so k can be 0 to {length}; "
                f"pass upto({length}) to continue after its last turn"
            )
        clone = self.recipe()
        clone.transcript = Transcript(first_turns(list(self.transcript), k, author=lambda m: m.author))
        clone._upto = k
        return clone

    @property
    def branch_points(self) -> BranchPoints | None:
        """The branch points of a branch recipe (``report.branch(...)``), which a rollout expands into
        continuations; None for any other data."""
        data = self._recipe.data
        return data if isinstance(data, BranchPoints) else None

    @property
    def upto_turn(self) -> int | None:
        """``k`` for a conversation made by :meth:`upto` (a branch point a rollout continues from), else
        None."""
        return self._upto if self._upto == self.generated_turns else None

    # ------------------------------------------------------------------ state
    @property
    def generated_turns(self) -> int:
        """Turns generated so far (the shared context does not count)."""
        return sum(1 for m in self.transcript if m.author != MODERATOR)

    @property
    def tokens_generated(self) -> int:
        """Tokens this conversation generated, summed from each turn's ``metadata["n_tokens"]``."""
        return self.transcript.tokens_generated

    @property
    def last_generated(self) -> Message | None:
        for m in reversed(self.transcript):
            if m.author != MODERATOR:
                return m
        return None

    def _seed_transcript(self) -> None:
        """Put the shared context first in the transcript (once it can be resolved)."""
        context = self._recipe.shared_context
        messages = [m for m in self.transcript if not m.metadata.get("shared_context")]
        self.transcript = Transcript(messages)
        if context is None or (is_templated(context) and self.row is None):
            return
        text = resolve(context, self.row, field="shared_context")
        self.transcript = Transcript([Message(MODERATOR, text or "", {"shared_context": True}), *messages])

    def _conditions(self, *, recipe_turns: bool = True) -> list[StopCondition]:
        conditions = list(self._recipe.stop) + list(ambient_conditions())
        if recipe_turns and self._recipe.turns is not None:
            conditions.append(MaxTurns(self._recipe.turns))
        return conditions

    def next_speaker(self) -> Participant:
        """Round-robin from the first participant, continuing after the last one who spoke."""
        last = self.last_generated
        participants = self._recipe.participants
        if last is None:
            return participants[0]
        names = [p.name for p in participants]
        index = names.index(last.author) + 1 if last.author in names else 0
        return participants[index % len(participants)]

    def view(self, speaker: str | Participant, *, upto: int | None = None) -> View:
        """What ``speaker`` sees now (or, with ``upto=i``, saw before message ``i``): its system block and
        the transcript from its point of view."""
        participant = speaker if isinstance(speaker, Participant) else self.participant(speaker)
        label = len(self._recipe.participants) > 2
        messages = []
        for m in self.transcript[:upto]:
            if m.author == participant.name:
                messages.append(ViewMessage("assistant", m.content, m.author))
            else:
                content = f"{m.author}: {m.content}" if label else m.content
                messages.append(ViewMessage("user", content, m.author))
        system_parts = [
            resolve(self._recipe.shared_system_prompt, self.row, field="shared_system_prompt"),
            resolve(participant.system_prompt, self.row, field=f"{participant.name}.system_prompt"),
        ]
        system = "\n\n".join(p for p in system_parts if p) or None
        return View(speaker=participant.name, system=system, messages=tuple(messages))

    # ------------------------------------------------------------------ the copies a rollout runs
    def for_row(self, row: Any, *, index: int | None = None, seed: int) -> Conversation:
        """The copy a rollout runs for ``row`` (``None`` without data): row attached, templates resolved
        (participants' system prompts, shared system prompt and context), ``seed`` set. ``index`` (the row's
        position) only names the row in errors."""
        row_dict = storable_row(row, index)
        participants = tuple(
            p.replace(system_prompt=resolve(p.system_prompt, row_dict, field=f"{p.name}.system_prompt"))
            if is_templated(p.system_prompt)
            else p
            for p in self._recipe.participants
        )
        system = resolve(self._recipe.shared_system_prompt, row_dict, field="shared_system_prompt")
        conv = self.set(participants=participants, shared_system_prompt=system)
        conv.row, conv.seed = row_dict, seed
        conv._seed_transcript()
        return conv

    def replay(self, turns: Iterable[Mapping[str, Any]], *, stream_id: str) -> Conversation:
        """A copy that continues after ``turns`` (``Message.to_json()`` dicts, e.g. those a job already
        committed) on its own stream ``stream_id`` (a job id: a local model keeps its KV cache per stream).

        A committed local turn that did not draw from the stream this release gives it (``seed_of_turn``; a
        ledger that an earlier release left half-done mixed the job's id into each stream) ends the replay
        there: that turn and the ones after it are generated again, with a warning, because continuing would
        mix two random streams in one conversation, an answer no seed reproduces. The turns before it are
        kept, and so are hosted turns: their seed is the provider's best-effort hint, and they were paid for.
        """
        conv = self._copy()
        conv._stream_id = stream_id
        committed = [Message.from_json(turn) for turn in expand_turns(turns)]
        speakers = {p.name: p for p in conv.participants}
        kept = turns_on_this_seed_rule(committed, speakers, conv.seed, conv.generated_turns, job=stream_id)
        for message in committed[:kept]:
            conv.transcript.append(message)
        return conv

    def read_rows(self, n: int | None, *, lineup: str) -> RowReader:
        """How a rollout reads at most ``n`` of the rows given to ``.data()`` (see ``_rows``)."""
        return row_reader(self._recipe.data, n, lineup)

    # ------------------------------------------------------------------ live use
    def _check_ready(self) -> None:
        if is_templated(self._recipe.shared_context) and self.row is None:
            resolve(self._recipe.shared_context, None, field="shared_context")  # raises the clear error

    def _options(
        self,
        conditions: Sequence[StopCondition],
        participant: Participant,
        *,
        ephemeral: bool = False,
        steering: Any = None,
    ) -> GenerationOptions:
        sample = None
        if ephemeral:
            sample = self._samples_taken = self._samples_taken + 1
        where = f"{'sample' if ephemeral else 'step'}({participant.name!r}, steering=...)"
        return GenerationOptions(
            max_new_tokens=turn_cap(conditions, self),
            seed=turn_seed(self, participant, sample=sample),
            stream_id=self._stream_id,
            ephemeral=ephemeral,
            capture=self._capture_target("sample" if ephemeral else "turn"),
            steering=None if steering is None else steering_from(steering, where=where),
        )

    def _capture_target(self, kind: str) -> CaptureTarget | None:
        """Inside a ``capture()`` block: where the next message's activations go (tagged with the index it
        has, or would have, in the transcript); None outside one."""
        if self._capture is None:
            return None
        return CaptureTarget(self._capture, len(self.transcript), kind)

    async def astep(self, speaker: str | None = None, *, steering: Any = None) -> Message:
        """Generate one turn (by ``speaker``, default the next in round-robin) and append it.

        ``steering=`` (a :class:`SteeringSpec` or a list) steers this turn only, instead of the speaker's
        own steering; it needs a local participant (and ``batched=False`` inside a rollout).
        """
        self._check_ready()
        participant = self.participant(speaker) if speaker is not None else self.next_speaker()
        options = self._options(self._conditions(), participant, steering=steering)
        message = await participant.agenerate(self.view(participant), options)
        self.transcript.append(message)
        return message

    def step(self, speaker: str | None = None, *, steering: Any = None) -> Message:
        """Sync twin of :meth:`astep`."""
        return run_sync(functools.partial(self.astep, speaker, steering=steering))

    async def arun(self, turns: int | None = None) -> Transcript:
        """Generate ``turns`` more turns (default: until the recipe's turn count or a stop condition).

        An explicit ``turns`` overrides the recipe's ``.turns(n)``; stop conditions still apply.
        """
        self._check_ready()
        conditions = self._conditions(recipe_turns=turns is None)
        if turns is not None:
            if not isinstance(turns, int) or turns < 0:
                raise ConfigurationError(f"run(turns=...) needs a non-negative int, got {turns!r}")
            conditions.append(MaxTurns(self.generated_turns + turns))
        elif not conditions:
            raise ConfigurationError(
                "this conversation would never stop: pass run(turns=n), set .turns(n), or add a stop "
                "condition with .run_until(...)"
            )
        return await self.advance(conditions)

    def run(self, turns: int | None = None) -> Transcript:
        """Sync twin of :meth:`arun`; works in scripts and inside a running event loop (Jupyter)."""
        return run_sync(self.arun, turns)

    async def advance(
        self,
        until: Sequence[StopCondition] | None = None,
        *,
        on_turn: Callable[[int, Message], Awaitable[None]] | None = None,
    ) -> Transcript:
        """THE turn loop: generate turns, appending each, until one of ``until`` holds.

        ``until`` defaults to the recipe's: ``.turns(n)``, its stop conditions and the ambient ones. After
        each turn ``on_turn(index, message)`` is awaited (index: 0 for the first generated turn). Live
        :meth:`arun` and every rollout job (which records each turn in the ledger from ``on_turn``) run
        through here, so a conversation runs the same way live and in a rollout.
        """
        conditions = self._conditions() if until is None else until
        watch = TurnWatch(conditions)  # each turn's time limit; no progress, turn after turn: an error
        while not any(c.should_stop(self) for c in conditions):
            participant, tokens = self.next_speaker(), self.tokens_generated
            turn = participant.agenerate(self.view(participant), self._options(conditions, participant))
            message = await watch.turn(participant.name, self.generated_turns, turn)
            self.transcript.append(message)
            if on_turn is not None:
                await on_turn(self.generated_turns - 1, message)
            watch.after_turn(self, tokens)
            await anyio.lowlevel.checkpoint()  # a turn that never waited still lets Ctrl-C in
        return self.transcript

    async def asample(self, speaker: str, prompt: str | None = None, *, steering: Any = None) -> Message:
        """Generate what ``speaker`` would say next (after ``prompt``, if given) WITHOUT committing it.
        ``steering=`` steers this sample only (see :meth:`astep`)."""
        if self.generated_turns == 0:
            raise UnrunConversationError(
                "sample() needs a conversation that has run: this one has no generated turn yet (an unrun "
                "recipe). Sample on a finished rollout, report.results[job_id].conversation, or run this "
                "conversation first with conv.run(...)"
            )
        participant = self.participant(speaker)
        view = self.view(participant)
        if prompt is not None:
            view = dataclasses.replace(
                view, messages=(*view.messages, ViewMessage("user", prompt, MODERATOR))
            )
        options = self._options(list(ambient_conditions()), participant, ephemeral=True, steering=steering)
        message = await participant.agenerate(view, options)
        record_sample(message.metadata)  # inside a rollout's analyzer: what it cost goes with the result
        return message

    def sample(self, speaker: str, prompt: str | None = None, *, steering: Any = None) -> Message:
        """Sync twin of :meth:`asample`."""
        return run_sync(functools.partial(self.asample, speaker, prompt, steering=steering))

    # ------------------------------------------------------------------ rollouts (see _rollout)
    def rollout(self, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
        """Run ``n`` independent copies (or one per data row); see :func:`interlens.run` for the options.

        ``seed=`` (default 0) seeds every local turn and ``sample()`` of every copy. With ``batched=False``
        a rerun is token-identical on the same hardware; batched, it draws the same random numbers but is
        token-identical only where the batched forward pass is batch-invariant (the rest of a turn's batch
        depends on timing), and otherwise reproducible in distribution. See ``turn_seed``.
        """
        from ..rollouts._rollout import rollout  # the one import up the house (ARCHITECTURE.md): a facade

        return rollout(self, n, **options)

    async def arollout(self, n: int | None = None, **options: Unpack[RunOptions]) -> RunReport:
        """Async twin of :meth:`rollout` (works under top-level await)."""
        from ..rollouts._rollout import arollout  # the facade's async twin

        return await arollout(self, n, **options)

    # ------------------------------------------------------------------ JSON (see _persist)
    def recipe_json(self, *, strict: bool = True) -> dict[str, Any]:
        """The recipe as JSON. ``strict=False`` names lambdas by their code instead of refusing them."""
        return recipe_json(self, strict=strict)

    def fingerprint(self) -> str:
        """A stable hash of the recipe: a rerun into the same out_dir with another fingerprint is refused.

        It covers the participants' settings, the templates as written, turns, stop conditions, analyzer and
        name — not the data, the seed or the execution mode: those are compared job by job, with each job's
        resolved prompts, through its input fingerprint (``_inputs``), so that growing ``n`` or appending rows
        keeps a lineup resumable.
        """
        blob = json.dumps(self.recipe_json(strict=False), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_json(self, *, strict: bool = False) -> dict[str, Any]:
        """Recipe + dialogue state as JSON (what the ledger and ``save`` store; see :meth:`recipe_json`)."""
        return {
            "schema": SCHEMA_VERSION,
            "recipe": self.recipe_json(strict=strict),
            "transcript": self.transcript.to_json(),
            "row": json_safe(self.row),
            "seed": self.seed,
        }

    def with_state(self, state: Mapping[str, Any]) -> Conversation:
        """A copy of this recipe carrying the dialogue state (transcript, row, seed) of ``state`` (from
        :meth:`to_json`, e.g. a finished job's in the ledger)."""
        check_schema(state)
        clone = self._copy()
        clone.transcript = Transcript.from_json(state.get("transcript", []))
        clone.row = state.get("row")
        clone.seed = state.get("seed")
        return clone

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write recipe + transcript to ``directory/conversation.json`` (JSON, never pickle)."""
        return save(self, directory)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Conversation:
        """Read a conversation written by :meth:`save`. Participants come back lazy (no weights loaded).

        A file that is not such a conversation (corrupt, truncated, some other JSON) is refused with an
        error naming it, and left untouched: loading only ever reads.
        """
        return load(cls, directory)

    def __repr__(self) -> str:
        names = ", ".join(p.name for p in self._recipe.participants)
        label = f" {self._recipe.name!r}" if self._recipe.name else ""
        return (
            f"<Conversation{label} [{names}] turns={self._recipe.turns} "
            f"transcript={len(self.transcript)} messages>"
        )
