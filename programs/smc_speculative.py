"""SMC-SD: N particles each draft K tokens, one target pass verifies all N (K + 1), particles are
weighted by alpha log p_T - log q plus the bonus normaliser, and resampled when ESS < tau N.

Targets pi(x) ∝ p_T(x)^alpha · phi(x), phi the product of the boolean constraints (genlm-control
potentials such as `BoolFSA.from_regex`, or `TokenConstraint`s): the draft and the bonus token are
masked, and the masked normalisers in the weights correct toward the global conditional. Soft
potentials are scored on prefixes at block end; an optional twist (log psi of prefixes) steers
resampling. Consistent as N grows, biased at finite N.

With a free draft (`smc_sd.program.FreeDraft`, no draft LM) each particle is extended by exact
speculative sampling of the locally masked target, the free draft proposing, and weighted by the
local normalisers (`smc_sd.engine.smc_free`): the same target, SMC with the locally optimal
proposal."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import FreeDraft, Program, Proposal, Target

DEFAULT_PARTICLES = 4


def program(
    target: LanguageModel,
    draft: LanguageModel | None,
    *,
    temperature: float = 1.0,
    draft_temperature: float = 1.0,
    alpha: float = 1.0,
    draft_len: int = 4,
    constraints: tuple = (),
    potentials: tuple = (),
    twist=None,
    free_draft: FreeDraft | None = None,
) -> Program:
    return Program(
        "smc-sd",
        Target(target, temperature=temperature, alpha=alpha, constraints=tuple(constraints), potentials=tuple(potentials)),
        Proposal(draft, temperature=draft_temperature, draft_len=draft_len, free=free_draft),
        twist=twist,
    )
