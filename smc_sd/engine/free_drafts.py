"""Free drafts: the tokens a sequence's text proposes for itself, at no model cost.

A free draft proposes d_1..d_m from a generated prefix x (program: `smc_sd.program.FreeDraft`):

    d = forced(x) + lookup(x + forced(x))

where forced(x) are the tokens the constraints force after x (llguidance's fast-forward tokens,
the canonical tokenization of the bytes every completion shares) and lookup(y) the tokens that
followed the longest earlier occurrence of y's last tokens in the prompt or in y itself
(`smc_sd.engine.lookup.LookupIndex`). The proposal is cut before its first token the
constraints refuse, so every proposed token keeps the string completable.

The proposal is a deterministic function of x, i.e. the draft q = delta_d. Exact speculative
sampling then accepts d_j with probability min(1, p(d_j) / 1) = p(d_j) and otherwise draws from
norm(max(0, p - delta_d)) = p without d_j, renormalised, so the emitted law is p exactly (p the
tempered target, masked and renormalised under mask-at-verify). Another tokenization of forced
bytes keeps its mass under p: the verify, not the draft, decides between them.

How much of the proposal a block verifies is a cost decision (`best_block_length`): with a_j the
probability that d_j is accepted given d_1..d_{j-1} were, a block of L proposed tokens emits

    E(L) = 1 + sum_{j=1..L} prod_{i<=j} a_i

tokens in expectation, and costs what the backend's pass over those L + 1 positions adds to the
pass (`smc_sd.backends.pass_cost`). The drafter proposes the L that maximises E(L) per unit of
cost; L = 0, a plain decode, wherever speculating does not pay. a_j is the running acceptance of
d_j's source (forced tokens or lookup tokens), measured by one rule over the tokens each verify
tested (`FreeDrafter.record`). A source the choice leaves wholly out is not tested, so its a_j
would never change again: each such choice instead moves its counts a step towards the prior
(`FreeDrafter.relax`), and a source whose acceptance fell once is tried again after a while
(about 15 choices from a_j = 0.14 to 0.3). L depends on the past only, never on the token a
verify is about to draw, so every method keeps its law.
"""

from __future__ import annotations

import torch

from smc_sd.engine.lookup import LookupIndex

#: prior running acceptance of forced tokens (the constraints' canonical tokenization: the target
#: puts most of its mass on it) and of lookup tokens, each worth PRIOR_WEIGHT tested tokens
PRIOR_ACCEPTANCE = {"forced": 0.9, "lookup": 0.5}
PRIOR_WEIGHT = 2.0
#: each record keeps this share of the counts before it, so the acceptance follows the recent text
DECAY = 0.9


def expected_emitted(acceptance: list[float]) -> list[float]:
    """E(L) for L = 0..m: 1 + sum_{j<=L} prod_{i<=j} a_i (module docstring)."""
    emitted, survive = [1.0], 1.0
    for a in acceptance:
        survive *= a
        emitted.append(emitted[-1] + survive)
    return emitted


def best_block_length(acceptance: list[float], cost, rows: int = 1) -> int:
    """The block length L in 0..m that maximises expected emitted tokens per unit of pass cost.

    The row is one of `rows` rows its request feeds to one pass; the rows of a pass are as wide as
    the widest (`smc_sd.engine.smc_free.CycleProposals.feed`), so the choice supposes every row
    proposes like this one: rows * E(L) tokens for c(rows * (L + 1)).

    Args:
        acceptance: a_1..a_m, the acceptance of each proposed token given its predecessors'.
        cost: c(n), the backend's `PassCost`.
        rows: the request's rows in one pass (its particles; 1 for sd).

    Returns:
        The shortest L of the largest rows * E(L) / c(rows * (L + 1)); 0 when nothing is proposed.
    """
    emitted = expected_emitted(acceptance)
    value = [rows * e / cost(rows * (length + 1)) for length, e in enumerate(emitted)]
    return max(range(len(value)), key=lambda length: (value[length], -length))


class FreeDrafter:
    """One request's free draft over a run (its particles share it: one running acceptance).

    Args:
        free: the program's `FreeDraft` settings.
        prompt: the prompt's token ids (the lookup's index is built on them once).
        masker: the plan's `Masker`, or None when unconstrained.
        cost: the target's `PassCost`; None proposes every token up to `free.max_len` (a fixed
            block length, for experiments).
        rows: the request's rows in one target pass (`best_block_length`).

    Attributes:
        counts: {source: [accepted, tested]} decayed token counts, priors included.
        chosen: {L: blocks} how many blocks the choice gave L proposed tokens (before the
            constraints' cut; 0: a plain decode).
    """

    def __init__(self, free, prompt: list[int], masker=None, cost=None, rows: int = 1):
        self.free, self.masker, self.cost, self.rows = free, masker, cost, rows
        self.index = LookupIndex(prompt, max_ngram=max(8, free.min_match), min_ngram=free.min_match) if free.lookup else None
        self.counts = {source: [a * PRIOR_WEIGHT, PRIOR_WEIGHT] for source, a in PRIOR_ACCEPTANCE.items()}
        self.chosen: dict[int, int] = {}

    @classmethod
    def for_plan(cls, plan, prompt: list[int]) -> FreeDrafter:
        """The drafter of a plan with a free draft: the target's pass cost unless the program
        fixes the block length, one row per particle."""
        cost = plan.target.pass_cost if plan.free.cost_aware else None
        return cls(plan.free, prompt, plan.masker, cost, rows=plan.particles)

    def acceptance(self, source: str) -> float:
        """The running acceptance of `source` ("forced" or "lookup")."""
        accepted, tested = self.counts[source]
        return accepted / tested

    def propose(self, generated: list[int], budget: int) -> tuple[list[int], int]:
        """The proposal after a generated prefix, before the constraints cut it.

        Args:
            generated: the sequence's generated tokens so far.
            budget: tokens the sequence may still generate; the proposal leaves room for the
                token the verify emits after it.

        Returns:
            (tokens, forced): the proposed tokens, at most min(max_len, budget - 1), cut to the
            block length that pays (`best_block_length`), of which the first `forced` are forced
            by the constraints.
        """
        room = min(self.free.max_len, budget - 1)
        if room <= 0:
            return [], 0
        forced = []
        if self.free.forced and self.masker is not None:
            forced = self.masker.forced_tokens(generated)[:room]
        looked_up = []
        if self.index is not None and len(forced) < room:
            looked_up = self.index.propose(generated + forced, room - len(forced))
        proposal = forced + looked_up
        if self.cost is not None:
            acceptance = [self.acceptance("forced")] * len(forced) + [self.acceptance("lookup")] * len(looked_up)
            proposal = proposal[: best_block_length(acceptance, self.cost, self.rows)]
            # a source the choice left wholly out is not tested this cycle
            for source, untested in (("forced", forced and not proposal), ("lookup", looked_up and len(proposal) <= len(forced))):
                if untested:
                    self.relax(source)
        self.chosen[len(proposal)] = self.chosen.get(len(proposal), 0) + 1
        return proposal, min(len(forced), len(proposal))

    def record(self, proposed: int, forced: int, accepted: int) -> None:
        """Count one verified block into the running acceptance of its sources.

        The verify tests d_1, d_2, ... until the first rejection: d_1..d_accepted were accepted
        and d_{accepted+1} (if proposed) was tested and refused; later tokens were never tested
        and count for nothing. The first `forced` tokens count for "forced", the rest for
        "lookup".

        Args:
            proposed: tokens the block verified (after the constraints' cut).
            forced: how many of them lead the block as forced tokens.
            accepted: how many were accepted.
        """
        if proposed == 0:
            return
        tested = min(proposed, accepted + 1)
        by_source = {"forced": (min(forced, accepted), min(forced, tested))}
        by_source["lookup"] = (accepted - by_source["forced"][0], tested - by_source["forced"][1])
        for source, (hits, tries) in by_source.items():
            if tries:
                counts = self.counts[source]
                counts[0] = DECAY * counts[0] + hits
                counts[1] = DECAY * counts[1] + tries

    def relax(self, source: str) -> None:
        """One step of an untested source's counts towards its prior: each count keeps DECAY of
        itself and gains (1 - DECAY) of the prior's, so its acceptance tends to the prior's."""
        prior = (PRIOR_ACCEPTANCE[source] * PRIOR_WEIGHT, PRIOR_WEIGHT)
        self.counts[source] = [DECAY * count + (1 - DECAY) * start for count, start in zip(self.counts[source], prior)]

    def report(self) -> dict:
        """The choice's record for `Result`: block lengths chosen and the pass cost they used."""
        return {
            "block_lengths": dict(sorted(self.chosen.items())),
            "pass_cost": None if self.cost is None else self.cost.to_json(),
            "acceptance": {source: self.acceptance(source) for source in self.counts},
        }


def allowed_prefix(tokens: list[int], masks: torch.Tensor) -> int:
    """How many leading proposed tokens the constraints allow.

    Args:
        tokens: d_1..d_m.
        masks: [m + 1, V] bool, row j the mask after the first j proposed tokens.

    Returns:
        The largest j such that d_1..d_j are all allowed where they stand.
    """
    for j, token in enumerate(tokens):
        if not bool(masks[j, token]):
            return j
    return len(tokens)
