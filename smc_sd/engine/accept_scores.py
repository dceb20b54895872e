"""The tensor core of an accept/reject verification: the local target's normalisers, the first
rejections and the emitted tokens of any number of particles (`accept_scores`).

Every accept/reject verification computes its decisions here (`speculative_step.accept_rows`:
sd, mask-at-verify, and SMC-SD with a free draft). With s_p = alpha_p · log p_{T_p} + log m_p
at position p (the local target q_loc = exp(s_p) / Z_p unnormalised; T_p = 0 the greedy point
mass) and a particle r verifying the row u(r):

    log Z_p       = log sum_v exp(s_p(v))                  (0 by construction where m_p = 1, alpha_p = 1)
    ratio[r, k]   = s(x_k) - log Z - log q~(x_k)           at u(r)'s k-th position (k < m_u)
    j_r           = the first k with u_accept[r, k] >= exp(ratio[r, k]), or m_u
    emitted_r     ~ norm(max(0, q_loc - q~))  at u(r)'s position j_r  (q~ = 0 after full acceptance)

q~ is a point mass 1[x] for a free draft's token (its residual is q_loc without x) and the draft
LM's q~ for an LM draft's. A position without mass (Z_p = 0) rejects and draws from a flat row:
its particle's weight, or its request, is zero.

Shapes are fixed by the arguments and nothing is read back to the host, so the function can be
compiled (`smc_sd.engine.kernels`): compiled, the log-softmax, the masks, both normalising sums
and the emitted rows' draws run as fused loops over the positions' logits.

Dimension letters: P positions, U computed rows (each with its proposal), M the longest
proposal, R particles, L the LM drafts' proposed positions, V vocabulary.
"""

from __future__ import annotations

import torch

from smc_sd.engine.rows import take_positions
from smc_sd.engine.sampling import exp_floored, exp_floored_, logsumexp_floored, tempered_logprobs_rows, tokens_from_weights


def accept_scores(
    logits: torch.Tensor,
    position: torch.Tensor,
    temperature: torch.Tensor,
    alpha: torch.Tensor | None,
    mask: torch.Tensor | None,
    weighted: torch.Tensor | None,
    drafted: torch.Tensor,
    lengths: torch.Tensor,
    drafts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None,
    owner: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    greedy: bool,
    scaled: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every particle's first rejection, emitted token and the log Z of its row's positions.

    Args:
        logits: [P, V] float32 the target's logits at the positions, row after row.
        position: [U, M + 1] int64 where each (row, column) stands among the P positions (P
            past a row's end).
        temperature: [P] float32 T >= 0; alpha: [P] float32, or None when every alpha is 1.
        mask: [P, V] bool constraint masks, or None when unconstrained.
        weighted: [P] bool the positions whose log Z is computed (a constraint, or alpha != 1;
            the others' is 0), or None when no position's is.
        drafted: [U, M] int64 each row's proposal (0 as padding); lengths: [U] int64 m_u.
        drafts: the LM drafts' proposals, or None when every proposal is a free draft's point
            masses: (logq_x [U, M] float32 log q~(x_k) (0 on point-mass rows), lm [U] bool the
            rows an LM drafted, dead [U, M] bool positions where q~ does not exist (or None),
            logq [L, V] float32 the LM drafts' q~ rows stacked, begins [U] int64 where each
            row's begin among them).
        owner: [R] int64 each particle's row.
        u_accept: [R, M] float64 acceptance uniforms; u_emit: [R, M + 1] float64 the uniform of
            an emission at each column.
        greedy: whether some T is 0; scaled: whether some T is neither 0 nor 1.

    Returns:
        j [R] int64 the proposed tokens kept, emitted [R] int64, log_z [R, M + 1] float64 log Z
        at each of the particle's row's positions (-inf past its end).
    """
    count, m = logits.shape[0], drafted.shape[1]
    # [P, V]: s = alpha log p_T + log m
    scores = tempered_logprobs_rows(logits, temperature, mask, greedy, scaled, scratch_purpose="accept_logp")
    if alpha is not None:
        scores = alpha[:, None] * scores
    # [P]: log Z, -inf at a position without mass
    log_z = torch.zeros(count, device=logits.device)
    if weighted is not None:
        log_z = torch.where(weighted, logsumexp_floored(scores, -1), 0.0)
    no_mass = log_z == float("-inf")
    finite_z = torch.where(no_mass, 0.0, log_z)
    # [U, M + 1] float64: log Z at each (row, column), -inf past a row's end
    log_z_rows = torch.cat([log_z.double(), torch.full((1,), float("-inf"), dtype=torch.float64, device=logits.device)])[position]
    # [U, M]: log q_loc(x_k) at each proposed position; a position without mass rejects
    columns = torch.arange(m, device=logits.device)
    inside = columns[None, :] < lengths[:, None]
    flat = position[:, :m].clamp(max=count - 1)
    log_q_loc = torch.where(inside, scores[flat, drafted] - finite_z[flat], float("-inf"))
    logq_x = 0.0 if drafts is None else drafts[0]
    log_ratio = torch.where(no_mass[flat], float("-inf"), log_q_loc - logq_x)[owner]
    dead = None if drafts is None or drafts[2] is None else drafts[2][owner]
    # [R]: each particle's proposal length, its first rejection, and whether it rejected one
    proposed = lengths[owner]
    j = first_rejections(log_ratio, proposed, u_accept, dead)
    rejected = j < proposed
    u = u_emit.gather(1, j[:, None])[:, 0]
    # [R, V]: q_loc at each particle's emitted position (flat where it has no mass)
    emitted_at = position[owner, j]
    if torch.compiler.is_compiling():
        logp = (scores[emitted_at] - finite_z[emitted_at, None]).masked_fill_(no_mass[emitted_at, None], 0.0)
    else:
        # eagerly in place, in `scores` itself where the positions are consecutive (it is not
        # read after): no fresh [R, V] block; the rows without mass (rare) are set by index,
        # not by a masked pass over every row
        logp = take_positions(scores, emitted_at).sub_(finite_z[emitted_at, None])
        logp.index_fill_(0, no_mass[emitted_at].nonzero().flatten(), 0.0)
    # [R]: the token the row's proposal holds at j (0 past the block)
    at_j = torch.nn.functional.pad(drafted, (0, 1))[owner, j]
    if drafts is None:
        # eagerly, a cycle where no particle rejected a point mass draws from q_loc directly
        point = rejected if torch.compiler.is_compiling() or bool(rejected.any()) else None
        return j, emit_past_point_masses(logp, at_j, point, u), log_z_rows[owner]
    _, lm, _, logq, begins = drafts
    point = rejected & ~lm[owner]
    drawn = rejected & lm[owner]
    if dead is not None:
        drawn &= ~dead.gather(1, j.clamp(max=m - 1)[:, None])[:, 0]
    # [R, V]: q~ at each rejected position (0 where all were accepted or q~ does not exist)
    q = torch.where(drawn[:, None], exp_floored(logq[(begins[owner] + j).clamp(max=logq.shape[0] - 1)]), 0.0)
    q[point, at_j[point]] = 1.0
    return j, emit_tokens(logp, q, u), log_z_rows[owner]


def first_rejections(log_ratio: torch.Tensor, lengths: torch.Tensor, u: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
    """j: the first proposed position rejected, or m when every one is accepted.

    Args:
        log_ratio: [R, M] float32 log q_loc(x_k) - log q~(x_k).
        lengths: [R] int64 m (columns from m on are padding).
        u: [R, M] float64 acceptance uniforms.
        dead: [R, M] bool positions where q~ does not exist (rejected), or None.

    Returns:
        [R] int64.
    """
    r, m = log_ratio.shape
    rejected = (u.log() >= log_ratio.double()) | (torch.arange(m, device=u.device)[None, :] >= lengths[:, None])
    if dead is not None:
        rejected |= dead
    # a last column that always rejects: the first True is at most M
    return torch.cat([rejected, torch.ones(r, 1, dtype=torch.bool, device=u.device)], 1).int().argmax(1)


def emit_tokens(logp: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The emitted token of each row: a draw from norm(max(0, p~ - q)) by inverse CDF at u.

    q is q~ at a rejected position and 0 after full acceptance (a bonus from p~). A rejection
    needs p~(x) < q~(x), so in exact arithmetic the residual has mass; where float32 leaves it
    none, p~ = q~ to rounding and the law of the emitted token, q~ min(1, p~/q~) + (rejection
    mass) · residual, is p~'s: the token is drawn from p~.

    Args:
        logp: [G, V] float32 log p~ at each row's emitted position; each row has mass (an entry
            above `EXP_FLOOR`: `accept_scores` gives a position without mass a flat row).
        q: [G, V] float32 q~ there (0 for a bonus).
        u: [G] float64 uniforms.

    Returns:
        [G] int64 tokens.
    """
    p = exp_floored(logp)
    residual = (p - q).clamp_min_(0.0)
    return tokens_from_weights(torch.where(residual.sum(-1, keepdim=True) > 0, residual, p), u)[0]


def emit_past_point_masses(logp: torch.Tensor, token: torch.Tensor, point: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """`emit_tokens` where q~ is a point mass 1[token] on the rows `point` and 0 on the others,
    without forming q: max(0, p~ - 1[x]) is p~ with its entry x set to 0 (p~(x) <= 1), and
    where that leaves no float32 mass (p~ the point mass on x, to rounding) the row draws from p~
    itself, as `emit_tokens` does. The weights are the same floats as `emit_tokens`' with the
    one-hot q, so the tokens are the same.

    Args:
        logp: [G, V] float32 log p~, a tensor the caller no longer reads (overwritten); each
            row has mass.
        token: [G] int64 x, the point mass's token (read on the `point` rows only).
        point: [G] bool the rows whose q~ is 1[x], or None when no row's is (no block drafted).
        u: [G] float64 uniforms.

    Returns:
        [G] int64 tokens.
    """
    p = exp_floored_(logp)
    if point is None:
        return tokens_from_weights(p, u)[0]
    rows = torch.arange(p.shape[0], device=p.device)
    at_token = p[rows, token]
    kept = torch.where(point, 0.0, at_token)
    p[rows, token] = kept
    # a row left without mass is a point row whose p~ was 1[x]: x takes its weight back
    p[rows, token] = torch.where(point & (p.sum(-1) == 0), at_token, kept)
    return tokens_from_weights(p, u)[0]
