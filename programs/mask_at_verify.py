"""Mask-at-verify: exact speculative decoding with the draft q and the target p both masked by the
constraints and renormalised at every token, as serving engines combine speculative decoding with
structured output. The output is distributed as the locally projected prod_t p~(x_t | x_<t),
p~ = p m / Z_p, which differs from the conditional p_T(x | x satisfies the constraints) that
constrained SMC-SD targets; it is here so the two can be compared. A free draft
(`smc_sd.program.FreeDraft`) proposes the tokens the constraints force and lookup continuations,
verified under the same masks."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import FreeDraft, Program, Proposal, Target

DEFAULT_PARTICLES = 1


def program(
    target: LanguageModel,
    draft: LanguageModel | None,
    *,
    constraints: tuple = (),
    temperature: float = 1.0,
    draft_temperature: float = 1.0,
    draft_len: int = 4,
    free_draft: FreeDraft | None = None,
) -> Program:
    return Program(
        "mask-at-verify",
        Target(target, temperature=temperature, constraints=tuple(constraints)),
        Proposal(draft, temperature=draft_temperature, draft_len=draft_len, free=free_draft),
        verification="accept-reject",
    )
