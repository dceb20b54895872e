"""One accept/reject step for every exact speculative decoding and mask-at-verify request at once.

Request g proposes m_g tokens x_1..x_m (an LM draft's draws from q~, a free draft's point
masses, or none) and the target pass gives p~ after its last token and after each proposed one
(`smc_sd.engine.masking`: p and q masked and renormalised under a constraint). With M the
largest m_g, every request's rule runs in one fixed sequence of tensor operations over [G, M]:

    accept x_k   iff  u_k < p~(x_k) / q~(x_k),   u_k keyed uniforms       (k < m_g)
    j_g        = the first rejected k, or m_g when all are accepted
    emitted    ~ norm(max(0, p~_j - q~_j))  at a rejection,  p~_m  after full acceptance

A free draft's q~ is the point mass on x_k (q~(x_k) = 1; the residual is p~ without x_k). A
position where q~ does not exist (an LM draft under a mask that left it no mass) rejects with
q~ = 0, so the token comes from p~ there: the block ends as if a bonus followed the tokens
before it. The emitted sequence is distributed as p_T (unconstrained) or as the locally
projected prod_t p~(x_t | x_<t) (Leviathan et al. 2022; Chen et al. 2023).

Each uniform is keyed by (request seed, cycle, position, stream) (`smc_sd.engine.keyed_random`),
so a request draws what it draws alone whatever else runs. The new tokens, x_1..x_j then the
emitted one, cut at the first EOS and at the budget, are written into the slot table in one
scatter.

Dimension letters: G requests, M the longest block, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smc_sd.engine import kernels
from smc_sd.engine.keyed_random import ACCEPT, BONUS
from smc_sd.engine.rows import take_positions
from smc_sd.engine.sampling import exp_floored, exp_floored_, gather_last, logsumexp_floored, tempered_logprobs_rows, tokens_from_weights
from smc_sd.engine.smc import block_mask, kept_weight


@dataclass
class ProposedBlock:
    """One sequence's proposal for the cycle.

    Attributes:
        tokens: the m proposed tokens.
        logq: [m, V] float32 log q~ of an LM draft's positions; None for a free draft's point
            masses (and for m = 0).
        masks: [m + 1, V] bool constraint masks after each proposed prefix (the last: the
            emitted token's), or None when unconstrained.
        dead: [m] bool positions where q~ does not exist, or None.
    """

    tokens: list[int]
    logq: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    dead: torch.Tensor | None = None


@dataclass
class Verdict:
    """What the step decided for one request.

    Attributes:
        accepted: proposed tokens kept.
        new: the tokens appended (the kept ones and the emitted one, cut at EOS and budget).
        finished: whether they hold EOS.
        dead: p~ had no mass at the emitted position within the budget (no valid continuation).
    """

    accepted: int
    new: list[int]
    finished: bool
    dead: bool


def speculative_feed(groups: list, table, blocks: list[ProposedBlock]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the requests' target rows read: their last token and their proposal.

    Returns:
        ([G] int64 rows, [G, M + 1] int64 tokens with EOS filler, [G] int64 counts m_g + 1).
    """
    eos = groups[0].eos
    width = 1 + max(len(b.tokens) for b in blocks)
    feed = [[g.tokens[-1]] + b.tokens + [eos] * (width - 1 - len(b.tokens)) for g, b in zip(groups, blocks)]
    rows = table.target_row[torch.tensor([g.slot for g in groups])]
    return rows, torch.tensor(feed), torch.tensor([1 + len(b.tokens) for b in blocks])


def first_rejections(log_ratio: torch.Tensor, lengths: torch.Tensor, u: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
    """j_g: the first proposed position rejected, or m_g when every one is accepted.

    Args:
        log_ratio: [G, M] float32 log p~(x_k) - log q~(x_k).
        lengths: [G] int64 m_g (columns from m_g on are padding).
        u: [G, M] float64 acceptance uniforms.
        dead: [G, M] bool positions where q~ does not exist (rejected), or None.

    Returns:
        [G] int64.
    """
    g, m = log_ratio.shape
    rejected = (u.log() >= log_ratio.double()) | (torch.arange(m)[None, :] >= lengths[:, None])
    if dead is not None:
        rejected |= dead
    # a last column that always rejects: the first True is at most M
    return torch.cat([rejected, torch.ones(g, 1, dtype=torch.bool)], 1).int().argmax(1)


def emit_tokens(logp: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The emitted token of each row: a draw from norm(max(0, p~ - q)) by inverse CDF at u.

    q is q~ at a rejected position and 0 after full acceptance (a bonus from p~). A rejection
    needs p~(x) < q~(x), so in exact arithmetic the residual has mass; where float32 leaves it
    none, p~ = q~ to rounding and the law of the emitted token, q~ min(1, p~/q~) + (rejection
    mass) · residual, is p~'s: the token is drawn from p~.

    Args:
        logp: [G, V] float32 log p~ at each row's emitted position; each row has mass (an entry
            above `EXP_FLOOR`: `accept_rows` gives a position without mass a flat row).
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
    rows = torch.arange(p.shape[0])
    at_token = p[rows, token]
    kept = torch.where(point, 0.0, at_token)
    p[rows, token] = kept
    # a row left without mass is a point row whose p~ was 1[x]: x takes its weight back
    p[rows, token] = torch.where(point & (p.sum(-1) == 0), at_token, kept)
    return tokens_from_weights(p, u)[0]


@dataclass
class Decisions:
    """The accept/reject outcome of R particles (`accept_rows`).

    Attributes:
        drafted: [R, M] int64 each particle's proposal (0 as padding).
        accepted: [R] int64 j: proposed tokens kept.
        emitted: [R] int64 the token emitted after them.
        log_z: [R, M + 1] float64 log Z at each position: log sum_v p_T(v)^alpha m(v).
    """

    drafted: torch.Tensor
    accepted: torch.Tensor
    emitted: torch.Tensor
    log_z: torch.Tensor


def accept_rows(packed: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, blocks: list[ProposedBlock], temperatures: list[float], alphas: list[float], owner: torch.Tensor, request_keys: torch.Tensor, cycles: torch.Tensor, particles: torch.Tensor) -> Decisions:
    """The accept/reject rule of R particles on the local target q_loc = p_T^alpha m / Z.

    Computed rows (U of them, each a target row with its proposal) hold q_loc; particles that
    hold equal tokens share a computed row (`owner`) but draw their own uniforms, keyed by
    (seed, cycle, particle, position).

    Args:
        packed: [T, V] float32 target logits row after row; starts: [B + 1] int64.
        rows: [U] int64 the computed rows (each read its last token and its proposal).
        blocks: per computed row its ProposedBlock (m_u tokens).
        temperatures, alphas: per computed row T and alpha.
        owner: [R] int64 each particle's computed row.
        request_keys, cycles, particles: [R] int64 each particle's keys.

    Returns:
        the Decisions of every particle.
    """
    vocab = packed.shape[-1]
    lengths_list = [len(b.tokens) for b in blocks]
    u_rows, m = len(blocks), max(lengths_list)
    lengths = torch.tensor(lengths_list)
    widths = lengths + 1
    columns = torch.arange(m + 1)
    # the P = sum(m_u + 1) positions the rows read, row after row: each one's packed index, and
    # [U, M + 1] where each (row, column) stands among them (P past a row's end)
    first = widths.cumsum(0) - widths
    count = sum(lengths_list) + u_rows
    at = torch.repeat_interleave(starts[rows] - first, widths) + torch.arange(count)
    position = torch.where(columns[None, :] < widths[:, None], first[:, None] + columns, count)
    # [P, V]: the logits of those positions only (no padding to the longest proposal); a view
    # where they are consecutive
    logits = take_positions(packed, at)
    mask = None
    if any(b.masks is not None for b in blocks):
        mask = torch.cat([b.masks if b.masks is not None else torch.ones(len(b.tokens) + 1, vocab, dtype=torch.bool) for b in blocks])
    temperature = torch.tensor(temperatures, dtype=torch.float32).repeat_interleave(widths)
    # [P, V]: alpha log p_T + log m (q_loc unnormalised); [P]: log Z
    scores = tempered_logprobs_rows(logits, temperature, mask, 0.0 in temperatures, scratch_purpose="accept_logp")
    if any(a != 1.0 for a in alphas):
        scores = torch.tensor(alphas, dtype=torch.float32).repeat_interleave(widths)[:, None] * scores
    # a row unmasked at alpha = 1 has q_loc = p_T itself: log Z = 0 (computed only for the others)
    plain = [b.masks is None and a == 1.0 for b, a in zip(blocks, alphas)]
    log_z = torch.zeros(count)
    if not all(plain):
        log_z = torch.where(torch.tensor(plain).repeat_interleave(widths), 0.0, logsumexp_floored(scores, -1))
    no_mass = log_z == float("-inf")
    # log q_loc at a position; one without mass gets a flat row (its particle's weight, or its
    # request, dies; the draw only keeps shapes)
    finite_z = torch.where(no_mass, 0.0, log_z)
    # [U, M + 1] float64: log Z at each (row, column), -inf past a row's end
    log_z_rows = torch.cat([log_z.double(), torch.tensor([float("-inf")], dtype=torch.float64)])[position]
    # [U, M]: proposed tokens (0 as padding) and log q~ of each (0: a point mass)
    drafted = torch.tensor([b.tokens + [0] * (m - len(b.tokens)) for b in blocks], dtype=torch.int64).view(u_rows, m)
    logq_x = torch.zeros(u_rows, m)
    lm = [i for i, b in enumerate(blocks) if b.logq is not None]
    dead = None
    if lm:
        logq_x[lm] = _padded([gather_last(blocks[i].logq, drafted[i, : lengths_list[i]]) for i in lm], m)
        if any(blocks[i].dead is not None for i in lm):
            dead = torch.zeros(u_rows, m, dtype=torch.bool)
            dead[lm] = _padded([blocks[i].dead if blocks[i].dead is not None else torch.zeros(lengths_list[i], dtype=torch.bool) for i in lm], m).bool()
    # [U, M]: log q_loc(x_k) at each proposed position; a position without mass rejects
    inside = columns[None, :m] < lengths[:, None]
    flat = position[:, :m].clamp(max=count - 1)
    log_q_loc = torch.where(inside, scores[flat, drafted] - finite_z[flat], float("-inf"))
    log_ratio = torch.where(no_mass[flat], float("-inf"), log_q_loc - logq_x)[owner]
    uniforms = kernels.current().keyed_uniforms
    u = uniforms(request_keys[:, None], cycles[:, None], particles[:, None], columns[None, :m], ACCEPT)
    j = first_rejections(log_ratio, lengths[owner], u, None if dead is None else dead[owner])
    rejected = j < lengths[owner]
    # [R]: the particles whose rejected token was proposed by a point mass (a free draft)
    point = rejected & torch.tensor([b.logq is None for b in blocks])[owner]
    # [R, V]: log q_loc at each particle's emitted position (flat where it has no mass), formed
    # in place: in `scores` itself where the positions are consecutive (scores is not read after)
    emitted_at = position[owner, j]
    logp = take_positions(scores, emitted_at).sub_(finite_z[emitted_at, None]).masked_fill_(no_mass[emitted_at, None], 0.0)
    u_emit = uniforms(request_keys, cycles, particles, j, BONUS)
    # [R]: the token each particle's draft proposed at j (0 past the block: no point there)
    at_j = torch.nn.functional.pad(drafted, (0, 1))[owner, j]
    if not lm:
        return Decisions(drafted[owner], j, emit_past_point_masses(logp, at_j, point if m else None, u_emit), log_z_rows[owner])
    # [R, V]: q~ at each rejected position (0 where all were accepted or q~ does not exist)
    q = torch.zeros(owner.numel(), vocab)
    q[point, at_j[point]] = 1.0
    # LM drafts' q~ rows stacked [sum of their m, V], and where each computed row's begin
    logq_rows = torch.cat([blocks[i].logq for i in lm])
    begins = torch.zeros(u_rows, dtype=torch.int64)
    begins[lm] = torch.tensor([0] + [lengths_list[i] for i in lm][:-1]).cumsum(0)
    drawn = rejected & ~point
    if dead is not None:
        drawn &= ~dead[owner, j.clamp(max=m - 1)]
    q[drawn] = exp_floored(logq_rows[begins[owner[drawn]] + j[drawn]])
    return Decisions(drafted[owner], j, emit_tokens(logp, q, u_emit), log_z_rows[owner])


def append_rows(table, slots: torch.Tensor, generated: list[int], budget: list[int], decisions: Decisions, eos: int, weighted: bool) -> tuple[list[list[int]], list[bool], list[list[float]]]:
    """Write each particle's new tokens (x_1..x_j, then the emitted one; cut after the first
    EOS and at the budget) into its slot; with `weighted`, add the log Z of each kept position
    to its log weight. A particle that finished drops its rows.

    Args:
        slots: [R] int64; generated, budget: per particle its tokens so far and its budget.

    Returns:
        per particle its new tokens, whether they hold EOS, and the log Z terms of the
        positions kept (read back in one transfer).
    """
    drafted, j = decisions.drafted, decisions.accepted
    r, m = drafted.shape
    columns = torch.arange(m + 1)
    # [R, M + 1]: the kept proposed tokens, the emitted one at column j, EOS filler after it
    new = torch.where(columns[None, :] < j[:, None], torch.cat([drafted, drafted.new_zeros(r, 1)], 1), eos)
    new[torch.arange(r), j] = decisions.emitted
    start = torch.tensor(generated)
    # [R, M + 1]: the columns appended: through the first EOS, at most j + 1, within the budget
    kept = block_mask(new, torch.zeros(r, dtype=torch.bool), eos, torch.tensor(budget)) & (columns[None, :] <= j[:, None])
    count = kept.sum(1)
    finished = ((new == eos) & kept).any(1)
    table.tokens[slots[:, None].expand(-1, m + 1)[kept], (start[:, None] + columns)[kept]] = new[kept]
    table.length[slots] = start + count
    table.finished[slots] = finished
    if weighted:
        table.logw[slots] += kept_weight(kept, decisions.log_z)
    table.target_row[slots[finished]] = -1
    table.draft_row[slots[finished]] = -1
    counts = count.tolist()
    tokens = [row[:c] for row, c in zip(new.tolist(), counts)]
    terms = [row[:c] for row, c in zip(decisions.log_z.tolist(), counts)]
    return tokens, finished.tolist(), terms


def verify_speculative_rows(groups: list, table, packed: torch.Tensor, starts: torch.Tensor, blocks: list[ProposedBlock]) -> list[Verdict]:
    """Accept or reject every request's proposal in one pass and append the new tokens.

    Args:
        groups: G `SpeculativeGroup`s (one sequence each).
        table: the engine's `SlotTable` (tokens, length, finished and rows of their slots are
            written).
        packed: [T, V] float32, the target pass's logits row after row; starts: [B + 1] int64
            (request g's row read its last token and its m_g proposed ones).
        blocks: each request's `ProposedBlock`.

    Returns:
        one Verdict per request.
    """
    g = len(groups)
    slots = torch.tensor([gr.slot for gr in groups])
    request_keys = torch.tensor([gr.key for gr in groups], dtype=torch.int64)
    cycles = torch.tensor([len(gr.cycles) for gr in groups], dtype=torch.int64)
    temperatures = [gr.plan.target_temperature for gr in groups]
    decisions = accept_rows(packed, starts, table.target_row[slots], blocks, temperatures, [gr.plan.alpha for gr in groups], torch.arange(g), request_keys, cycles, torch.zeros(g, dtype=torch.int64))
    budget = [gr.plan.max_tokens - gr.generated for gr in groups]
    # p~ without mass where the token is emitted, within the budget: no valid continuation
    dead = ((decisions.log_z[torch.arange(g), decisions.accepted] == float("-inf")) & (decisions.accepted < torch.tensor(budget))).tolist()
    tokens, finished, _ = append_rows(table, slots, [gr.generated for gr in groups], budget, decisions, groups[0].eos, weighted=False)
    return [Verdict(a, t, f, d) for a, t, f, d in zip(decisions.accepted.tolist(), tokens, finished, dead)]


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D tensors of lengths <= width, zero-padded: [R, width]."""
    return torch.stack([torch.cat([r, r.new_zeros(width - r.numel())]) for r in rows])
