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

from smc_sd.engine.drafting import trim_at_eos
from smc_sd.engine.free_drafts import FreeDrafter, allowed_prefix
from smc_sd.engine.sampling import logsumexp_floored, sample_tokens, tempered_logprobs


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
    masks, _ = plan.masker(prefixes, torch.ones(len(prefixes), dtype=torch.bool))
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


def running_particles(plan, tokens: list[list[int]], logw: torch.Tensor, ended: list[bool] | None = None) -> list[int]:
    """The particles a cycle extends: not ended (EOS, or a stop string when `ended` says so),
    below the budget, of nonzero weight."""
    eos = plan.target.vocabulary.eos_token_id
    return [
        i for i, row in enumerate(tokens)
        if eos not in row and len(row) < plan.max_tokens and math.isfinite(logw[i]) and not (ended and ended[i])
    ]


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

    def feed(self, tokens: list[list[int]], eos: int) -> torch.Tensor:
        """[U, width] int64: each distinct row's unseen last token, its proposal, then EOS filler."""
        width = self.width
        return torch.tensor([[tokens[self.running[r]][-1]] + d + [eos] * (width - 1 - len(d)) for r, d in zip(self.distinct, self.drafted)])

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


def speculative_steps(plan, cycle: CycleProposals, logits: torch.Tensor, generator) -> list[tuple[list[int], list[float], int]]:
    """Every running particle's exact speculative step on q_loc with its point-mass draft,
    computed for all distinct rows at once (particles holding equal tokens share q_loc).

    With the point-mass draft, d_j is accepted with probability q_loc(d_j) (log u_j <
    log q_loc(d_j)); at the first rejection j the token is drawn from the residual, q_loc with d_j
    removed (norm(max(0, q_loc - delta_{d_j}))); after m acceptances the bonus is drawn from q_loc
    after d_m. Where the residual has no mass in float32 (q_loc(d_j) rounds to 1) the token is
    drawn from q_loc (`residual_token`'s rule). A row whose q_loc has no mass at some position
    j <= m reaches no further: it keeps d_1..d_j and an EOS filler, with log Z_j = -inf.

    The uniforms of every acceptance test are drawn first, in particle order, then one token per
    particle in one call: the draws depend on this request's generator only.

    Args:
        cycle: the cycle's proposals.
        logits: [U, width, V] float32 target logits of the distinct rows (`CycleProposals.feed`).

    Returns:
        Per running particle (emitted, log_z, accepted): the emitted tokens, the log Z term of each
        emitted position, and how many drafts were accepted.
    """
    eos = plan.target.vocabulary.eos_token_id
    masks = None
    if any(m is not None for m in cycle.masks):
        # [U, width, V]: each row's masks, all-allowed past its proposal
        masks = torch.ones(logits.shape, dtype=torch.bool)
        for u, m in enumerate(cycle.masks):
            masks[u, : m.shape[0]] = m
    # [U, width, V]: alpha log p_T, masked; [U, width]: its normalisers log Z
    scores = plan.alpha * tempered_logprobs(logits, plan.target_temperature, masks)
    log_z = logsumexp_floored(scores, -1)
    width = logits.shape[1]
    drafted = torch.tensor([d + [eos] * (width - 1 - len(d)) for d in cycle.drafted], dtype=torch.long)
    # [U, width - 1]: log q_loc(d_j) at each drafted position
    log_accept = (scores[:, :-1].gather(-1, drafted[..., None]).squeeze(-1) - log_z[:, :-1]).double().tolist()
    terms = log_z.double().tolist()
    # per distinct row: the first position where q_loc has no mass (None: it has mass at every one);
    # the particles of rows with mass everywhere draw, the others stop
    blocked = [next((j for j, t in enumerate(terms[u][: len(d) + 1]) if not math.isfinite(t)), None) for u, d in enumerate(cycle.drafted)]
    sizes = [len(cycle.drafted[u]) for u in cycle.copy_of if blocked[u] is None]
    log_u = iter(torch.rand(sum(sizes), generator=generator, dtype=torch.float64).log().split(sizes))
    # per running particle (kept drafts, log Z terms, accepted); the drawing ones' (u, j, d_j or -1)
    out, draws = [], []
    for u in cycle.copy_of:
        d, j = cycle.drafted[u], blocked[u]
        if j is not None:
            out.append((d[:j] + [eos], terms[u][: j + 1], j))
            continue
        accepted = next((k for k, x in enumerate(next(log_u).tolist()) if x >= log_accept[u][k]), len(d))
        draws.append((len(out), u, accepted, d[accepted] if accepted < len(d) else -1))
        out.append((d[:accepted], terms[u][: accepted + 1], accepted))
    if draws:
        at, rows, columns, excluded = zip(*draws)
        for r, token in zip(at, residual_or_bonus_tokens(scores, rows, columns, excluded, generator)):
            kept, log_terms, accepted = out[r]
            out[r] = (kept + [token], log_terms, accepted)
    return out


def residual_or_bonus_tokens(scores: torch.Tensor, rows, columns, excluded, generator) -> list[int]:
    """One token per drawing particle, in one call: from q_loc at (row, column) with the rejected
    draft `excluded` removed (the residual), or from q_loc itself where `excluded` is -1 (the
    bonus after m acceptances) or where the residual has no mass in float32 (q_loc(d_j) rounded
    to 1).

    Args:
        scores: [U, width, V] alpha log p_T, masked (q_loc unnormalised).
        rows, columns, excluded: per drawing particle, its distinct row, position and rejected
            draft (-1: none).
    """
    # [P, V]: q_loc (unnormalised) at each drawing particle's last position, d_j removed on a rejection
    last = scores[torch.tensor(rows), torch.tensor(columns)]
    excluded = torch.tensor(excluded)
    residual = last.clone()
    rejected = (excluded >= 0).nonzero().flatten()
    residual[rejected, excluded[rejected]] = float("-inf")
    residual = torch.where(torch.isfinite(residual).any(-1, keepdim=True), residual, last)
    return sample_tokens(residual, generator).tolist()


def extend_running(plan, drafter: FreeDrafter, cycle: CycleProposals, logits: torch.Tensor, tokens: list[list[int]], logw: torch.Tensor, generator, stop_at=None) -> tuple[list[int], list[int], list[bool]]:
    """Extend every running particle by its exact speculative step on q_loc, in particle order,
    and add its log Z terms to its weight (module docstring); the lookup adapts to each block.

    Args:
        cycle: the cycle's proposals.
        logits: [U, width, V] float32 target logits of the distinct rows (`CycleProposals.feed`).
        tokens: every particle's tokens, extended in place.
        logw: [N] float64 log weights, updated in place.
        stop_at: (prefix, new tokens) -> the index of the new token that completes a stop
            string, or None; None when the request has no stop strings.

    Returns:
        (accepted, added, stopped) per running particle: drafts accepted, tokens kept, whether a
        stop string ended it.
    """
    eos = plan.target.vocabulary.eos_token_id
    accepted_out, added, stopped = [], [], []
    steps = speculative_steps(plan, cycle, logits, generator)
    for r, (i, (emitted, terms, accepted)) in enumerate(zip(cycle.running, steps)):
        u = cycle.copy_of[r]
        d = cycle.drafted[u]
        new = trim_at_eos(emitted, eos)[: plan.max_tokens - len(tokens[i])]
        column = stop_at(tokens[i], new) if stop_at is not None else None
        if column is not None:
            new = new[: column + 1]
        # the weight counts the kept positions only (an EOS, a stop or the budget may cut the block)
        logw[i] += math.fsum(terms[: len(new)])
        tokens[i] += new
        accepted_out.append(accepted)
        added.append(len(new))
        stopped.append(column is not None)
        drafter.record(len(d), cycle.forced[u], accepted)
    return accepted_out, added, stopped
