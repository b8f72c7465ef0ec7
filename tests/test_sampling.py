"""The batch sampler: the right distribution and nucleus; a seeded row draws the same alone or batched.

Logits are built by hand so the expected probabilities are known exactly; the engine-level checks (a seeded
row batched equals the row alone, on real tiny models) are in test_generation.py and test_seeding.py.
"""

from __future__ import annotations

import pytest
import torch

from interlens.engine._sampler import Sampler
from interlens.engine._sampler_parts import _inverse_cdf
from interlens.engine._sampler_parts import draw_inverse_cdf as _draw
from interlens.engine._sampling import SamplingSettings

# Six tokens: probabilities .4 .3 .2 .1, then two that are impossible (-inf logits).
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
LOGITS = PROBS.log()


def _request(*, seed: int | None = None, temperature: float = 1.0, top_p: float = 1.0) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=1, temperature=temperature, top_p=top_p, seed=seed)


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=len(PROBS)).double() / len(tokens)


@pytest.mark.parametrize("seeded", [True, False])
def test_rows_are_drawn_from_their_softmax(seeded: bool) -> None:
    n = 20_000
    torch.manual_seed(0)
    sampler = Sampler([_request(seed=i if seeded else None) for i in range(n)], "cpu")
    freq = _frequencies(sampler(LOGITS.expand(n, -1)))
    sigma = (PROBS * (1 - PROBS) / n).sqrt().double()
    assert ((freq - PROBS.double()).abs() <= 5 * sigma + 1e-12).all(), freq
    assert freq[4:].sum() == 0  # impossible tokens are never drawn


def test_temperature_sharpens_and_flattens_per_row() -> None:
    n = 20_000
    cold = Sampler([_request(seed=i, temperature=0.25) for i in range(n)], "cpu")(LOGITS.expand(n, -1))
    hot = Sampler([_request(seed=i, temperature=4.0) for i in range(n)], "cpu")(LOGITS.expand(n, -1))
    expect_cold = torch.softmax(LOGITS / 0.25, dim=-1).double()
    expect_hot = torch.softmax(LOGITS / 4.0, dim=-1).double()
    assert (_frequencies(cold) - expect_cold).abs().max() < 0.02
    assert (_frequencies(hot) - expect_hot).abs().max() < 0.02


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [
        (0.7, [0, 1]),  # .4 < .7, .4 + .3 reaches it: the two most likely
        (0.4, [0]),  # the first token alone reaches it exactly
        (0.75, [0, 1, 2]),
        (1e-6, [0]),
    ],
)
def test_top_p_samples_within_the_nucleus_in_proportion(top_p: float, nucleus: list[int]) -> None:
    n = 20_000
    shuffled = torch.tensor([3, 0, 5, 2, 4, 1])  # the sampler must not rely on the vocabulary being sorted
    logits = LOGITS[shuffled].expand(n, -1)
    tokens = Sampler([_request(seed=i, top_p=top_p) for i in range(n)], "cpu")(logits)
    freq = torch.bincount(shuffled[tokens], minlength=len(PROBS)).double() / n
    kept = PROBS[nucleus].double()
    expected = torch.zeros(len(PROBS), dtype=torch.float64)
    expected[nucleus] = kept / kept.sum()
    assert (freq - expected).abs().max() < 0.02, freq


def test_a_seeded_row_draws_the_same_tokens_alone_or_in_any_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randn(5, 300, generator=generator) * 2 for _ in range(12)]
    rows = [
        _request(temperature=0),  # greedy
        _request(seed=7),
        _request(),  # unseeded: draws from the global RNG between the seeded rows
        _request(seed=9, top_p=0.8),
        _request(seed=11, temperature=0.6),
    ]
    batched = Sampler(rows, "cpu")
    alone = {j: Sampler([rows[j]], "cpu") for j in (1, 3, 4)}
    for logits in steps:
        together = batched(logits)
        for j, sampler in alone.items():
            assert sampler(logits[j : j + 1]).item() == together[j].item()
        assert together[0].item() == logits[0].argmax().item()


def test_a_row_keeps_its_stream_when_its_batch_mates_finish() -> None:
    generator = torch.Generator().manual_seed(2)
    steps = [torch.randn(3, 300, generator=generator) for _ in range(10)]
    full = Sampler([_request(seed=1), _request(seed=2), _request(seed=3)], "cpu")
    alone = Sampler([_request(seed=3)], "cpu")
    for step, logits in enumerate(steps):
        if step == 4:
            full = full.select([2])  # rows 0 and 1 finished
        rows = logits if step < 4 else logits[2:]
        assert full(rows)[-1].item() == alone(logits[2:]).item()


def test_draws_made_ahead_follow_a_row_past_block_edges_and_batch_changes() -> None:
    """The seeded rows' uniforms are drawn a block of steps ahead (16, then 32, ...): a row that outlives two
    blocks and two batch reductions, beside an unseeded row, still draws exactly what it draws alone."""
    generator = torch.Generator().manual_seed(3)
    steps = [torch.randn(4, 300, generator=generator) for _ in range(60)]
    rows = [_request(seed=1), _request(), _request(seed=3), _request(seed=4, top_p=0.9)]
    batch = Sampler(rows, "cpu")
    alone = {j: Sampler([rows[j]], "cpu") for j in (0, 2, 3)}
    live = [0, 1, 2, 3]
    for step, logits in enumerate(steps):
        if step == 20:  # inside the second block
            batch, live = batch.select([0, 2, 3]), [0, 2, 3]
        if step == 48:  # the third block's first step: an empty remainder is handed on
            batch, live = batch.select([1, 2]), [2, 3]
        together = batch(logits[live])
        for k, j in enumerate(live):
            if j in alone:  # the unseeded row draws from torch's global RNG
                assert together[k].item() == alone[j](logits[j : j + 1]).item(), (step, j)


def test_unseeded_rows_follow_torch_manual_seed() -> None:
    logits = torch.randn(4, 300)
    sampler = Sampler([_request() for _ in range(4)], "cpu")
    torch.manual_seed(5)
    first = [sampler(logits).tolist() for _ in range(5)]
    torch.manual_seed(5)
    assert [sampler(logits).tolist() for _ in range(5)] == first


def test_the_draw_never_leaves_the_support_even_at_the_top_of_the_unit_interval() -> None:
    cdf = PROBS.cumsum(0).expand(3, -1).contiguous()
    # 1.0 itself cannot come from a stream, but a float32 rounding of 1 - 2**-60 is exactly 1.0.
    u = torch.tensor([0.0, 1.0 - 2**-24, 1.0])
    assert _inverse_cdf(cdf, u).tolist() == [0, 3, 3]  # token 3 is the last with any mass


def test_seeds_differing_only_in_sign_are_different_streams() -> None:
    logits = torch.zeros(2, 300)  # uniform: every draw shows
    sampler = Sampler([_request(seed=5), _request(seed=-5)], "cpu")
    draws = torch.stack([sampler(logits) for _ in range(10)])
    assert draws[:, 0].tolist() != draws[:, 1].tolist()


# ------------------------------------------------------------------- draws at a real vocabulary's size


@pytest.mark.parametrize("vocab", [49_152, 1_100])  # a whole number of blocks, and a tail block
def test_a_blocked_draw_is_the_inverse_cdf_of_the_whole_vocabulary(vocab: int) -> None:
    """The sampler draws by block sums, then a cumsum inside one block: in float64 (no rounding to speak of)
    every draw is the token a cumsum over the whole vocabulary gives."""
    generator = torch.Generator().manual_seed(3)
    weights = torch.rand(8, vocab, generator=generator, dtype=torch.float64) ** 8  # uneven, every block
    weights[:, ::7] = 0.0  # tokens without mass, some at block edges
    for _ in range(50):
        u = torch.rand(8, generator=generator, dtype=torch.float64)
        assert _draw(weights, u).tolist() == _inverse_cdf(weights.cumsum(dim=-1), u).tolist()


def test_a_blocked_draw_follows_the_distribution_and_never_picks_a_token_without_mass() -> None:
    n, vocab = 20_000, 49_152
    weights = torch.zeros(vocab)
    chosen = torch.tensor([0, 255, 256, 30_000, vocab - 1])  # block edges, and the tail's last token
    weights[chosen] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    tokens = Sampler([_request(seed=i) for i in range(n)], "cpu")(weights.log().expand(n, -1))
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    assert freq[chosen].sum() == 1.0
    assert (freq[chosen] - weights[chosen].double()).abs().max() < 0.015, freq[chosen]


def test_a_blocked_draw_at_the_top_of_the_unit_interval_takes_the_last_token_with_mass() -> None:
    """The last block's own cumsum may round below what the block sums left for it: the draw still lands on
    a token with mass, the last one, never on the zeros after it."""
    weights = torch.zeros(3, 2_048)
    weights[:, :1500] = torch.rand(3, 1500, generator=torch.Generator().manual_seed(4))
    u = torch.tensor([0.0, 1.0 - 2**-24, 1.0])
    picked = _draw(weights, u).tolist()
    assert picked[0] == int(weights[0].nonzero()[0]) and picked[1:] == [1499, 1499]


def test_a_block_whose_own_cumsum_rounds_short_of_its_sum_still_yields_a_token_with_mass() -> None:
    """One heavy token and many tiny ones: the block's vectorised sum keeps more of the tiny mass than its
    cumsum does, so a draw near the top overshoots the block's cumsum. It must land on the block's last
    token with mass, not on the next block's first token (which has none)."""
    weights = torch.zeros(2, 2_048)
    weights[:, 1536] = 1.0
    weights[:, 1537:1792] = 1e-8
    block = weights[0, 1536:1792]
    assert block.sum() > block.cumsum(0)[-1]  # the rounding this test is about
    assert _draw(weights, torch.tensor([1.0 - 2**-24, 1.0])).tolist() == [1791, 1791]


@pytest.mark.parametrize(
    "temperatures", [[0.0] * 4, [0.9] * 4, [0.0, 0.9, 0.0, 0.9]], ids=["greedy", "sampling", "mixed"]
)
def test_rows_whose_logits_went_nan_or_infinite_are_reported_and_a_ruled_out_token_is_not(
    temperatures: list[float],
) -> None:
    logits = torch.zeros(4, 2_048)
    logits[0, 5] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")  # no token left to choose
    logits[3, :100] = float("-inf")  # tokens the model rules out: a usable row
    sampler = Sampler([_request(seed=i, temperature=t) for i, t in enumerate(temperatures)], "cpu")
    tokens, finite, _ = sampler.choose(logits.to(torch.bfloat16))
    assert finite.tolist() == [False, False, False, True]
    assert 100 <= int(tokens[3]) < 2_048
