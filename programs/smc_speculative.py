"""SMC-SD: N particles each draft K tokens, one target pass verifies all N (K + 1), particles are
weighted by alpha log p_T - log q plus the bonus normaliser, and resampled when ESS < tau N.

Targets pi(x) ∝ p_T(x)^alpha · phi(x), phi the product of the boolean constraints (genlm-control
potentials such as `BoolFSA.from_regex`, or `TokenConstraint`s): the draft and the bonus token are
masked, and the masked normalisers in the weights correct toward the global conditional. Soft
potentials are scored on prefixes at block end; an optional twist (log psi of prefixes) steers
resampling. Consistent as N grows, biased at finite N."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program, Proposal, Target

DEFAULT_PARTICLES = 4


def program(
    target: LanguageModel,
    draft: LanguageModel,
    *,
    temperature: float = 1.0,
    draft_temperature: float = 1.0,
    alpha: float = 1.0,
    draft_len: int = 4,
    constraints: tuple = (),
    potentials: tuple = (),
    twist=None,
) -> Program:
    return Program(
        "smc-sd",
        Target(target, temperature=temperature, alpha=alpha, constraints=tuple(constraints), potentials=tuple(potentials)),
        Proposal(draft, temperature=draft_temperature, draft_len=draft_len),
        twist=twist,
    )
