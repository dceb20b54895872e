"""Constrained SMC-SD: the target is p_T(x)^alpha conditioned on x matching a regex, a Lark grammar
or a JSON schema, each a `Language` (an llguidance grammar over bytes) whose masks come from
llguidance; no genlm-control is loaded for them.

The draft proposes only tokens that keep the constraint satisfiable and the bonus token is drawn
from the masked target; the masked normalisers in the weights correct the local projection toward
the global conditional p_T(x | x satisfies the constraint). Compare `mask-at-verify`, which samples
the local projection itself.

    >>> program = constrained.program(target, draft, json_schema={"type": "object", ...})
"""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import Program
from smc_sd.constraints.languages import json_schema_language, lark_language, regex_language
from smc_sd.programs import smc_speculative

DEFAULT_PARTICLES = 4


def potentials(*, regex: str | None = None, grammar: str | None = None, json_schema=None, json_layout: str = "compact") -> tuple:
    """The constraints given (any combination, conjoined), each a `Language` the compiler
    lowers to llguidance masks (as it lowers the genlm-control potentials `Regex`, `Grammar`
    and `JsonSchema` of the same arguments).

    Args:
        regex: a regular expression the whole output must match (`regex_language`).
        grammar: a Lark grammar the output must parse under (`lark_language`).
        json_schema: a JSON schema (dict, JSON text or file path) the output must validate
            against (`json_schema_language`).
        json_layout: the JSON's layout, "compact" (no whitespace, fixed separators: keys and
            punctuation are forced) or "flexible" (any whitespace between tokens).

    Raises:
        ValueError: naming the problem, for an invalid regex, grammar or schema.
    """
    out = []
    if regex is not None:
        out.append(regex_language(regex))
    if grammar is not None:
        out.append(lark_language(grammar))
    if json_schema is not None:
        out.append(json_schema_language(json_schema, json_layout))
    return tuple(out)


def program(
    target: LanguageModel,
    draft: LanguageModel,
    *,
    regex: str | None = None,
    grammar: str | None = None,
    json_schema=None,
    **options,
) -> Program:
    """SMC-SD under the given constraints; `options` are those of `smc_speculative.program`."""
    constraints = potentials(regex=regex, grammar=grammar, json_schema=json_schema)
    if not constraints:
        raise ValueError("give a regex, a grammar or a JSON schema")
    return smc_speculative.program(target, draft, constraints=constraints, **options)
