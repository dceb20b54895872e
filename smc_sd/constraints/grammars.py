"""`Regex`, `Grammar` (Lark) and `JsonSchema` as genlm-control potentials: boolean potentials over
bytes, each carrying its `Language` (`smc_sd.constraints.languages`).

Each is a genlm-control `Potential` whose vocabulary is the 256 byte values, so it composes with
genlm-control's `*` and runs inside genlm-control's samplers; the compiler lowers it to exact
llguidance token masks of the target, as it lowers its `Language`. On bytes x:

    prefix(x)   = 0 if some completion of x lies in the language, else -inf
    complete(x) = 0 if x lies in the language (and passes the exact check), else -inf

Importing this module loads genlm-control (seconds); a program that needs no genlm-control
potential takes the `Language`s themselves as constraints.
"""

from __future__ import annotations

import llguidance
import numpy as np

from genlm.control.potential import Potential

from smc_sd.constraints.compiled_grammars import root_matcher
from smc_sd.constraints.languages import Language, byte_tokenizer, json_schema_language, lark_language, regex_language


class GrammarPotential(Potential):
    """A boolean potential over bytes given by a `Language` (module docstring).

    Attributes:
        language: the language.
        grammar, description, exact_check, approximations: the language's (`Language`).
    """

    def __init__(self, language: Language):
        self.language = language
        self.grammar, self.description = language.grammar, language.description
        self.exact_check, self.approximations = language.exact_check, language.approximations
        # compiled once per grammar text (shared, never advanced: `_matcher` walks a copy)
        self._root = root_matcher(language.grammar, byte_tokenizer(), language.description)
        super().__init__(vocabulary=list(range(256)))

    def _matcher(self, context) -> llguidance.LLMatcher:
        matcher = self._root.deep_copy()
        matcher.consume_tokens(list(bytes(context)))
        return matcher

    async def prefix(self, context) -> float:
        return 0.0 if not self._matcher(context).is_error() else float("-inf")

    async def complete(self, context) -> float:
        matcher = self._matcher(context)
        ok = not matcher.is_error() and matcher.is_accepting()
        if ok and self.exact_check is not None:
            ok = self.exact_check(bytes(context))
        return 0.0 if ok else float("-inf")

    async def logw_next(self, context):
        """log phi(next byte | context) over the 256 bytes and EOS, from one llguidance mask.

        EOS gets the exact check where there is one; a byte's weight is that of the prefix."""
        matcher = self._matcher(context)
        # [257] bool: the bytes, then EOS
        allowed = np.zeros(257, dtype=bool)
        if not matcher.is_error():
            words = np.frombuffer(matcher.compute_bitmask(), dtype="<u4")
            allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:257].astype(bool)
            if allowed[256] and self.exact_check is not None:
                allowed[256] = self.exact_check(bytes(context))
        return self.make_lazy_weights(np.where(allowed, 0.0, -np.inf))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"


def Regex(pattern: str) -> GrammarPotential:
    """The strings that fully match the regular expression `pattern` (`regex_language`)."""
    return GrammarPotential(regex_language(pattern))


def Grammar(lark: str) -> GrammarPotential:
    """The strings a Lark grammar derives (`lark_language`)."""
    return GrammarPotential(lark_language(lark))


def JsonSchema(schema, layout: str = "compact") -> GrammarPotential:
    """The JSON texts valid under a JSON schema (a dict, JSON text or file path), in a layout
    ("compact" or "flexible"), checked as `json_schema_language` checks them."""
    return GrammarPotential(json_schema_language(schema, layout))
