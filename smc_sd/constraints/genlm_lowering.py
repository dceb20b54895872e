"""genlm-control potentials whose language can be read back, rewritten as llguidance grammars.

genlm-control keeps no source text: `BoolFSA.from_regex` keeps only its automaton, `BoolCFG.from_lark`
only its byte-level CFG, and `JsonSchema(schema)` is a product whose validator factor keeps the
schema. Each is rewritten exactly:
- a `BoolFSA` as a right-linear Lark grammar, one rule per automaton state:
      s_i : /[bytes to s_j]/ s_j | ... | ""        ("" iff s_i is final);
- a `BoolCFG` rule by rule, each terminal byte b as the regex /[\\xb]/;
- genlm-control's `JsonSchema` as `json_schema_language` of the same schema.
A product `p1 * p2` of byte potentials is split into its factors (`factors`), each lowered on
its own. Both grammars are over bytes: a multi-byte character is split into its UTF-8 bytes
(genlm-control's automaton for "é+" reads 0xC3 then 0xA9), so they carry llguidance's
`allow_invalid_utf8` option, under which /[\\xNN]/ is the byte NN rather than the character U+00NN.
"""

from __future__ import annotations

from collections import defaultdict

import llguidance

from genlm.control.potential.built_in.json import FullValidatorJsonSchema
from genlm.control.potential.built_in.wcfg import BoolCFG
from genlm.control.potential.built_in.wfsa import BoolFSA
from genlm.control.potential.product import Product

from smc_sd.constraints.grammars import GrammarPotential
from smc_sd.constraints.languages import Language, json_schema_language


def lower(potential) -> Language | None:
    """The language of a potential as an llguidance grammar, or None when it cannot be read back."""
    if isinstance(potential, GrammarPotential):
        return potential.language
    if isinstance(potential, Product) and isinstance(potential.p2, FullValidatorJsonSchema):
        # genlm-control's JsonSchema: a streaming parser of the schema times its full validator
        return json_schema_language(potential.p2.schema)
    lark = fsa_lark(potential) if isinstance(potential, BoolFSA) else None
    if isinstance(potential, BoolCFG):
        lark = cfg_lark(potential.cfg)
    if lark is None:
        return None
    return Language(llguidance.LLMatcher.grammar_from_lark(lark), type(potential).__name__)


#: the grammar option under which a regex's \xNN is one byte, so byte automata can be written
BYTES = '%llguidance {"allow_invalid_utf8": true}'


def byte_class(labels) -> str | None:
    """/[\\xNN...]/ for a set of bytes; None if a label is not a byte."""
    if any(not isinstance(b, int) or not 0 <= b < 256 for b in labels):
        return None
    return "/[" + "".join(f"\\x{b:02x}" for b in sorted(labels)) + "]/"


def fsa_lark(fsa) -> str | None:
    """A right-linear Lark grammar of a boolean byte automaton (module docstring), or None.

    States are renamed s0, s1, ... in the automaton's order (its own names mix ints and strings)."""
    automaton = fsa.wfsa.epsremove
    names = {state: f"s{k}" for k, state in enumerate(automaton.states)}
    live = {i for i in automaton.states if automaton.backward[i].score}
    finals = {i for i, w in automaton.F if w.score}
    rules = []
    for i in (i for i in automaton.states if i in live):
        targets = defaultdict(set)
        for label, j, w in automaton.arcs(i):
            if w.score and j in live:
                targets[j].add(label)
        alternatives = []
        for j, labels in targets.items():
            terminal = byte_class(labels)
            if terminal is None:
                return None
            alternatives.append(f"{terminal} {names[j]}")
        if i in finals:
            alternatives.append('""')
        rules.append(f"{names[i]}: " + " | ".join(alternatives))
    starts = [names[i] for i in fsa._start_chart if i in live]
    if not starts:
        return None
    return "\n".join([BYTES, f"start: {' | '.join(starts)}"] + rules)


def cfg_lark(cfg) -> str | None:
    """A Lark grammar of a genlm-grammar byte CFG with boolean weights, or None."""
    names = {symbol: f"n{k}" for k, symbol in enumerate(sorted(cfg.N, key=str))}
    alternatives = defaultdict(list)
    for rule in cfg.rules:
        if not rule.w:
            continue
        parts = []
        for symbol in rule.body:
            if symbol in names:
                parts.append(names[symbol])
            else:
                terminal = byte_class([symbol])
                if terminal is None:
                    return None
                parts.append(terminal)
        alternatives[names[rule.head]].append(" ".join(parts) or '""')
    if names[cfg.S] not in alternatives:
        return None
    lines = [BYTES, f"start: {names[cfg.S]}"] + [f"{head}: " + " | ".join(alts) for head, alts in alternatives.items()]
    return "\n".join(lines)


def factors(potential) -> list:
    """A genlm-control product split into its factors, keeping whole what `lower` reads back
    (genlm-control's `JsonSchema` is itself a product)."""
    if isinstance(potential, Product) and lower(potential) is None:
        return factors(potential.p1) + factors(potential.p2)
    return [potential]
