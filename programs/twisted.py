"""Twisted SMC-SD: a critic psi scores every particle's prefix at each block end. The twist enters
the weights (log w += log psi(new prefix) - log psi(old prefix)) and comes off at the end, so it
changes which particles survive resampling, not the target. An exact twist (the probability that
the prefix can still be completed validly) makes resampling act on the future, not on the past.

`potential_twist` turns a genlm-control potential over bytes (a classifier, a soft constraint)
into a twist: log psi(x) = potential.prefix(bytes of x).
"""

import asyncio

import torch

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program
from smc_sd.programs import smc_speculative

DEFAULT_PARTICLES = 8


def potential_twist(potential, lm: LanguageModel):
    """log psi(prefixes) = [potential.prefix(bytes(prefix_b))]_b, a twist for `Program.twist`.

    Args:
        potential: a genlm-control `Potential` over bytes, or a `Language` (a regex, grammar or
            schema as `constrained.potentials` builds it: its boolean potential is the twist).
        lm: the model whose token ids the prefixes hold.
    """
    from smc_sd.constraints.grammars import GrammarPotential
    from smc_sd.constraints.languages import Language
    from smc_sd.constraints.potentials import vocabulary_trie

    if isinstance(potential, Language):
        potential = GrammarPotential(potential)

    vocabulary = vocabulary_trie(lm)[0]
    loop = asyncio.new_event_loop()

    def twist(prefixes: list[list[int]]) -> torch.Tensor:
        contexts = [b"".join(vocabulary[t] or b"" for t in prefix) for prefix in prefixes]
        return torch.as_tensor(loop.run_until_complete(potential.batch_prefix(contexts)), dtype=torch.float64)

    return twist


def program(target: LanguageModel, draft: LanguageModel, *, twist, **options) -> Program:
    """SMC-SD with the twist `twist` (prefixes -> [B] log psi); `options` as in `smc_speculative`."""
    return smc_speculative.program(target, draft, twist=twist, **options)
