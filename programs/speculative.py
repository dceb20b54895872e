"""Exact speculative decoding: K sampled draft tokens, min(1, p/q) acceptance, residual
max(0, p - q) on rejection, a bonus token on full acceptance. The output is distributed as p_T."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program, Proposal, Target

DEFAULT_PARTICLES = 1


def program(
    target: LanguageModel,
    draft: LanguageModel,
    *,
    temperature: float = 1.0,
    draft_temperature: float = 1.0,
    draft_len: int = 4,
) -> Program:
    return Program(
        "sd",
        Target(target, temperature=temperature),
        Proposal(draft, temperature=draft_temperature, draft_len=draft_len),
        verification="accept-reject",
    )
