"""The sampler as a pipeline of parts: each part does alone what the sampler does for its setting, a part
plugged in (a new setting: one field on the record, one part) changes the distribution as it should and
follows its rows through batch reductions, and the sampling rules live in one place.

Expected draws are computed here from first principles (the row's own uniform, an inverse CDF in float32),
not from the sampler's code.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from interlens import AutoModelParticipant, ConfigurationError
from interlens.engine._generation_types import GenerationRequest
from interlens.engine._sampler import Sampler
from interlens.engine._sampler_parts import PARTS, SamplingPart, Temperature, TopP
from interlens.engine._sampling import SamplingSettings

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
LOGITS = PROBS.log()


def _uniform(seed: int) -> torch.Tensor:
    """A seeded row's first uniform: its stream's first draw, as the device sees it (float32)."""
    return torch.tensor(random.Random(str(seed)).random(), dtype=torch.float32)


def _expected(logits: torch.Tensor, *, seed: int, temperature: float = 1.0, top_p: float = 1.0) -> int:
    """The token a row draws from first principles, in float32: the inverse CDF of its softmax at its
    uniform, in vocabulary order, or in descending order within its nucleus."""
    scores = logits.float().unsqueeze(0) / torch.tensor([[temperature]])
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()[0]
    order = torch.arange(len(weights))
    if top_p < 1.0:
        weights, order = torch.sort(weights / weights.sum(), descending=True, stable=True)
        end = int(torch.searchsorted(weights.cumsum(0), torch.tensor([top_p]))) + 1
        weights, order = weights[:end], order[:end]
    cdf = weights.cumsum(0)
    return int(order[int(torch.searchsorted(cdf, _uniform(seed) * cdf[-1:], right=True))])


def _rows(**settings: float) -> list[SamplingSettings]:
    return [SamplingSettings(max_new_tokens=1, seed=i, **settings) for i in range(200)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("part", "settings"),
    [(Temperature, {"temperature": 0.4}), (Temperature, {"temperature": 3.0}), (TopP, {"top_p": 0.75})],
)
def test_a_part_alone_draws_what_the_whole_sampler_draws_for_its_setting(
    part: type[SamplingPart], settings: dict[str, float]
) -> None:
    logits = torch.randn(6, generator=torch.Generator().manual_seed(5)) * 2
    rows = _rows(**settings)
    expected = [_expected(logits, seed=i, **settings) for i in range(len(rows))]
    batch = logits.expand(len(rows), -1)
    assert Sampler(rows, "cpu", parts=(part,))(batch).tolist() == expected
    assert Sampler(rows, "cpu")(batch).tolist() == expected
    assert Sampler(rows, "cpu", parts=())(batch).tolist() != expected  # without it, the setting is lost


def test_parts_no_row_uses_are_not_built() -> None:
    assert Sampler(_rows(), "cpu").parts == []  # temperature 1, no nucleus: nothing but the draw
    kinds = [type(p) for p in Sampler(_rows(temperature=0.5, top_p=0.9), "cpu").parts]
    assert kinds == [Temperature, TopP] == list(PARTS)


# ------------------------------------------------------------------ a new setting: a field and a part


@dataclass(frozen=True, kw_only=True)
class _Banning(SamplingSettings):
    """The record with one more field, as a new setting adds it."""

    banned: int = -1  # a token this row may not draw (-1: none)


class _Ban(SamplingPart):
    """The part of that setting: zeroes each row's banned token, a tensor of per-row state."""

    def __init__(self, banned: list[int], device: str) -> None:
        self.banned = banned
        self.device = device
        self.index = torch.tensor([[max(b, 0)] for b in banned], device=device)
        self.keep = torch.tensor([[0.0 if b >= 0 else 1.0] for b in banned], device=device)

    @classmethod
    def build(cls, settings: Sequence[SamplingSettings], device: str) -> _Ban | None:
        banned = [getattr(s, "banned", -1) for s in settings]
        return cls(banned, device) if any(b >= 0 for b in banned) else None

    def select(self, keep: list[int]) -> _Ban | None:
        banned = [self.banned[k] for k in keep]
        return type(self)(banned, self.device) if any(b >= 0 for b in banned) else None

    def weigh(self, weights: torch.Tensor) -> None:
        weights.scatter_(1, self.index, weights.gather(1, self.index) * self.keep)


def test_a_part_plugged_in_changes_the_distribution_and_the_recorded_logprobs() -> None:
    n = 20_000
    rows = [_Banning(max_new_tokens=1, seed=i, banned=0) for i in range(n)]
    choice = Sampler(rows, "cpu", record=True, parts=(*PARTS, _Ban)).choose(LOGITS.expand(n, -1))
    freq = torch.bincount(choice.tokens, minlength=len(PROBS)).double() / n
    expected = torch.tensor(
        [0.0, 0.5, 1 / 3, 1 / 6, 0.0, 0.0], dtype=torch.float64
    )  # token 0 out, renormalised
    assert freq[0] == 0 and (freq - expected).abs().max() < 0.015, freq
    assert choice.logprobs is not None
    sampled = choice.logprobs[:, 1].double()
    assert torch.allclose(
        sampled, expected[choice.tokens].log(), atol=1e-5
    )  # drawn from the cut distribution
    model = choice.logprobs[:, 0].double()
    assert torch.allclose(model, PROBS.double()[choice.tokens].log(), atol=1e-5)  # the model's is unchanged


def test_a_plugged_in_part_follows_its_rows_when_their_batch_mates_leave() -> None:
    generator = torch.Generator().manual_seed(6)
    steps = [torch.randn(5, 300, generator=generator) for _ in range(30)]
    for logits in steps:
        logits[:, 7] = 8.0  # token 7 would be drawn most of the time: banned on rows 2 and 4
    rows = [
        _Banning(max_new_tokens=1, temperature=0),  # greedy: not among the rows a part sees
        _Banning(max_new_tokens=1, seed=1),
        _Banning(max_new_tokens=1, seed=2, banned=7),
        _Banning(max_new_tokens=1, seed=3, temperature=0.7, top_p=0.9),
        _Banning(max_new_tokens=1, seed=4, banned=7, temperature=1.5),
    ]
    parts: tuple[type[SamplingPart], ...] = (*PARTS, _Ban)
    batch, live = Sampler(rows, "cpu", parts=parts), [0, 1, 2, 3, 4]
    alone = {j: Sampler([rows[j]], "cpu", parts=parts) for j in live}
    for step, logits in enumerate(steps):
        if step == 10:
            batch, live = batch.select([0, 2, 3, 4]), [0, 2, 3, 4]
        if step == 20:
            batch, live = batch.select([0, 3]), [0, 4]
        together = batch(logits[live]).tolist()
        for k, j in enumerate(live):
            assert together[k] == alone[j](logits[j : j + 1]).item(), (step, j)
            assert together[k] != rows[j].banned, (step, j)


# ------------------------------------------------------------------ one place for the rules


@pytest.mark.parametrize(
    ("setting", "value"),
    [("temperature", -0.5), ("temperature", math.inf), ("top_p", 0), ("max_new_tokens", 0)],
)
def test_the_participant_and_the_engine_refuse_a_setting_by_one_rule(qwen2_path, setting, value) -> None:
    with pytest.raises(ConfigurationError) as participant:
        AutoModelParticipant.from_pretrained(qwen2_path, name="judge", **{setting: value})
    settings = {"max_new_tokens": 4, setting: value}
    with pytest.raises(ConfigurationError) as engine:
        GenerationRequest((1,), sampling=SamplingSettings(**settings))
    who, said = str(participant.value).split("): ", 1)
    assert who.startswith("ModelParticipant(name='judge', ") and said == str(engine.value).split("): ", 1)[1]
