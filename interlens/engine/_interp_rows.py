"""The hooked-row path: a row with hooks (capture, steering) runs alone; and teacher-forced scoring.

A row with a capture or steering runs ALONE, from scratch, through the plain batch path as a batch of one
(``_prefill.PlainBatch``), its hooks installed only during its own forward passes: a forward hook sees every
row of the batch it is in, so a steered row's batch mates would be steered too, and a captured row's
activations would be mixed with theirs. Alone and from scratch also means a reuse stream is neither read
nor updated by such a row, and an unsteered captured row samples the very tokens the same row would without
the capture.

Capture positions (``interp._capture``): row ``i`` of a generated row's capture is the hidden state at
the position of generated token ``i`` with that token as the input. The decode loop never feeds the last
sampled token, so a captured row takes one extra forward step feeding it: the prompt's positions come from
the prefill, generated tokens ``0..n-2`` from the decode steps, token ``n-1`` from that extra step.

Scoring (:meth:`HookedRow.score`) is one forward pass over prompt + continuation per row, exact and
simple: ``log_softmax`` in float32 of the logits at the positions that predict each continuation token.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from .._core import ConfigurationError
from ..interp import (
    CaptureSpec,
    DecoderLayer,
    decoder_layers,
    hidden_size,
    hooked,
    layer_indices,
    site_problem,
)
from ._decode import ModelRunner
from ._generation_types import GenerationRequest, GenerationResult, ScoreRequest, ScoreResult
from ._prefill import PlainBatch

if TYPE_CHECKING:
    from ..interp import SteeringSpec

__all__ = ["HookedRow"]


class HookedRow:
    """The hooked-row and scoring paths (see the module docstring), over the engine's runner and its plain
    batch path; it alone finds the model's decoder layers (by structure, once) and hooks them."""

    def __init__(self, runner: ModelRunner, *, plain: PlainBatch) -> None:
        self.runner = runner
        self.plain = plain
        self._decoder_layers: list[DecoderLayer] | None = None  # found on first use

    def layers(self) -> list[DecoderLayer]:
        """The model's decoder layers, found by structure on first use."""
        if self._decoder_layers is None:
            self._decoder_layers = decoder_layers(self.runner.model)
        return self._decoder_layers

    def check(
        self, capture: CaptureSpec | None, steering: tuple[SteeringSpec, ...]
    ) -> ConfigurationError | None:
        """Problems only this model can show (layer range, d_model, sites); returned in place, not raised."""
        if capture is None and not steering:
            return None
        try:
            layers = self.layers()
            n = len(layers)
            if capture is not None:
                layer_indices(capture.layers, n, where=f"capture(layers={list(capture.layers or [])})")
                problem = site_problem(layers, capture)
                if problem is not None:
                    return ConfigurationError(problem)
            width = hidden_size(self.runner.model)
            for spec in steering:
                layer_indices(spec.layers, n, where=f"SteeringSpec(layers={list(spec.layers)})")
                if spec.direction.numel() != width:
                    return ConfigurationError(
                        f"SteeringSpec(direction=...): has {spec.direction.numel()} entries but this model's "
                        f"residual stream is {width} wide (d_model); build the direction from this model's "
                        "activations"
                    )
        except ConfigurationError as exc:
            return exc
        return None

    def generate(
        self, requests: list[GenerationRequest], cancelled: threading.Event | None
    ) -> list[GenerationResult | Exception]:
        """One hooked row (``requests`` holds exactly one), alone and from scratch; its capture aligned with
        its generated tokens (or the row's ``GenerationError`` when its logits went non-finite)."""
        import torch

        (request,) = requests
        runner = self.runner
        prompt_len = len(request.prompt_ids)
        with hooked(
            self.layers(), steering=request.steering, capture=request.capture, prompt_len=prompt_len
        ) as recorder:
            done = self.plain.prefill_and_decode([request], cancelled)
            row = done.rows[0]
            if row.failure is not None:
                return [row.failure]
            if recorder is not None:  # feed the last sampled token: its position's activations
                last = torch.tensor([[row.tokens[-1]]], dtype=torch.long, device=runner.device)
                position = prompt_len + len(row.tokens) - 1
                at = torch.tensor([position], dtype=torch.long, device=runner.device)
                runner.step(last, at, None, done.cache, position + 1, done.static)
        seconds = time.perf_counter() - done.started
        result = runner.result(row, seconds=seconds, batch_size=1, shared=0, reused=0)
        if recorder is not None:
            result.captured = recorder.captured(prompt_len=prompt_len, answer_ids=row.tokens)
        return [result]

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Teacher-forced log-probabilities of the continuation (one forward over prompt + continuation)."""
        import torch

        started = time.perf_counter()
        prompt_len, n = len(request.prompt_ids), len(request.continuation_ids)
        ids = torch.tensor(
            [request.prompt_ids + request.continuation_ids], dtype=torch.long, device=self.runner.device
        )
        with hooked(
            self.layers() if request.capture is not None or request.steering else [],
            steering=request.steering,
            capture=request.capture,
            prompt_len=prompt_len,
        ) as recorder:
            # The last n + 1 positions: P-1 .. P+n-1; position P-1+i predicts continuation token i.
            out = self.runner.model(input_ids=ids, use_cache=False, logits_to_keep=n + 1)
        logits = out.logits[0, :-1].float()
        targets = ids[0, prompt_len:].unsqueeze(-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)
        captured = None
        if recorder is not None:
            captured = recorder.captured(prompt_len=prompt_len, answer_ids=request.continuation_ids)
        return ScoreResult(
            continuation_ids=request.continuation_ids,
            logprobs=tuple(float(x) for x in logprobs.tolist()),
            captured=captured,
            prompt_tokens=prompt_len,
            seconds=time.perf_counter() - started,
        )
