"""Token-level distributions: tempered log-probabilities and categorical draws.

The draft's q and the target's p are computed by `tempered_logprobs` (and its row-wise form),
and a draft token's log q by `tokens_and_logprobs` where no one reads q whole: the q in every
weight and acceptance test is the distribution its token was drawn from, up to float rounding.
"""

from __future__ import annotations

import math

import torch

from smc_sd.engine import scratch

#: F: below it exp is floored (`exp_floored`). Under about -87.3 a float32 exp is subnormal or 0,
#: and torch's CPU exp takes a slow path for such arguments (and for -inf): over rows masked to
#: 1% of the vocabulary it took 12x, over log-probabilities at T = 0.3 71x, as long as over random
#: logits (`benchmarks/sampling.py`, its `exp` rows: one thread, 16 rows of 49,152).
#: At -70 every difference of two exps above F is 0 or a normal float32, so no subnormal arises.
EXP_FLOOR = -70.0
#: C: above exp(F) by 2^-20 of it, so above any float32 exp(F) within a few ulps (2^-23) of exact
FLOOR_WEIGHT = math.exp(EXP_FLOOR) * (1 + 2**-20)
#: tokens per block of `tokens_from_uniforms`'s two-level search
BLOCK = 256


def tempered_logprobs(logits: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / T) + log m along the last axis; at T = 0 its limit, greedy decoding.

    With a constraint mask m the result is log p_T(v) where m(v), -inf elsewhere: the masked
    target, unnormalised (its logsumexp is log Z = log sum_v p_T(v) m(v)). As T -> 0 the masked
    distribution renormalised, p_T m / Z, tends to the point mass on the allowed argmax, so at
    T = 0 this returns that point mass (log p = 0 on the first maximal allowed entry, -inf
    elsewhere): greedy decoding under a constraint masks first, then takes the argmax. A row
    whose allowed entries are all -inf has no mass at any T and comes back all -inf.

    Args:
        logits: [..., V] float32 raw logits.
        temperature: T >= 0.
        mask: [..., V] bool allowed tokens, or None.

    Returns:
        [..., V] float32 log-probabilities.
    """
    logits = logits.float()
    if temperature == 0:
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        best = logits.argmax(-1, keepdim=True)
        greedy = torch.full_like(logits, float("-inf")).scatter_(-1, best, 0.0)
        # a row with no finite allowed entry has no argmax to put the mass on
        return greedy.masked_fill(~torch.isfinite(logits.gather(-1, best)), float("-inf"))
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs if mask is None else logprobs.masked_fill(~mask, float("-inf"))


def tempered_logprobs_rows(logits: torch.Tensor, temperature: torch.Tensor, mask: torch.Tensor | None = None, greedy: bool = False, scaled: bool = True, scratch_purpose: str | None = None) -> torch.Tensor:
    """`tempered_logprobs` with a temperature per row, in one pass over all rows.

    Args:
        logits: [A, ..., V] float32 raw logits.
        temperature: [A] float32, T_a >= 0 (T_a = 0 is greedy, as in `tempered_logprobs`).
        mask: [A, ..., V] bool allowed tokens (or their uint8 view, `allowed`), or None.
        greedy: whether some T_a is 0 (the caller knows it from the plans, without reading the
            tensor back).
        scaled: whether some T_a is neither 0 nor 1 (known from the plans). When not, the
            logits go to the softmax undivided: dividing by 1 leaves a float unchanged, so the
            result is the same bits without a pass over [A, ..., V].
        scratch_purpose: when given, the log-softmax is written into the engine's scratch block
            of that name, and the tempered logits into the block of that name + "_tempered"
            (`smc_sd.engine.scratch`): the caller lets no view of the result outlive its own
            call.

    Returns:
        [A, ..., V] float32: row a is tempered_logprobs(logits[a], T_a, mask[a]).
    """
    mask = allowed(mask)
    # [A, 1, ..., 1]: each row's temperature, 1 where it is 0 (those rows are replaced below)
    t = temperature.view((-1,) + (1,) * (logits.dim() - 1))
    tempered = logits.float()
    if scaled:
        into = None if scratch_purpose is None else scratch.block(scratch_purpose + "_tempered", tempered)
        tempered = torch.div(tempered, torch.where(t > 0, t, 1.0), out=into)
    out = None if scratch_purpose is None else scratch.block(scratch_purpose, tempered)
    logprobs = torch.log_softmax(tempered, dim=-1, out=out)
    if mask is not None:
        # in place: the log-softmax is this call's own block (a fresh [A, ..., V] block costs
        # its page faults on a CPU)
        logprobs = logprobs.masked_fill_(~mask, float("-inf"))
    if greedy:
        logprobs = torch.where(t == 0, tempered_logprobs(logits, 0.0, mask), logprobs)
    return logprobs


def allowed(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask as bool: a bool mask itself, or, from its uint8 view (what a compiled kernel
    receives, `smc_sd.engine.kernels.compile_kernel`), its bytes compared to zero as floats."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask.to(torch.float32) > 0


def scaling(temperatures) -> bool:
    """Whether some temperature of these (Python floats) is neither 0 nor 1: the `scaled` flag of
    `tempered_logprobs_rows`."""
    return any(t not in (0.0, 1.0) for t in temperatures)


def exp_floored(x: torch.Tensor) -> torch.Tensor:
    """exp(x) where x > F, else 0, elementwise (F = EXP_FLOOR), for float32 x: computed as
    exp(max(x, F)), zeroed where it is at most C = FLOOR_WEIGHT ≈ 4.0e-31. C lies above the
    float32 exp(F) and below the exp of the next float32 above F (-70 + 2^-17), so exactly
    the entries x <= F are zeroed.

    It is exactly 0 where x <= F (-inf included), non-decreasing in x, and within C of exp(x)
    everywhere: for log-weights shifted so that their maximum is 0 (the largest weight 1), a row of
    V entries loses at most V · C of its mass (2e-26 for V = 49,152), far below float32 rounding
    of the total. Every exp it takes is of an argument >= F, on torch's fast path.
    """
    return exp_floored_(x.clamp_min(EXP_FLOOR))


def exp_floored_(x: torch.Tensor) -> torch.Tensor:
    """`exp_floored` in place, for a tensor the caller made and no longer needs.

    While `torch.compile` traces (`smc_sd.engine.kernels`) it is where(x > F, exp(max(x, F)), 0)
    out of place instead, the same values: inductor fuses that into the loop that reads x,
    where the in-place chain made it store the [..., V] exps first."""
    if torch.compiler.is_compiling():
        return torch.where(x > EXP_FLOOR, x.clamp_min(EXP_FLOOR).exp(), 0.0)
    return torch.nn.functional.threshold_(x.clamp_min_(EXP_FLOOR).exp_(), FLOOR_WEIGHT, 0.0)


def logsumexp_floored(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log sum exp(x) along `dim`, as m + log sum exp_floored(x - m) with m the maximum: it
    differs from the exact value by at most V · C relative (`exp_floored`); -inf for a row with
    no finite entry. x holds no NaN or +inf. The terms are formed in the engine's scratch block
    "logsumexp_terms" (`smc_sd.engine.scratch`), and die here."""
    top = x.amax(dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    terms = torch.sub(x, top, out=scratch.block("logsumexp_terms", x))
    return (top + exp_floored_(terms).sum(dim, keepdim=True).log()).squeeze(dim)


def sample_tokens(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from the distribution ∝ exp(scores), by inverse CDF.

    With w = exp(scores - max) (as `exp_floored`: each weight within C ≈ 4e-31 of it, the largest
    being 1, and exactly 0 where a score is 70 or more below the largest), the draw is the
    inverse CDF of w at a uniform fraction of its total (`tokens_from_weights`): P(j) = w_j / sum w
    up to float32 rounding of block sums, and a token of weight zero (an empty step) is never
    drawn. One pass of exp, block sums, small cumulative sums and binary searches: cheaper than
    `torch.multinomial` over 49,152 tokens (`benchmarks/sampling.py`, one thread), and free of
    host synchronisation.

    Args:
        scores: [B, V] float unnormalised log-probabilities; each row has a finite entry.
        generator: the run's random generator (on the scores' device).

    Returns:
        [B] int64 token ids.
    """
    u = torch.rand(scores.shape[:1], generator=generator, dtype=torch.float64, device=scores.device)
    return tokens_from_uniforms(scores, u)


def tokens_from_uniforms(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample_tokens` with its uniforms given: row b's token is the inverse CDF of the weights
    exp(scores[b] - max) at u[b] · (their total) (`tokens_from_weights`).

    Args:
        scores: [B, V] float unnormalised log-probabilities; each row has a finite entry.
        u: [B] float64 uniforms on [0, 1) (a generator's, or `keyed_random.keyed_uniform`).

    Returns:
        [B] int64 token ids.
    """
    return tokens_from_scores(scores, scores.amax(dim=-1, keepdim=True), u)[0]


def tokens_and_logprobs(scores: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens_from_uniforms`' draws and the log-probability of each drawn token, read off the
    weights' total instead of a log-softmax over the vocabulary:

        log P(x) = scores[x] - m - log sum_v w_v,   w_v = exp_floored(scores[v] - m), m = max

    (the probability the draw gave x, up to float rounding: w_x is within C of exp(scores[x] - m)).

    Args:
        scores: [B, V] float32 unnormalised log-probabilities; each row has a finite entry.
        u: [B] float64 uniforms on [0, 1).

    Returns:
        [B] int64 tokens, [B] float32 their log-probabilities.
    """
    top = scores.amax(dim=-1, keepdim=True)
    tokens, total = tokens_from_scores(scores, top, u)
    return tokens, gather_last(scores, tokens) - top.squeeze(-1) - total.log().float()


def tokens_from_scores(scores: torch.Tensor, top: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens_from_weights` of w = exp_floored(scores - top), without keeping w whole: the
    search's block sums are taken over w (formed in the engine's scratch block; compiled, inside
    the loop that reads the scores, with no [B, V] array stored), and the chosen block's BLOCK
    weights are formed again from its scores (the same floats).

    Args:
        scores: [B, V] float32 unnormalised log-probabilities; each row has a finite entry.
        top: [B, 1] float32 each row's maximum score.
        u: [B] float64 uniforms on [0, 1).

    Returns:
        [B] int64 token ids, [B] float64 the weights' totals.
    """
    mass = blocked(exp_floored_(shifted(scores, top)), 0.0).sum(-1)
    return inverse_cdf_in_blocks(mass, lambda block: exp_floored(block_of(blocked(scores, float("-inf")), block) - top), u)


def shifted(scores: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """scores - top in the engine's scratch block for a draw's weights (`smc_sd.engine.scratch`):
    the weights die inside `tokens_from_scores`."""
    return torch.sub(scores, top, out=scratch.block("draw_weights", scores))


def tokens_from_weights(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's token: the inverse CDF of its weights at u[b] · (their total)
    (`inverse_cdf_in_blocks` of their block sums).

    Args:
        weights: [B, V] float32 >= 0; each row has a positive entry.
        u: [B] float64 uniforms on [0, 1).

    Returns:
        [B] int64 token ids, [B] float64 the weights' totals (sum_i S_i).
    """
    blocks = blocked(weights, 0.0)
    return inverse_cdf_in_blocks(blocks.sum(-1), lambda block: block_of(blocks, block), u)


def blocked(values: torch.Tensor, fill: float) -> torch.Tensor:
    """[B, V] as [B, ceil(V / BLOCK), BLOCK], the last block padded with `fill` (a view when
    BLOCK divides V, as it does 49,152 and 128,256)."""
    b, v = values.shape
    return (values if v % BLOCK == 0 else torch.nn.functional.pad(values, (0, -v % BLOCK), value=fill)).view(b, -1, BLOCK)


def block_of(blocks: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Row b's block number block[b, 0] of blocks [B, n, BLOCK], as [B, BLOCK]."""
    return blocks.gather(1, block[..., None].expand(-1, -1, BLOCK)).squeeze(1)


def inverse_cdf_in_blocks(mass: torch.Tensor, weights_in, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse CDF at u[b] · (total) of weights given as block sums and, for the one block
    the search enters, that block's weights.

    The search runs in two levels, so that no [B, V] float64 array is formed: the weights'
    sums S_i over blocks of BLOCK tokens (float32: a sum of 256 non-negative terms, within
    255 · 2^-24 < 2^-16 relative of the exact sum, whatever the order of its additions)
    and their float64 running sums C_i choose the block i with C_{i-1} <= t < C_i,
    t = u · total; within it, the float64 running sums c_j of its weights choose the token j
    with c_{j-1} <= t' < c_j, t' = (t - C_{i-1}) / S_i · c_last, kept below c_last. So
    P(block i) = S_i / total and P(j | i) = w_j / c_last: the token's probability is
    w_j / total within the block sum's float32 rounding (S_i / c_last), and a token of weight
    zero is never drawn (c_j > c_{j-1} for the token chosen).

    Args:
        mass: [B, V / BLOCK] float32 S_i, each block's sum of its weights (0 for a padded entry).
        weights_in: maps [B, 1] int64 block numbers i to [B, BLOCK] float32, those blocks' weights.
        u: [B] float64 uniforms on [0, 1).

    Returns:
        [B] int64 token ids, [B] float64 the weights' totals (sum_i S_i).
    """
    # [B, V / BLOCK]: the running sums C_i in float64
    mass = mass.double()
    cumulative = mass.cumsum(-1)
    total = cumulative[:, -1:]
    t = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # [B, 1]: the block holding t, and the mass before it
    block = torch.searchsorted(cumulative, t, right=True)
    before = torch.where(block > 0, cumulative.gather(-1, (block - 1).clamp(min=0)), 0.0)
    # [B, BLOCK] float64: the running sums c_j inside the block
    inner = weights_in(block).cumsum(-1, dtype=torch.float64)
    last = inner[:, -1:]
    within = torch.minimum((t - before) / mass.gather(-1, block) * last, torch.nextafter(last, torch.zeros_like(last)))
    return (block * BLOCK + torch.searchsorted(inner, within, right=True)).squeeze(-1), total.squeeze(-1)


def gather_last(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[..., index]: the entry of each row's chosen token.

    Args:
        values: [..., V] float.
        index: [...] int64 token ids.

    Returns:
        [...] float.
    """
    return values.gather(-1, index.unsqueeze(-1)).squeeze(-1)
