"""Mask-at-verify: exact speculative decoding with the draft q and the target p both masked by the
constraints and renormalised at every token, as serving engines combine speculative decoding with
structured output. The output is distributed as the locally projected prod_t p~(x_t | x_<t),
p~ = p m / Z_p, which differs from the conditional p_T(x | x satisfies the constraints) that
constrained SMC-SD targets; it is here so the two can be compared."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program, Proposal, Target

DEFAULT_PARTICLES = 1


def program(
    target: LanguageModel,
    draft: LanguageModel,
    *,
    constraints: tuple = (),
    temperature: float = 1.0,
    draft_temperature: float = 1.0,
    draft_len: int = 4,
) -> Program:
    return Program(
        "mask-at-verify",
        Target(target, temperature=temperature, constraints=tuple(constraints)),
        Proposal(draft, temperature=draft_temperature, draft_len=draft_len),
        verification="accept-reject",
    )
