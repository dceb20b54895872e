"""Model-free draft sources, as a program names them (`smc_sd.program.FreeDraft`).

The class lives below the program layer because the compiler reads it into every plan
(`StepPlan.free`); the program re-exports it, so users write `smc_sd.program.FreeDraft`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FreeDraft:
    """Model-free draft sources: tokens proposed from a sequence's text, at no model cost.

    Before each verify pass a free draft proposes d_1..d_m deterministically: first the tokens
    the constraints force after the text (llguidance's fast-forward tokens; with no constraint,
    none), then the tokens that followed the longest earlier occurrence of the text's last
    tokens in the prompt or the text itself (`smc_sd.engine.lookup`). A deterministic draft is
    the point mass q = delta_d, so exact speculative sampling accepts d_j with probability
    p(d_j) and otherwise draws from p without d_j, renormalised: the emitted law is p exactly.

    Attributes:
        forced: propose the tokens the constraints force.
        lookup: propose continuations found by lookup.
        min_match: the shortest suffix of the text (in tokens) a lookup match must repeat.
        max_len: the most tokens one block proposes.
        cost_aware: propose the block length that maximises expected emitted tokens per unit of
            the target's pass cost (`smc_sd.engine.free_drafts.best_block_length`); False
            proposes every token found, up to max_len (a fixed block length, for experiments).
    """

    forced: bool = True
    lookup: bool = True
    min_match: int = 2
    max_len: int = 16
    cost_aware: bool = True
