"""Constrained SMC-SD: the target is p_T(x)^alpha conditioned on x matching a regex, a Lark grammar
or a JSON schema, each a genlm-control potential over bytes coerced to the LM's tokens.

The draft proposes only tokens that keep the constraint satisfiable and the bonus token is drawn
from the masked target; the masked normalisers in the weights correct the local projection toward
the global conditional p_T(x | x satisfies the constraint). Compare `mask-at-verify`, which samples
the local projection itself.

    >>> program = constrained.program(target, draft, json_schema={"type": "object", ...})
"""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program
from smc_sd.programs import smc_speculative

DEFAULT_PARTICLES = 4


def potentials(*, regex: str | None = None, grammar: str | None = None, json_schema: dict | None = None) -> tuple:
    """The genlm-control potentials of the given constraints (any combination, conjoined).

    Args:
        regex: a regular expression the whole output must match (`BoolFSA.from_regex`).
        grammar: a Lark grammar the output must parse under (`BoolCFG.from_lark`).
        json_schema: a JSON schema the output must validate against (a `BoolFSA` when the schema
            translates to a regex, else genlm-control's `JsonSchema`).
    """
    from genlm.control import BoolCFG, BoolFSA

    from smc_sd.program.json_regex import json_schema_potential

    out = []
    if regex is not None:
        out.append(BoolFSA.from_regex(regex))
    if grammar is not None:
        out.append(BoolCFG.from_lark(grammar))
    if json_schema is not None:
        out.append(json_schema_potential(json_schema))
    return tuple(out)


def program(
    target: LanguageModel,
    draft: LanguageModel,
    *,
    regex: str | None = None,
    grammar: str | None = None,
    json_schema: dict | None = None,
    **options,
) -> Program:
    """SMC-SD under the given constraints; `options` are those of `smc_speculative.program`."""
    constraints = potentials(regex=regex, grammar=grammar, json_schema=json_schema)
    if not constraints:
        raise ValueError("give a regex, a grammar or a JSON schema")
    return smc_speculative.program(target, draft, constraints=constraints, **options)
