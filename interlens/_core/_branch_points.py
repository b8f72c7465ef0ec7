"""Branch points: where a recorded conversation is continued from (issue 39).

A :class:`BranchPoint` is one recorded job at one turn: its data row, its seed, its first ``k`` turns as
recorded, and where it comes from (out_dir, job id, turn). A branch recipe is an ordinary Conversation whose
data is a :class:`BranchPoints` (the points and how many continuations each gets), so that ``.set(...)``,
``.turns(...)``, ``.analyzer(...)`` change it as any recipe, and a rollout expands each point into its
continuations (``rollouts._rollout``) instead of one job per row. ``report.branch(...)`` builds the points.

Here, at the bottom of the house, because three floors read them: ``conversation`` (a recipe's data),
``report`` (which builds them) and ``rollouts`` (which expands them), and ``report`` and ``rollouts`` may not
import ``conversation`` at run time (``Conversation.rollout`` imports ``rollouts._rollout``, which imports
``report``: that would close a cycle). For the same reason the one thing ``report`` needs of
``conversation`` to branch a ledger without the original objects, a lineup's Conversation rebuilt from its
recorded recipe, is a loader that ``conversation`` registers here (:func:`recipe_from_json`).

Lineage is a chain: a point taken from a branch's job records that job as its parent, whose own result
records its parent in turn (``report.PARENT_KEY`` of a result's conversation JSON).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._exceptions import ConfigurationError
from ._message import MODERATOR, Message

__all__ = [
    "REPLAYED_KEY",
    "BranchPoint",
    "BranchPoints",
    "first_turns",
    "recipe_from_json",
    "register_recipe_loader",
]

T = TypeVar("T")

REPLAYED_KEY = "replayed_from"
"""Metadata of a branch's recorded turns: the parent job they were replayed from. They were generated (and
paid for) there, so a ledger's spend (``report.usage()``, an ``APIBudget``) does not count them again."""
_LOADERS: list[Callable[[Mapping[str, Any], str], Any]] = []


@dataclass(frozen=True)
class BranchPoint:
    """One recorded job at turn ``at_turn``: what its continuations start from."""

    parent_job: str
    at_turn: int
    seed: int
    row: Mapping[str, Any] | None
    row_index: int | None
    #: the messages after the shared context up to the ``at_turn``-th generated turn, as ``Message`` JSON
    turns: tuple[Mapping[str, Any], ...]
    parent_out_dir: str | None = None

    @property
    def lineage(self) -> dict[str, Any]:
        """What a continuation's result records as its parent."""
        return {"out_dir": self.parent_out_dir, "job_id": self.parent_job, "turn": self.at_turn}

    def start(self, conv: Any) -> Any:
        """The Conversation a continuation starts as: ``conv`` (expanded for this point's row and the
        continuation's seed, its shared context in place) plus this point's recorded turns, as a branch
        point (``upto``) that a rollout job continues."""
        clone = conv.set()
        for turn in self.turns:
            metadata = dict(turn.get("metadata") or {})
            if turn.get("author") != MODERATOR:
                metadata[REPLAYED_KEY] = self.parent_job
            clone.transcript.append(Message.from_json({**turn, "metadata": metadata}))
        return clone.upto(clone.generated_turns)

    def job_id(self, prefix: str, sample: int) -> str:
        """``<prefix><parent job>@<turn>/s<sample>``: a continuation's id says where it comes from."""
        return f"{prefix}{self.parent_job}@{self.at_turn}/s{sample:04d}"


@dataclass(frozen=True)
class BranchPoints:
    """The data of a branch recipe: its points, and ``n`` continuations per point (``rollout(n=...)``
    overrides it). Iterable (``.data()`` takes it as it takes a list), never read as rows."""

    points: tuple[BranchPoint, ...]
    n: int = 1

    def __iter__(self) -> Iterator[BranchPoint]:
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def __repr__(self) -> str:
        jobs = ", ".join(f"{p.parent_job}@{p.at_turn}" for p in self.points[:3])
        more = f", ... ({len(self.points)} in all)" if len(self.points) > 3 else ""
        return f"BranchPoints([{jobs}{more}], n={self.n})"


def first_turns(messages: Sequence[T], k: int, *, author: Callable[[T], str]) -> list[T]:
    """The messages of a transcript up to and including its ``k``-th generated turn (the moderator's, the
    shared context among them, are no turns: those before the ``k``-th turn are kept)."""
    out: list[T] = []
    seen = 0
    for message in messages:
        if author(message) != MODERATOR:
            if seen == k:
                break
            seen += 1
        elif seen == k and k > 0:
            break  # a note after the k-th turn belongs to what came after it
        out.append(message)
    return out


def register_recipe_loader(loader: Callable[[Mapping[str, Any], str], Any]) -> None:
    """Set how a recorded recipe (``recipe_json``) becomes a Conversation (``conversation`` does, once)."""
    _LOADERS[:] = [loader]


def recipe_from_json(recipe: Mapping[str, Any], *, lineup: str) -> Any:
    """The Conversation of a lineup's recorded recipe (see the module's docstring)."""
    if not _LOADERS:  # pragma: no cover - ``import interlens`` imports ``conversation``, which registers it
        raise ConfigurationError("no recipe loader: import interlens.conversation first")
    return _LOADERS[0](recipe, lineup)
