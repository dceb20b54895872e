"""Autoregressive sampling: one particle, one target forward per token, x_t ~ p_T(. | x_<t).

With constraints each token is drawn from the target masked by them and renormalised,
x_t ~ p_T(. | x_<t) m(.) / Z(x_<t): the locally projected law that serving engines sample under
structured output (not the conditional p_T(x | x satisfies the constraints), which `smc-sd`
targets). It is the baseline of every constrained speed figure. At T = 0 it is greedy decoding
under the constraints: the argmax over the allowed tokens.
"""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program, Target

DEFAULT_PARTICLES = 1


def program(target: LanguageModel, *, temperature: float = 1.0, constraints: tuple = ()) -> Program:
    """The target proposes its own next token (K = 0); with one particle every weight is ignored."""
    return Program("ar", Target(target, temperature=temperature, constraints=tuple(constraints)))
