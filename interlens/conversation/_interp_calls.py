"""The conversation-level interp calls as methods of ``Conversation``: ``capture``, ``logprobs``,
``turn_activations`` (and async twins), plus ``run_sync``, how every sync twin runs its async method.

Apart from ``_conversation`` to keep that module about the recipe and the turn loop; the work itself is
in ``_lens``. ``Conversation`` inherits :class:`InterpCalls` (a mixin: ``self`` is always a
``Conversation``, whose open capture block and participants the calls read).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._core import CURRENT_JOB, run_in_loop
from ..interp import ActivationCache, CaptureSpec
from ._lens import score_text, turn_activations

if TYPE_CHECKING:
    from ..interp import Logprobs
    from ._conversation import Conversation

__all__ = ["InterpCalls", "run_sync"]


class InterpCalls:
    """The interp calls of a conversation (see ``_lens``), mixed into ``Conversation``."""

    _capture: ActivationCache | None

    @contextlib.contextmanager
    def capture(
        self,
        sites: str | Sequence[str] = ("residual",),
        layers: int | Sequence[int] | None = None,
        *,
        prompt: bool = False,
        offload: str | None = "cpu",
    ) -> Iterator[ActivationCache]:
        """Record the activations of every local ``step`` / ``run`` / ``sample`` / ``logprobs`` in the block.

        ``with conv.capture(sites=("residual",), layers=None) as cache: conv.run(2)`` fills ``cache`` with
        one :class:`ActivationRecord` per turn, layer and site, tagged with the participant and the message
        index (``cache.query(...)``, ``cache.at(...)``). Sites: ``"residual"``, ``"attn"``, ``"mlp"``;
        ``layers=None``: all; ``prompt=True`` also keeps the prompt's positions. Local participants only (a
        hosted participant's turn in the block raises :class:`InterpModeError`); inside a rollout it needs
        ``batched=False``. Memory: see ``interlens.interp._capture``.
        """
        cache = ActivationCache(CaptureSpec.build(sites=sites, layers=layers, prompt=prompt, offload=offload))
        outer, self._capture = self._capture, cache
        try:
            yield cache
        finally:
            self._capture = outer

    async def alogprobs(self, speaker: str, text: str, *, steering: Any = None) -> Logprobs:
        """The log-probability of ``text`` as ``speaker``'s next message (per token; ``.total``)."""
        return await score_text(cast("Conversation", self), speaker, text, steering=steering)

    def logprobs(self, speaker: str, text: str, *, steering: Any = None) -> Logprobs:
        """Sync twin of :meth:`alogprobs`."""
        return run_sync(functools.partial(self.alogprobs, speaker, text, steering=steering))

    async def aturn_activations(
        self,
        speaker: str | None = None,
        *,
        sites: str | Sequence[str] = ("residual",),
        layers: int | Sequence[int] | None = None,
        prompt: bool = False,
        offload: str | None = "cpu",
    ) -> ActivationCache:
        """The activations of the transcript's turns by local participants (or by ``speaker`` only),
        re-read teacher-forced: one forward pass per turn over the view its speaker had then plus the
        message, under the speaker's own steering. For probes on a finished conversation (a rollout's
        analyzer, a result), where no capture block was open while the turns were generated."""
        spec = CaptureSpec.build(sites=sites, layers=layers, prompt=prompt, offload=offload)
        return await turn_activations(cast("Conversation", self), speaker, spec)

    def turn_activations(
        self,
        speaker: str | None = None,
        *,
        sites: str | Sequence[str] = ("residual",),
        layers: int | Sequence[int] | None = None,
        prompt: bool = False,
        offload: str | None = "cpu",
    ) -> ActivationCache:
        """Sync twin of :meth:`aturn_activations`."""
        call = functools.partial(
            self.aturn_activations, speaker, sites=sites, layers=layers, prompt=prompt, offload=offload
        )
        return run_sync(call)


def run_sync(fn: Callable[..., Any], *args: Any) -> Any:
    """Run an async method from sync code: a script, a notebook, or an analyzer's worker thread.

    An analyzer runs in a worker thread of the job's event loop; its ``conv.sample(...)`` must go back to THAT
    loop (where the batcher and the job's device live) instead of starting a new one.
    """
    if CURRENT_JOB.get() is not None:
        return run_in_loop(fn, *args)
    from interlens.scheduler import run_sync as scheduler_run_sync

    return scheduler_run_sync(fn, *args)
