"""The verification's tensor core (`block_scores.score_rows`) and the draws under it.

- `tokens_from_uniforms` over a vocabulary of several search blocks (V = 1,000: four blocks of
  256) draws each block and each likely token with its probability: 200,000 keyed draws, every
  share within 5 standard errors (sqrt(p (1 - p) / n)) of the softmax; a token of weight zero
  is never drawn.
- A draw from scores (`tokens_from_scores`, which forms the chosen block's weights again from
  its scores) is the draw from their floored weights (`tokens_from_weights`): the same tokens
  and totals, on a vocabulary of whole search blocks and on one that is padded.
- `tokens_and_logprobs` draws the same tokens as `tokens_from_uniforms` and reads each drawn
  token's log-probability off the weights' total: within 1e-5 of the log-softmax there, on
  rows at T = 1 and at T = 0.3 (sharp rows whose tail underflows the exp floor).
- `score_rows`' shortcuts (alpha None for every alpha = 1, `scaled` False for every T in {0, 1},
  `weighted_bonus` None) give the same tokens and the same drafted increments, bit for bit, as
  the full passes with alpha = 1 and T = 1 written out; the bonus column is 0 exactly where the
  full pass's logsumexp of a log-softmax is within float32 rounding of 0.
- A row's tokens and increments do not depend on the other rows of the call (the batched
  step's identity, a request's result alone equal to its result among others, rests on it).
"""

from __future__ import annotations

import torch

from smc_sd.engine.block_scores import score_rows
from smc_sd.engine.keyed_random import BONUS, counter, keyed_uniform
from smc_sd.engine.sampling import exp_floored, tokens_and_logprobs, tokens_from_scores, tokens_from_uniforms, tokens_from_weights

DRAWS = 200_000


def test_draws_over_many_blocks_follow_the_softmax():
    generator = torch.Generator().manual_seed(0)
    scores = 2 * torch.randn(1, 1000, generator=generator)
    scores[0, ::7] = float("-inf")
    p = torch.softmax(scores, -1)[0].double()
    u = keyed_uniform(5, counter(torch.arange(DRAWS), 0, 0, BONUS))
    tokens = tokens_from_uniforms(scores.expand(DRAWS, -1), u)
    assert int((p[tokens] == 0).sum()) == 0
    counts = torch.bincount(tokens, minlength=1000).double()
    # each block of 256 tokens, and each token of probability above 1e-3
    shares = torch.cat([counts.view(-1, 250).sum(1), counts[p > 1e-3]]) / DRAWS
    probabilities = torch.cat([p.view(-1, 250).sum(1), p[p > 1e-3]])
    assert bool(((shares - probabilities).abs() <= 5 * torch.sqrt(probabilities * (1 - probabilities) / DRAWS)).all())


def test_a_draw_from_scores_is_the_draw_from_their_weights():
    generator = torch.Generator().manual_seed(2)
    for v in (1024, 1000):
        scores = 6 * torch.randn(300, v, generator=generator)
        scores[::4, : v // 2] = float("-inf")
        u = torch.rand(300, dtype=torch.float64, generator=generator)
        top = scores.amax(-1, keepdim=True)
        tokens, total = tokens_from_scores(scores, top, u)
        expected_tokens, expected_total = tokens_from_weights(exp_floored(scores - top), u)
        assert torch.equal(tokens, expected_tokens) and torch.equal(total, expected_total)


def test_drawn_logprobs_are_the_log_softmax():
    generator = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(64, 5000, generator=generator)
    logits[::3, 100:4000] = float("-inf")
    u = keyed_uniform(9, counter(0, torch.arange(64), 0, BONUS))
    for temperature in (1.0, 0.3):
        scores = logits / temperature
        tokens, logprobs = tokens_and_logprobs(scores, u)
        assert torch.equal(tokens, tokens_from_uniforms(scores, u))
        expected = torch.log_softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)


def random_block(a: int, k: int, v: int, seed: int) -> tuple:
    """Logits [A, K + 1, V], drafted tokens [A, K], their log q [A, K], uniforms [A]; row 0 greedy."""
    generator = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(a, k + 1, v, generator=generator)
    drafted = torch.randint(0, v, (a, k), generator=generator)
    drawn_logq = -5 * torch.rand(a, k, generator=generator)
    u = keyed_uniform(seed, counter(0, torch.arange(a), k, BONUS))
    return logits, drafted, drawn_logq, u


def test_shortcuts_are_the_full_passes():
    a, k, v = 8, 3, 700
    logits, drafted, drawn_logq, u = random_block(a, k, v, seed=2)
    temperature = torch.ones(a)
    temperature[0] = 0.0
    short_block, short_inc = score_rows(logits, temperature, None, None, drafted, drawn_logq, None, u, None, True, False)
    full_block, full_inc = score_rows(logits, temperature, torch.ones(a), None, drafted, drawn_logq, None, u, torch.ones(a, dtype=torch.bool), True, True)
    assert torch.equal(short_block, full_block)
    assert torch.equal(short_inc[:, :k], full_inc[:, :k])
    assert bool((short_inc[:, k] == 0).all())
    assert float(full_inc[:, k].abs().max()) < 1e-6


def test_a_bonus_alone_from_p_t_is_drawn_from_the_tempered_logits():
    # K = 0 (ar's block), every row unconstrained at alpha = 1 and T > 0: no log-softmax
    a, v = 8, 700
    logits, drafted, drawn_logq, u = random_block(a, 0, v, seed=5)
    temperature = 0.3 + torch.rand(a, generator=torch.Generator().manual_seed(6))
    for scaled, t in ((True, temperature), (False, torch.ones(a))):
        block, increments = score_rows(logits, t, None, None, drafted, drawn_logq, None, u, None, False, scaled)
        assert torch.equal(block[:, 0], tokens_from_uniforms(logits[:, 0] / t[:, None], u))
        assert increments.shape == (a, 1) and bool((increments == 0).all())


def test_rows_do_not_depend_on_each_other():
    a, k, v = 12, 4, 600
    logits, drafted, drawn_logq, u = random_block(a, k, v, seed=3)
    generator = torch.Generator().manual_seed(4)
    temperature = 0.3 + torch.rand(a, generator=generator)
    temperature[0] = 0.0
    alpha = 0.5 + torch.rand(a, generator=generator)
    mask = torch.rand(a, v, generator=generator) < 0.4
    weighted = torch.ones(a, dtype=torch.bool)
    dead = torch.rand(a, k, generator=generator) < 0.1
    block, increments = score_rows(logits, temperature, alpha, mask, drafted, drawn_logq, dead, u, weighted, True, True)
    assert bool(torch.isfinite(increments[~dead.any(1), k]).all())
    for rows in (torch.tensor([5]), torch.tensor([0, 7, 11]), torch.arange(3, 9)):
        part_block, part_increments = score_rows(
            logits[rows], temperature[rows], alpha[rows], mask[rows], drafted[rows], drawn_logq[rows], dead[rows], u[rows], weighted[rows], True, True
        )
        assert torch.equal(part_block, block[rows])
        assert torch.equal(part_increments, increments[rows])
