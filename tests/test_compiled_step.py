"""The step's tensor cores compiled with torch.compile on CPU equal their eager results.

Compiled, each as one graph (`fullgraph=True`: a graph break or a host read fails the test) with
static shapes (`dynamic=False`: each bucket shape is its own graph) by the default inductor
backend: `block_scores.score_rows` (the verification's scores, bonus draws and weight
increments), `keyed_random.keyed_uniform` (the bonus and resampling uniforms) and
`resampling.resample_rows` (ESS, the resampling decision, ancestors and the log Z_hat step).

Tokens, ancestors, decisions and uniforms (integer arithmetic) must be exactly equal. The
floating-point results may differ by rounding: inductor fuses the reductions and uses its own
vectorised exp and log, so sums are taken in another order.
- score_rows' increments are float32 quantities (log-softmax and logsumexp over V in float32,
  a drafted token's score less its log q~), widened to float64. Their rounding is relative to
  the terms they are formed from, up to the largest score, not to the increment itself (a
  difference of two scores of 40 can be near 0), so the tolerance is 1e-5 of the largest
  increment's magnitude, about 80 float32 ulps (2^-23 ≈ 1.2e-7) of it, plus 1e-5 relative.
  The differences seen were at most 7.6e-6 with increments up to 48 (2 float32 ulps of 48),
  and any change of behaviour (a wrong token, a dropped mask) moves an increment by order 1.
- resample_rows' ESS and log Z step are float64 over N <= 16 particles: a reordered sum moves
  them by about N · 2^-53 ≈ 2e-15 relative; rtol = 1e-12 leaves a margin of 500.
The resampling decision is exactly equal even where the ESS ties the threshold (ESS_TIE).
"""

import math

import pytest
import torch

from smc_sd.engine.block_scores import score_rows
from smc_sd.engine.keyed_random import BONUS, RESAMPLE, counter, keyed_uniform, seed_key
from smc_sd.engine.resampling import resample_rows

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def compiled(fn):
    """fn compiled by inductor as one static-shape graph."""
    return torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)


def score_inputs(a: int, k: int, v: int, masked: bool, dead: bool, greedy: bool, plain: bool, seed: int) -> tuple:
    """Random arguments of `score_rows`: A rows, K drafted tokens, V tokens; row 0 greedy when
    `greedy`, row 1's mask empty when `masked` (it draws unmasked with weight zero); `plain`:
    every T_a 1 (0 on a greedy row) and alpha_a 1, the shortcuts that skip passes."""
    generator = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(a, k + 1, v, generator=generator)
    temperature = 0.3 + 1.5 * torch.rand(a, generator=generator)
    if greedy:
        temperature[0] = 0.0
    # alpha_a != 1 on every row: the powered shortcuts are static, the tensor is what varies
    alpha = 0.5 + torch.rand(a, generator=generator)
    mask = None
    if masked:
        mask = torch.rand(a, v, generator=generator) < 0.3
        mask[1] = False
    drafted = torch.randint(0, v, (a, k), generator=generator)
    drawn_logq = torch.log_softmax(torch.randn(a, k, v, generator=generator), -1).gather(-1, drafted[..., None]).squeeze(-1)
    dead_positions = torch.rand(a, k, generator=generator) < 0.2 if dead else None
    keys = torch.tensor([seed_key(s) for s in torch.randint(0, 1 << 62, (a,), generator=generator).tolist()])
    u = keyed_uniform(keys, counter(torch.randint(0, 1000, (a,), generator=generator), torch.arange(a), k, BONUS))
    # constrained rows always weigh their bonus; other rows when alpha_a != 1
    weighted = torch.ones(a, dtype=torch.bool) if masked else torch.rand(a, generator=generator) < 0.5
    if plain:
        temperature, alpha = torch.where(temperature > 0, 1.0, 0.0), None
        weighted = weighted if masked else None
    return logits, temperature, alpha, mask, drafted, drawn_logq, dead_positions, u, weighted, greedy, not plain


@pytest.mark.parametrize(
    "a, k, v, masked, dead, greedy, plain",
    [(4, 0, 257, False, False, False, False), (4, 4, 257, True, True, True, False), (16, 4, 300, False, False, True, False),
     (16, 0, 300, True, False, False, False), (16, 4, 300, False, True, True, True)],
)
def test_compiled_score_rows_equals_eager(a, k, v, masked, dead, greedy, plain):
    args = score_inputs(a, k, v, masked, dead, greedy, plain, seed=a + k)
    block, increments = score_rows(*args)
    compiled_block, compiled_increments = compiled(score_rows)(*args)
    assert torch.equal(compiled_block, block)
    scale = increments[torch.isfinite(increments)].abs().max().clamp_min(1.0)
    torch.testing.assert_close(compiled_increments, increments, rtol=1e-5, atol=1e-5 * float(scale))
    if masked:
        # the row without an allowed bonus token has weight zero in both
        assert increments[1, -1] == compiled_increments[1, -1] == -math.inf


def test_compiled_keyed_uniform_equals_eager():
    generator = torch.Generator().manual_seed(3)
    keys = torch.tensor([seed_key(s) for s in torch.randint(0, 1 << 62, (16,), generator=generator).tolist()])[:, None]
    count = counter(torch.randint(0, 1 << 22, (16, 1), generator=generator), torch.arange(8)[None, :], 0, RESAMPLE)
    assert torch.equal(compiled(keyed_uniform)(keys, count), keyed_uniform(keys, count))


@pytest.mark.parametrize("g, n", [(4, 4), (16, 8)])
def test_compiled_resample_rows_equals_eager(g, n):
    generator = torch.Generator().manual_seed(g + n)
    logw = 3 * torch.randn(g, n, generator=generator, dtype=torch.float64)
    # a population at the threshold (ESS = N/2 = tau N) and a dead one
    logw[0] = torch.where(torch.arange(n) < n // 2, 0.0, -math.inf)
    logw[1] = -math.inf
    thresholds = torch.full((g,), 0.5, dtype=torch.float64)
    thresholds[2:] = torch.rand(g - 2, generator=generator, dtype=torch.float64) + 0.5
    schemes = [("systematic", "multinomial", "stratified", "residual")[i % 4] for i in range(g)]
    u = keyed_uniform(7, counter(torch.arange(g)[:, None], torch.arange(n)[None, :], 0, RESAMPLE))
    ess, resampled, ancestors, steps = resample_rows(logw, thresholds, schemes, u)
    compiled_ess, compiled_resampled, compiled_ancestors, compiled_steps = compiled(resample_rows)(logw, thresholds, schemes, u)
    assert not resampled[0] and not resampled[1] and resampled[2:].any()
    assert torch.equal(compiled_resampled, resampled)
    assert torch.equal(compiled_ancestors, ancestors)
    torch.testing.assert_close(compiled_ess, ess, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(compiled_steps, steps, rtol=1e-12, atol=0.0)
