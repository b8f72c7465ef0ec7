"""Views in, generations and scores out: the chat layer between a local participant and its engine.

A :class:`ModelParticipant` describes a turn as a :class:`ChatRequest` (the speaker's view and how to
sample it) or, for ``conv.logprobs`` and teacher-forced capture, a :class:`ChatScoreRequest` (a view and a
continuation to score). :class:`ChatEngine` renders each view with the tokenizer's own chat template and hands
token ids to the :class:`~._generation.LocalEngine`. It is what the scheduler holds per model and
device (its ``Engine``): a coalesced batch may mix both request kinds, and a row that cannot be rendered
fails alone, returned in place.

Capture and steering ride on the request (``capture=``, ``steering=``); the engine runs such a row alone,
with its hooks installed only for that row's forward passes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .._core import GenerationError, View
from ..interp import CaptureSpec, ScoredText, SteeringSpec
from ._sampling import SamplingSettings

__all__ = ["ChatEngine", "ChatRequest", "ChatScoreRequest"]

#: A request's prompt ids, and a scored request's continuation ids (None for a turn to generate).
_Encoded = tuple[tuple[int, ...], tuple[int, ...] | None]


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """One turn to generate: the speaker's view and its sampling settings (handed on to the engine as is)."""

    view: View
    sampling: SamplingSettings
    reuse_key: Hashable | None = None
    capture: CaptureSpec | None = None
    steering: tuple[SteeringSpec, ...] = ()
    record_tokens: bool = False  # the result carries each token's log-probabilities


@dataclass(frozen=True, kw_only=True)
class ChatScoreRequest:
    """Score ``continuation`` as the speaker's next message after ``view`` (teacher-forced, no sampling)."""

    view: View
    continuation: str
    capture: CaptureSpec | None = None
    steering: tuple[SteeringSpec, ...] = ()


class ChatEngine:
    """A loaded model plus its tokenizer's chat template: views in, generations out (scheduler ``Engine``)."""

    _RENDERED_KEPT = 4096  # rendered prompts waiting for their batch (a cancelled request's entry ages out)

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # Prompts rendered by ``request_tokens`` when a request was queued, by request identity: the batch
        # then skips the render (the tokenizing moves off the device thread).
        self._rendered: dict[int, tuple[Any, _Encoded]] = {}

    def request_tokens(self, request: ChatRequest | ChatScoreRequest) -> int:
        """What ``request`` costs in a batch, in tokens (the scheduler's batch budget; called on queueing)."""
        ids, continuation = self._encode(request)
        if len(self._rendered) >= self._RENDERED_KEPT:
            self._rendered.pop(next(iter(self._rendered)))
        self._rendered[id(request)] = (request, (ids, continuation))
        if continuation is not None:
            return len(ids) + len(continuation)
        assert isinstance(request, ChatRequest)
        return len(ids) + max(1, request.sampling.max_new_tokens)

    def _ids(self, request: ChatRequest | ChatScoreRequest) -> _Encoded:
        """The prompt ids (and a score's continuation ids): as ``request_tokens`` encoded them, else now."""
        kept = self._rendered.pop(id(request), None)
        if kept is not None and kept[0] is request:
            return kept[1]
        return self._encode(request)

    def _encode(self, request: ChatRequest | ChatScoreRequest) -> _Encoded:
        ids = self.prompt_ids(request.view)
        if isinstance(request, ChatScoreRequest):
            return ids, tuple(self.tokenizer(request.continuation, add_special_tokens=False)["input_ids"])
        return ids, None

    def prompt_ids(self, view: View) -> tuple[int, ...]:
        """The token ids the model sees for ``view``, generation prompt included."""
        from ._chat_template import render_view

        text = render_view(self.tokenizer, view)
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate_batch(
        self, requests: Sequence[ChatRequest | ChatScoreRequest], *, mode: Any = None, cancelled: Any = None
    ) -> list[Any]:
        from interlens.scheduler import ExecutionMode

        from ._generation import GenerationRequest, ScoreRequest

        prepared: list[Any] = []
        for req in requests:
            try:
                ids, continuation = self._ids(req)
                if isinstance(req, ChatScoreRequest):
                    prepared.append(
                        ScoreRequest(ids, continuation or (), capture=req.capture, steering=req.steering)
                    )
                else:
                    prepared.append(
                        GenerationRequest(
                            ids,
                            sampling=req.sampling,
                            reuse_key=req.reuse_key,
                            capture=req.capture,
                            steering=req.steering,
                            record_logprobs=req.record_tokens,
                        )
                    )
            except Exception as exc:  # a view the template cannot render fails its own row only
                prepared.append(GenerationError(f"cannot render the view of {req.view.speaker!r}: {exc}"))
        generate = [p for p in prepared if isinstance(p, GenerationRequest)]
        score = [p for p in prepared if isinstance(p, ScoreRequest)]
        mode = mode or ExecutionMode.BATCHED
        engine = self.engine  # held for the whole batch: an eviction meanwhile only drops self.engine
        if engine is None:
            raise RuntimeError(f"{self!r} was evicted (no job left in the run needed it); load it again")
        generated = iter(engine.generate_batch(generate, mode=mode, cancelled=cancelled) if generate else [])
        scored = iter(engine.score(score, cancelled=cancelled) if score else [])
        out: list[Any] = []
        for req, p in zip(requests, prepared, strict=True):
            if isinstance(p, Exception):
                out.append(p)
            elif isinstance(p, GenerationRequest):
                out.append(_whose(next(generated), req.view))
            else:
                out.append(self._scored(next(scored)))
        return out

    def _scored(self, result: Any) -> Any:
        if isinstance(result, Exception):
            return result
        ids = tuple(result.continuation_ids)
        tokens = tuple(self.tokenizer.convert_ids_to_tokens(list(ids)))
        return ScoredText(ids, tokens, tuple(result.logprobs), result.captured)

    def token_budget(self) -> int | None:
        """The engine's first batch budget in tokens (from free CUDA memory; None on CPU)."""
        budget: int | None = self.engine.token_budget()
        return budget

    def release_memory(self) -> None:
        """Called by the scheduler before it retries a batch that ran out of memory."""
        self.engine.release_memory()

    def evict(self) -> None:
        """Called by the scheduler when no job left in the run needs this model: drop it from the
        process-wide model cache and let its weights go (this engine is not used again)."""
        from ._model_cache import forget_engine, free_device_memory

        engine, self.engine = self.engine, None
        if engine is None:
            return
        device = engine.device
        forget_engine(engine)
        del engine  # the last reference, unless a live caller still holds the model
        free_device_memory(device)


def _whose(result: Any, view: View) -> Any:
    """A row's generation error, told whose turn it was (the engine only knows rows and tokens)."""
    if isinstance(result, GenerationError):
        turn = view.own_turns + 1
        return type(result)(f"turn {turn} of participant {view.speaker!r}: {result}")
    return result
