"""Autoregressive sampling: one particle, one target forward per token, x_t ~ p_T(. | x_<t)."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program, Target

DEFAULT_PARTICLES = 1


def program(target: LanguageModel, *, temperature: float = 1.0) -> Program:
    """The target proposes its own next token (K = 0), so every importance weight is 1."""
    return Program("ar", Target(target, temperature=temperature))
