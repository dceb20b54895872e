"""SMC-SD with free drafts: SMC with the locally optimal proposal, made fast by model-free drafts.

The target is SMC-SD's, pi(x) ∝ p_T(x)^alpha · phi(x) (phi the constraints, 0 on strings the
budget leaves incomplete). A deterministic free draft cannot be SMC's proposal: it would cut the
target's support (other tokenizations of the same bytes). Instead every particle is extended by
exact speculative sampling of the locally masked target

    q_loc(v | x) = p_T(v | x)^alpha m(v | x) / Z(x),     Z(x) = sum_v p_T(v | x)^alpha m(v | x),

with its free draft d as the (point-mass) draft: d_j is accepted with probability q_loc(d_j),
else the residual q_loc without d_j is drawn and the block ends; a fully accepted block ends with
a bonus token from q_loc. Because the draft is a function of the prefix, which tokens were
accepted is a function of the tokens, and the extension e_1..e_n a block emits has probability
prod_j q_loc(e_j | x, e_<j) exactly. Its importance weight is therefore

    log w += sum_j log Z(x, e_<j)            (one term per emitted position),

the local normalisers (0 without constraints at alpha = 1: the particles are then independent
exact samples of p_T). The first token, block-end potentials and twist, ESS, resampling, log
Z_hat and the end of the run are SMC-SD's (`smc_sd.engine.smc`; the batched engine's
`FreeImportanceGroup` runs both): any extension kernel whose weight is the ratio of the target to
its law leaves SMC's laws intact, so potentials and twists compose as with a draft LM.

Particles differ in length within a cycle: one target pass extends every running row by the
longest proposal plus one (the token the target has not read), and each row keeps what its
particle accepted. A particle reaching weight zero stops running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from smc_sd.engine.free_drafts import FreeDrafter, allowed_prefix
from smc_sd.engine.speculative_step import ProposedBlock, accept_rows, append_rows


def proposals(plan, drafter: FreeDrafter, tokens: list[list[int]], running: list[int]) -> tuple[list[list[int]], list, list[int]]:
    """The free draft's proposal of every running particle, cut at the first refused token, and
    the masks at each of its positions (all particles' in one mask call).

    Returns:
        (proposals, masks, forced): per running particle its tokens d, [len(d) + 1, V] bool
        masks (None when unconstrained) and how many of d's leading tokens are forced.
    """
    proposed, forced = zip(*[drafter.propose(tokens[i], plan.max_tokens - len(tokens[i])) for i in running]) if running else ((), ())
    proposed = list(proposed)
    if plan.masker is None:
        return proposed, [None] * len(running), list(forced)
    prefixes = [tokens[i] + d[:j] for i, d in zip(running, proposed) for j in range(len(d) + 1)]
    # [sum (len(d) + 1), V]: one call for every position of every particle
    masks, _ = plan.masker(prefixes, [True] * len(prefixes))
    out, start = [], 0
    for d in proposed:
        rows = masks[start : start + len(d) + 1]
        start += len(d) + 1
        kept = allowed_prefix(d, rows)
        out.append((d[:kept], rows[: kept + 1]))
    return [d for d, _ in out], [m for _, m in out], [min(f, len(d)) for f, (d, _) in zip(forced, out)]


def distinct_rows(tokens: list[list[int]], running: list[int]) -> tuple[list[int], list[int]]:
    """The rows of the running particles that hold distinct tokens, and each row's copy.

    Returns:
        (distinct, copy_of): the positions in `running` of the first particle of each distinct
        token list, and for every position r in `running` the index into `distinct` of its tokens.
    """
    first: dict[tuple[int, ...], int] = {}
    distinct, copy_of = [], []
    for r, i in enumerate(running):
        key = tuple(tokens[i])
        if key not in first:
            first[key] = len(distinct)
            distinct.append(r)
        copy_of.append(first[key])
    return distinct, copy_of


def running_particles(plan, tokens: list[list[int]], alive: list[bool], ended: list[bool]) -> list[int]:
    """The particles a cycle extends: not ended (EOS, or a stop string when `ended` says so),
    below the budget, of nonzero weight (`alive`)."""
    eos = plan.target.vocabulary.eos_token_id
    return [i for i, row in enumerate(tokens) if eos not in row and len(row) < plan.max_tokens and alive[i] and not ended[i]]


@dataclass
class CycleProposals:
    """One cycle's free-draft proposals: particles holding equal tokens (copies made by
    resampling) get the same proposal and the same logits, so one row computes them.

    Attributes:
        running: the particles extended, in particle order.
        distinct, copy_of: `distinct_rows` of them.
        drafted: per distinct row its proposal d.
        masks: per distinct row [len(d) + 1, V] bool masks, or None.
        forced: per distinct row how many of d's leading tokens the constraints force.
    """

    running: list[int]
    distinct: list[int]
    copy_of: list[int]
    drafted: list[list[int]]
    masks: list
    forced: list[int]

    @property
    def width(self) -> int:
        """Tokens every computed row reads: the unseen last token and the longest proposal."""
        return 1 + max(len(d) for d in self.drafted)

    def feed(self, tokens: list[list[int]], eos: int, width: int) -> list[list[int]]:
        """Each distinct row's unseen last token, its proposal, then EOS filler to `width`."""
        return [[tokens[self.running[r]][-1]] + d + [eos] * (width - 1 - len(d)) for r, d in zip(self.distinct, self.drafted)]

    @property
    def proposed(self) -> int:
        """Proposed tokens over every running particle (copies count theirs)."""
        return sum(len(self.drafted[u]) for u in self.copy_of)


def propose_distinct(plan, drafter: FreeDrafter, tokens: list[list[int]], running: list[int], share: bool = True) -> CycleProposals:
    """The free draft's proposals of one cycle, one per distinct running particle (one per
    running particle when `share` is False)."""
    distinct, copy_of = distinct_rows(tokens, running) if share else (list(range(len(running))), list(range(len(running))))
    drafted, masks, forced = proposals(plan, drafter, tokens, [running[r] for r in distinct])
    return CycleProposals(running, distinct, copy_of, drafted, masks, forced)


def free_feed(groups: list, table) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the distinct running rows of every request read: their unseen last token and their
    proposal.

    Returns:
        ([U] int64 rows, [U, width] int64 tokens with EOS filler, [U] int64 counts).
    """
    eos = groups[0].eos
    width = max(g.cycle.width for g in groups)
    feed = [row for g in groups for row in g.cycle.feed(g.lists, eos, width)]
    seated = [g.slot_ids[g.cycle.running[r]] for g in groups for r in g.cycle.distinct]
    counts = [1 + len(d) for g in groups for d in g.cycle.drafted]
    return table.target_row[torch.tensor(seated)], torch.tensor(feed), torch.tensor(counts)


def extend_free_rows(groups: list, table, packed: torch.Tensor, starts: torch.Tensor) -> list[tuple[list[int], list[list[int]], list[list[float]], list[float]]]:
    """Extend every running particle of every request by its exact speculative step on q_loc,
    in one `accept_rows` and one `append_rows`: tokens kept up to EOS and budget, and the log Z
    of each kept position added to its weight (module docstring). Particles that stop running
    (EOS, budget, weight zero) drop their rows.

    Args:
        groups: `FreeImportanceGroup`s in a free cycle (their `cycle` prepared).
        table: the engine's `SlotTable`.
        packed: [T, V] float32 target logits row after row; starts: [B + 1] int64.

    Returns:
        per request, per running particle: drafts accepted, the tokens appended, the log Z
        terms of their positions, and its log weight before the cycle.
    """
    blocks, temperatures, alphas, seated = [], [], [], []
    owner, request_keys, cycles, particles, slots, generated, budget = [], [], [], [], [], [], []
    for g in groups:
        c, base = g.cycle, len(blocks)
        for r, d, m in zip(c.distinct, c.drafted, c.masks):
            blocks.append(ProposedBlock(d, masks=m))
            seated.append(g.slot_ids[c.running[r]])
        temperatures += [g.plan.target_temperature] * len(c.distinct)
        alphas += [g.plan.alpha] * len(c.distinct)
        for r, i in enumerate(c.running):
            owner.append(base + c.copy_of[r])
            particles.append(i)
            slots.append(g.slot_ids[i])
            generated.append(len(g.lists[i]))
            budget.append(g.plan.max_tokens - len(g.lists[i]))
        request_keys += [g.key] * len(c.running)
        cycles += [len(g.cycles)] * len(c.running)
    slots_t = torch.tensor(slots)
    before = table.logw[slots_t].tolist()
    decisions = accept_rows(packed, starts, table.target_row[torch.tensor(seated)], blocks, temperatures, alphas, torch.tensor(owner), torch.tensor(request_keys), torch.tensor(cycles), torch.tensor(particles))
    new, finished, terms = append_rows(table, slots_t, generated, budget, decisions, groups[0].eos, weighted=True)
    accepted = decisions.accepted.tolist()
    # particles that stop running hold no rows: at EOS (done by append_rows), at the budget, at weight zero
    ended = [s for s, n, b, t in zip(slots, new, budget, terms) if len(n) >= b or -math.inf in t]
    if ended:
        table.target_row[torch.tensor(ended)] = -1
        table.draft_row[torch.tensor(ended)] = -1
    out, start = [], 0
    for g in groups:
        end = start + len(g.cycle.running)
        out.append((accepted[start:end], new[start:end], terms[start:end], before[start:end]))
        start = end
    return out
