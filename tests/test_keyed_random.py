"""The keyed generator and the per-row tempering of the batched step.

- `keyed_uniform` is a pure function of its key, uniform on [0, 1) (a chi-square test over
  bins, its threshold the 1e-6 upper quantile of the chi-square law), with no correlation
  between neighbouring counters, particles or seeds (|r| under 5 / sqrt(n), about 5 standard
  errors of r under independence).
- `counter` gives distinct words to distinct (cycle, particle, position, stream).
- `tempered_logprobs_rows` equals `tempered_logprobs` row by row, greedy and masked rows included.
"""

from __future__ import annotations

import math

import torch

from smc_sd.engine.keyed_random import BONUS, RESAMPLE, counter, keyed_uniform, seed_key
from smc_sd.engine.sampling import tempered_logprobs, tempered_logprobs_rows, tokens_from_uniforms

DRAWS = 400_000
BINS = 200
# the chi-square law with 199 degrees of freedom exceeds this with probability about 1e-6
CHI2_BOUND = 199 + 4.75 * math.sqrt(2 * 199) + 15


def chi_square_uniform(u: torch.Tensor) -> float:
    counts = torch.bincount((u * BINS).long(), minlength=BINS).double()
    expected = u.numel() / BINS
    return float(((counts - expected) ** 2 / expected).sum())


def test_keyed_uniforms_are_uniform_along_every_key_word():
    n = torch.arange(DRAWS)
    along = {
        "cycles": keyed_uniform(3, counter(n, 0, 0, BONUS)),
        "particles": keyed_uniform(3, counter(7, n % (1 << 20), n >> 20, BONUS)),
        "seeds": keyed_uniform(torch.tensor([seed_key(s) for s in range(DRAWS)]), counter(0, 0, 0, BONUS)),
        "positions and streams": keyed_uniform(11, counter(n >> 13, 0, (n >> 1) % 4096, BONUS + (n % 2))),
    }
    for name, u in along.items():
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0, name
        assert chi_square_uniform(u) < CHI2_BOUND, name
        r = float(torch.corrcoef(torch.stack([u[1:], u[:-1]]))[0, 1])
        assert abs(r) < 5 / math.sqrt(DRAWS), name


def test_two_streams_at_one_key_are_independent_and_a_key_always_draws_the_same():
    n = torch.arange(DRAWS)
    bonus = keyed_uniform(5, counter(n, 2, 3, BONUS))
    resample = keyed_uniform(5, counter(n, 2, 3, RESAMPLE))
    assert abs(float(torch.corrcoef(torch.stack([bonus, resample]))[0, 1])) < 5 / math.sqrt(DRAWS)
    assert torch.equal(bonus, keyed_uniform(5, counter(n, 2, 3, BONUS)))
    # one element of a batch draws what it draws alone
    assert float(keyed_uniform(5, counter(torch.tensor([1234]), 2, 3, BONUS))[0]) == float(bonus[1234])


def test_counters_of_distinct_fields_are_distinct():
    fields = torch.cartesian_prod(torch.arange(4), torch.arange(4), torch.arange(4), torch.arange(3))
    words = counter(fields[:, 0], fields[:, 1], fields[:, 2], 0) | fields[:, 3]
    assert words.unique().numel() == fields.shape[0]
    assert int(counter((1 << 23) - 1, (1 << 20) - 1, (1 << 12) - 1, 255)) < 2**63


def test_tokens_from_uniforms_follow_the_softmax():
    # each token's share of 40,000 draws lies within 5 standard errors of its probability
    scores = torch.tensor([[0.0, -1.0, float("-inf"), 1.5, -0.3]])
    p = torch.softmax(scores, -1)[0]
    u = keyed_uniform(1, counter(torch.arange(40_000), 0, 0, BONUS))
    tokens = tokens_from_uniforms(scores.expand(u.numel(), -1), u)
    share = torch.bincount(tokens, minlength=5).double() / u.numel()
    assert int((tokens == 2).sum()) == 0
    assert bool(((share - p).abs() <= 5 * torch.sqrt(p * (1 - p) / u.numel()) + 1e-12).all())


def test_tempered_rows_equal_the_per_row_tempering():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 50, generator=generator) * 4
    mask = torch.rand(4, 3, 50, generator=generator) < 0.3
    mask[2, 1] = False
    temperatures = [0.7, 0.0, 1.0, 0.0]
    t = torch.tensor(temperatures)
    for m in (None, mask):
        rows = tempered_logprobs_rows(logits, t, m, greedy=True)
        for a, temperature in enumerate(temperatures):
            alone = tempered_logprobs(logits[a], temperature, None if m is None else m[a])
            assert torch.equal(rows[a], alone)
