"""Power sampling: SMC-SD targeting pi(x) ∝ p_T(x)^alpha over whole completions (alpha > 1
sharpens toward high-likelihood completions, unlike lowering the temperature token by token).
Each particle draws its bonus token from p_T^alpha normalised and carries log sum_v p_T(v)^alpha
in its weight; constraints compose as in `smc-sd`."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program
from smc_sd.programs import smc_speculative

DEFAULT_PARTICLES = 8


def program(target: LanguageModel, draft: LanguageModel, *, alpha: float = 4.0, **options) -> Program:
    """SMC-SD at power alpha (default 4); `options` are those of `smc_speculative.program`."""
    return smc_speculative.program(target, draft, alpha=alpha, **options)
