"""The tensor core of an importance verification: a block's scores, bonus draw and weight
increments for any number of rows (`score_rows`).

Every SMC-SD verification computes its block here: the batched step over every request
(`smc_sd.engine.importance_step`) and a request verified on its own
(`smc_sd.engine.smc.verify_block`). One place computes the increments the weights add:

    inc[a, k] = alpha_a · log p_{T_a}(x_k | after k drafted tokens) - log q~_a(x_k)   (k < K)
    inc[a, K] = log Z_a,   Z_a = sum_v p_{T_a}(v | after K)^alpha_a m_a(v)

with the bonus token drawn from p_{T_a}^alpha_a m_a / Z_a (the constraint's mask m_a).
"""

from __future__ import annotations

import math

import torch

from smc_sd.engine import scratch
from smc_sd.engine.sampling import gather_last, logsumexp_floored, tempered_logprobs_rows, tokens_from_uniforms


def score_rows(logits: torch.Tensor, temperature: torch.Tensor, alpha: torch.Tensor | None, bonus_mask: torch.Tensor | None, drafted: torch.Tensor, drawn_logq: torch.Tensor, dead: torch.Tensor | None, u: torch.Tensor, weighted_bonus: torch.Tensor | None, greedy: bool, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor core of the verification: every row's block and weight increments, from its
    logits, settings, drafted tokens and bonus uniform alone (no table, no Python per row).

    With s_a = alpha_a · log p_{T_a} (`tempered_logprobs_rows`; T_a = 0 the greedy point mass)
    and m_a the bonus mask (all ones when None):

        inc[a, k] = s_a(x_k | after k drafted tokens) - log q~_a(x_k),   k < K
                    (-inf where dead[a, k]: q~ did not exist there)
        inc[a, K] = log Z_a,   Z_a = sum_v exp(s_a(v | after K)) m_a(v)   (`logsumexp_floored`)
        bonus_a   = inverse CDF at u_a of exp(s_a(. | after K)) m_a / Z_a (`tokens_from_uniforms`);
                    a row whose mask leaves no mass (Z_a = 0) draws unmasked, to keep shapes, and
                    its inc[a, K] = -inf gives it weight zero.

    Z_a = 1 exactly for a row whose bonus is drawn from p_{T_a} itself (no constraint, alpha_a =
    1): its inc[a, K] is 0, not a float32 logsumexp of a log-softmax (within 1e-7 of 0). alpha
    multiplies the gathered scores and the bonus row only, and a temperature of 1 divides
    nothing: multiplying or dividing a float by 1 leaves it unchanged, so these shortcuts give
    the same bits as the full passes over [A, K + 1, V]. A block of the bonus alone (K = 0, as
    ar's) whose every row draws from p_{T_a} itself at T_a > 0 takes no log-softmax: its bonus is
    drawn from z_a = logits_a / T_a, which differs from log p_{T_a} by a constant per row (the
    same distribution; the draw's shift to the maximum rounds differently).

    Shapes are fixed by the arguments and nothing is read back to the host, so the function can
    be compiled (`torch.compile`, tests/test_compiled_step.py); the branches are on arguments
    that are None or not and on `greedy` and `scaled`, static per compiled graph.

    Args:
        logits: [A, K + 1, V] float32 target logits after each row's last token and after each
            drafted token.
        temperature: [A] float32 each row's target temperature T_a >= 0.
        alpha: [A] float32 each row's power alpha_a, or None when every alpha_a is 1.
        bonus_mask: [A, V] bool allowed bonus tokens, or None (all allowed).
        drafted: [A, K] int64 drafted tokens; drawn_logq: [A, K] float32 log q~(x_k) of each
            (`DraftBlock.drawn_logq`); dead: [A, K] bool or None.
        u: [A] float64 uniforms on [0, 1), the bonus draws.
        weighted_bonus: [A] bool, the rows whose Z_a is not 1 by construction (a constraint, or
            alpha_a != 1), or None when no row's is.
        greedy: whether some T_a is 0; scaled: whether some T_a is neither 0 nor 1 (both known
            from the plans, not read from `temperature`).

    Returns:
        block [A, K + 1] int64 (the drafted tokens, then the bonus), increments [A, K + 1]
        float64.
    """
    k = drafted.shape[1]
    if k == 0 and alpha is None and bonus_mask is None and weighted_bonus is None and not greedy:
        # [A, V]: the tempered logits, in the engine's scratch block (they die in the draw)
        z = torch.div(logits[:, 0], temperature[:, None], out=scratch.block("bonus_tempered", logits[:, 0])) if scaled else logits[:, 0]
        return tokens_from_uniforms(z, u)[:, None], torch.zeros(drafted.shape[0], 1, dtype=torch.float64, device=logits.device)
    # [A, K + 1, V]: log p_T at every position (one contiguous pass: a log-softmax of the
    # drafted positions alone, a strided view, would copy them first)
    logp = tempered_logprobs_rows(logits, temperature, greedy=greedy, scaled=scaled, scratch_purpose="block_logp")
    bonus_scores = drawn_from = logp[:, k] if alpha is None else alpha[:, None] * logp[:, k]
    if bonus_mask is not None:
        # [A, V]: the bonus token's scores under each row's mask
        masked = tempered_logprobs_rows(logits[:, k], temperature, bonus_mask, greedy, scaled)
        bonus_scores = masked if alpha is None else alpha[:, None] * masked
        # a row the mask leaves without mass draws unmasked, to keep shapes; its weight is zero
        drawn_from = torch.where(bonus_scores.amax(-1, keepdim=True) > float("-inf"), bonus_scores, drawn_from)
    bonus = tokens_from_uniforms(drawn_from, u)
    # [A, K]: each drafted token's score less its draft log-probability
    drafted_scores = gather_last(logp[:, :k], drafted)
    drafted_increments = (drafted_scores if alpha is None else alpha[:, None] * drafted_scores) - drawn_logq
    if dead is not None:
        drafted_increments = drafted_increments.masked_fill(dead, -math.inf)
    if weighted_bonus is None:
        log_z = torch.zeros(drafted.shape[0], dtype=torch.float64, device=logits.device)
    else:
        log_z = torch.where(weighted_bonus, logsumexp_floored(bonus_scores, -1).double(), 0.0)
    block = torch.cat([drafted, bonus[:, None]], 1)
    increments = torch.cat([drafted_increments.double(), log_z[:, None]], 1)
    return block, increments
