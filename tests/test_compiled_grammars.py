"""Compiled constraints are kept by content, within a bound, and nothing a finished run used stays
reachable (smc_sd.constraints.compiled_grammars):

- one schema built twice, as two objects, compiles once for a tokenizer; another layout of it is
  another grammar and compiles again;
- the table of compiled grammars never holds more than its bound, the least recently used
  leaving first;
- the generic path's masks (a user potential llguidance cannot read) are shared by the
  lowerings of one potential while it lives, and leave with it;
- once runs (`Program.run`, and the batched engine's requests, the server's path) have ended
  and their results are dropped, their potentials and languages are collected and no lowered
  constraint or matcher pool of theirs is alive.
"""

import dataclasses
import gc
import json
import weakref

import pytest
import torch
from genlm.control import Potential

import smc_sd.constraints.compiled_grammars as compiled_grammars
import smc_sd.constraints.byte_masks as byte_masks_module
from smc_sd.program import Schedule
from smc_sd.constraints.compiled_grammars import LRUCache
from smc_sd.constraints.grammars import JsonSchema
from smc_sd.constraints.languages import json_schema_language, regex_language
from smc_sd.constraints.llguidance_masks import GrammarConstraint
from smc_sd.constraints.matcher_pool import MatcherPool
from smc_sd.constraints.potentials import as_token_constraint
from smc_sd.programs import autoregressive, smc_speculative
from tests.test_llguidance import WordLM

#: one-character tokens enough to spell small JSON objects, and two longer ones
JSON_WORDS = list('{}":,0123456789abcdefghijklmnopqrstuvwxyz_') + ['{"', '":']


def object_schema(key: str) -> dict:
    return {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}


def live(cls) -> int:
    """Objects of type `cls` the garbage collector tracks, after a collection."""
    gc.collect()
    return sum(type(o) is cls for o in gc.get_objects())


def test_one_schema_built_as_two_objects_compiles_once_per_layout():
    lm = WordLM(JSON_WORDS)
    schema = object_schema("compiled_once")
    compiled = compiled_grammars.ROOTS.misses
    first, second = JsonSchema(schema), JsonSchema(json.loads(json.dumps(schema)))
    # the potentials' byte-level grammar, once
    assert compiled_grammars.ROOTS.misses == compiled + 1
    a, b = as_token_constraint(first, lm), as_token_constraint(second, lm)
    # and the grammar over the model's tokens, once
    assert compiled_grammars.ROOTS.misses == compiled + 2
    # each constraint walks its own states: advancing one leaves the other where it was
    assert a is not b and a._states is not b._states
    assert torch.equal(a.mask([[JSON_WORDS.index('{"')]]), b.mask([[JSON_WORDS.index('{"')]]))
    assert torch.equal(a.mask([[]]), b.mask([[]]))
    as_token_constraint(JsonSchema(schema, "flexible"), lm)
    assert compiled_grammars.ROOTS.misses == compiled + 4


def test_the_cache_keeps_at_most_its_bound_least_recently_used_leaving_first():
    cache = LRUCache(3)
    made = []
    for key in "abcd":
        cache.get(key, lambda key=key: made.append(key) or key.upper())
        assert len(cache) <= 3
    # "a" left when "d" came; asking for "b" makes it the most recently used, so "c" leaves next
    assert cache.get("b", lambda: made.append("b!")) == "B"
    cache.get("e", lambda: made.append("e") or "E")
    cache.get("b", lambda: made.append("b!"))
    cache.get("c", lambda: made.append("c") or "C")
    assert made == ["a", "b", "c", "d", "e", "c"] and len(cache) == 3 and cache.misses == 6
    with pytest.raises(ValueError, match="maxsize must be >= 1"):
        LRUCache(0)


def test_distinct_grammars_never_hold_more_than_the_bound(monkeypatch):
    monkeypatch.setattr(compiled_grammars, "ROOTS", LRUCache(4))
    lm = WordLM(JSON_WORDS)
    for n in range(10):
        as_token_constraint(regex_language(f"a{{{n + 1}}}"), lm)
        assert len(compiled_grammars.ROOTS) == min(n + 1, 4)
    # the latest grammar is kept, the first has left
    as_token_constraint(regex_language("a{10}"), lm)
    assert compiled_grammars.ROOTS.misses == 10
    as_token_constraint(regex_language("a{1}"), lm)
    assert compiled_grammars.ROOTS.misses == 11


def test_a_grammar_llguidance_refuses_is_an_error_and_is_not_kept(monkeypatch):
    monkeypatch.setattr(compiled_grammars, "ROOTS", LRUCache(4))
    with pytest.raises(ValueError, match="^invalid test grammar: "):
        compiled_grammars.root_matcher("start: undefined_rule", llguidance_tokenizer(), "test grammar")
    assert len(compiled_grammars.ROOTS) == 0


def llguidance_tokenizer():
    from smc_sd.constraints.llguidance_masks import lm_tokenizer

    return lm_tokenizer(WordLM(JSON_WORDS))[0]


def test_nothing_a_finished_run_used_stays_reachable():
    lm, draft = WordLM(JSON_WORDS), WordLM(JSON_WORDS, seed=1)
    prompt = [JSON_WORDS.index("a")]
    before = live(GrammarConstraint), live(MatcherPool)
    # genlm-control potentials, and a Language as the server builds it
    potentials = [JsonSchema(object_schema(f"run_{i}")) for i in range(3)] + [json_schema_language(object_schema("run_3"))]
    kept = [weakref.ref(p) for p in potentials]
    # one request alone, then the batched engine with every request its own schema
    results = [autoregressive.program(lm, constraints=(potentials[0],)).run(prompt, Schedule(particles=1, max_tokens=4))]
    programs = [smc_speculative.program(lm, draft, draft_len=2, constraints=(p,)) for p in potentials[1:3]]
    programs.append(autoregressive.program(lm, constraints=(potentials[3],)))
    for program, particles in zip(programs, (4, 4, 1)):
        results += program.run_many([prompt, prompt], Schedule(particles=particles, max_tokens=4))
    assert len(results) == 7 and all(r.text is not None for r in results)
    del potentials, programs, results, program
    assert (live(GrammarConstraint), live(MatcherPool)) == before
    assert all(ref() is None for ref in kept)


class NoDoubleA(Potential):
    """The byte strings without "aa", counting its calls (the generic path's potential)."""

    def __init__(self):
        super().__init__(list(range(256)))
        self.calls = 0

    async def prefix(self, context):
        self.calls += 1
        return 0.0 if b"aa" not in bytes(context) else float("-inf")

    async def complete(self, context):
        return await self.prefix(context)


@dataclasses.dataclass(eq=True)
class UnhashableNoDoubleA(NoDoubleA):
    """The same language in a dataclass, whose `__eq__` leaves it without a hash."""

    def __post_init__(self):
        NoDoubleA.__init__(self)


def test_the_generic_paths_masks_are_shared_while_the_potential_lives_then_freed():
    lm = WordLM(JSON_WORDS)
    tables = len(byte_masks_module._BYTE_MASKS)
    potential = NoDoubleA()
    prefixes = [[JSON_WORDS.index("a")], [JSON_WORDS.index("b")]]
    first = as_token_constraint(potential, lm).mask(prefixes)
    calls = potential.calls
    assert len(byte_masks_module._BYTE_MASKS) == tables + 1
    # a later run's lowering answers from the masks the first computed
    assert torch.equal(as_token_constraint(potential, lm).mask(prefixes), first) and potential.calls == calls
    kept = weakref.ref(potential)
    del potential
    gc.collect()
    assert kept() is None and len(byte_masks_module._BYTE_MASKS) == tables
    # a potential without a hash lowers too, its masks then its lowering's own
    unhashable = UnhashableNoDoubleA()
    assert torch.equal(as_token_constraint(unhashable, lm).mask(prefixes), first)
    assert len(byte_masks_module._BYTE_MASKS) == tables
