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

The lookup's block length adapts to what it measures: it doubles (up to `max_len`) after a
block whose lookup tokens were all accepted and falls to one more than the tokens accepted
after a rejection, so that where nothing repeats, proposals stay short and a wrong guess costs
one extra verified position.
"""

from __future__ import annotations

import torch

from smc_sd.engine.lookup import LookupIndex

#: the lookup's block length before it has measured anything
INITIAL_LOOKUP_LEN = 4


class FreeDrafter:
    """One sequence's free draft over a run.

    Args:
        free: the program's `FreeDraft` settings.
        prompt: the prompt's token ids (the lookup's index is built on them once).
        masker: the plan's `Masker`, or None when unconstrained.

    Attributes:
        lookup_len: the lookup's current block length, in 1 .. free.max_len.
    """

    def __init__(self, free, prompt: list[int], masker=None):
        self.free, self.masker = free, masker
        self.index = LookupIndex(prompt, max_ngram=max(8, free.min_match), min_ngram=free.min_match) if free.lookup else None
        self.lookup_len = min(INITIAL_LOOKUP_LEN, free.max_len)

    def propose(self, generated: list[int], budget: int) -> tuple[list[int], int]:
        """The proposal after a generated prefix, before the constraints cut it.

        Args:
            generated: the sequence's generated tokens so far.
            budget: tokens the sequence may still generate; the proposal leaves room for the
                token the verify emits after it.

        Returns:
            (tokens, forced): the proposed tokens, at most min(max_len, budget - 1), of which
            the first `forced` are forced by the constraints.
        """
        room = min(self.free.max_len, budget - 1)
        if room <= 0:
            return [], 0
        forced = []
        if self.free.forced and self.masker is not None:
            forced = self.masker.forced_tokens(generated)[:room]
        looked_up = []
        if self.index is not None and len(forced) < room:
            looked_up = self.index.propose(generated + forced, min(self.lookup_len, room - len(forced)))
        return forced + looked_up, len(forced)

    def record(self, proposed_by_lookup: int, accepted_from_lookup: int) -> None:
        """Adapt the lookup's block length to one verified block (module docstring).

        Args:
            proposed_by_lookup: lookup tokens the block verified.
            accepted_from_lookup: how many of them were accepted.
        """
        if proposed_by_lookup == 0:
            return
        if accepted_from_lookup == proposed_by_lookup:
            self.lookup_len = min(2 * self.lookup_len, self.free.max_len)
        else:
            self.lookup_len = max(1, accepted_from_lookup + 1)


def point_mass_rows(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """log delta_d: the log-probability rows of a deterministic draft.

    Args:
        tokens: d_1..d_m.
        vocab_size: V.

    Returns:
        [m, V] float32, 0 at d_j in row j and -inf elsewhere.
    """
    rows = torch.full((len(tokens), vocab_size), float("-inf"))
    if tokens:
        rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return rows


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
