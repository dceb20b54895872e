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
from smc_sd.engine.sampling import gather_last, scaling
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
    # U padded to at least 2 rows (an empty one that no particle owns) and M to at least 2
    # columns: dynamo compiles a graph apart for sizes 0 and 1, and free drafts move between
    # them from cycle to cycle (`smc_sd.engine.kernels`)
    if len(blocks) < 2:
        rows, blocks, temperatures, alphas = torch.cat([rows, rows]), blocks + [ProposedBlock([])], temperatures * 2, alphas * 2
    lengths_list = [len(b.tokens) for b in blocks]
    u_rows, m = len(blocks), max(max(lengths_list), 2)
    lengths = torch.tensor(lengths_list)
    widths = lengths + 1
    columns = torch.arange(m + 1)
    # the P = sum(m_u + 1) positions the rows read, row after row: each one's packed index, and
    # [U, M + 1] where each (row, column) stands among them (P past a row's end)
    first = widths.cumsum(0) - widths
    count = sum(lengths_list) + u_rows
    at = torch.repeat_interleave(starts[rows] - first, widths) + torch.arange(count)
    position = torch.where(columns[None, :] < widths[:, None], first[:, None] + columns, count)
    mask = None
    if any(b.masks is not None for b in blocks):
        mask = torch.cat([b.masks if b.masks is not None else torch.ones(len(b.tokens) + 1, vocab, dtype=torch.bool) for b in blocks])
    temperature = torch.tensor(temperatures, dtype=torch.float32).repeat_interleave(widths)
    alpha = None
    if any(a != 1.0 for a in alphas):
        alpha = torch.tensor(alphas, dtype=torch.float32).repeat_interleave(widths)
    # a row unmasked at alpha = 1 has q_loc = p_T itself: log Z = 0 (computed only for the others)
    plain = [b.masks is None and a == 1.0 for b, a in zip(blocks, alphas)]
    weighted = None if all(plain) else ~torch.tensor(plain).repeat_interleave(widths)
    # [U, M]: proposed tokens (0 as padding)
    drafted = torch.tensor([b.tokens + [0] * (m - len(b.tokens)) for b in blocks], dtype=torch.int64).view(u_rows, m)
    cores = kernels.current()
    u_accept = cores.keyed_uniforms(request_keys[:, None], cycles[:, None], particles[:, None], columns[None, :m], ACCEPT)
    u_emit = cores.keyed_uniforms(request_keys[:, None], cycles[:, None], particles[:, None], columns[None, :], BONUS)
    # [P, V]: the logits of those positions only (no padding to the longest proposal); a view
    # where they are consecutive
    j, emitted, log_z = cores.accept_scores(
        take_positions(packed, at), position, temperature, alpha, mask, weighted, drafted, lengths,
        _lm_drafts(blocks, drafted, lengths_list), owner, u_accept, u_emit, 0.0 in temperatures, scaling(temperatures),
    )
    return Decisions(drafted[owner], j, emitted, log_z)


def _lm_drafts(blocks: list[ProposedBlock], drafted: torch.Tensor, lengths: list[int]) -> tuple | None:
    """`accept_scores`' `drafts` argument: the LM drafts' log q~ of each proposed token, their
    rows, dead positions and q~ rows, or None when no LM draft proposed a token."""
    lm = [i for i, b in enumerate(blocks) if b.logq is not None and lengths[i]]
    if not lm:
        return None
    u_rows, m = drafted.shape
    logq_x = torch.zeros(u_rows, m)
    logq_x[lm] = _padded([gather_last(blocks[i].logq, drafted[i, : lengths[i]]) for i in lm], m)
    dead = None
    if any(blocks[i].dead is not None for i in lm):
        dead = torch.zeros(u_rows, m, dtype=torch.bool)
        dead[lm] = _padded([blocks[i].dead if blocks[i].dead is not None else torch.zeros(lengths[i], dtype=torch.bool) for i in lm], m).bool()
    is_lm = torch.zeros(u_rows, dtype=torch.bool)
    is_lm[lm] = True
    # the LM drafts' q~ rows stacked [L, V], and where each row's begin among them
    begins = torch.zeros(u_rows, dtype=torch.int64)
    begins[lm] = torch.tensor([0] + [lengths[i] for i in lm][:-1]).cumsum(0)
    return logq_x, is_lm, dead, torch.cat([blocks[i].logq for i in lm]), begins


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
