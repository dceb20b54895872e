"""Masks allow every tokenization of the bytes a constraint forces.

Where the language forces the next bytes, every token spelling a prefix of them (or those bytes
followed by a viable continuation) keeps the string completable, so the mask must allow each of
them, not only the first token of their canonical tokenization. Vocabularies here are drawn at
random from substrings of strings in the language, so forced spans have many tokenizations, and
masks are compared with brute force from each potential's own prefix/complete semantics.
"""

import asyncio
import functools
import random

import llguidance
import pytest
import regex
import torch

from smc_sd.constraints.grammars import Grammar, JsonSchema, Regex
from smc_sd.constraints.languages import byte_tokenizer
from smc_sd.constraints.llguidance_masks import GrammarConstraint
from smc_sd.constraints.potentials import as_token_constraint
from tests.test_llguidance import WordLM, brute_force_masks, cfg_oracle, regex_oracle


def potential_oracle(potential):
    """viable(text), complete(text) from a byte potential's own `prefix` and `complete`."""
    loop = asyncio.new_event_loop()

    @functools.lru_cache(maxsize=None)
    def viable(text: str) -> bool:
        return loop.run_until_complete(potential.prefix(text.encode())) == 0.0

    @functools.lru_cache(maxsize=None)
    def complete(text: str) -> bool:
        return loop.run_until_complete(potential.complete(text.encode())) == 0.0

    return viable, complete


def genlm_fsa(pattern):
    from genlm.control import BoolFSA

    return BoolFSA.from_regex(pattern)


PARENS = r"(\(\))+"
CHUNKS = "x(abc|abd)+(yz)?"
KEY = r'\{"key":[0-9]{1,2}\}'
LIST = 'start: item ("," item)*\nitem: "true" | "null" | "[" start "]"'
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tag": {"enum": ["ab", "abc"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}

# name: (the constraint, the brute-force oracle, strings of the language)
CASES = {
    "regex parens": (lambda: Regex(PARENS), lambda: regex_oracle(PARENS), ["()", "()()()"]),
    "regex chunks": (lambda: Regex(CHUNKS), lambda: regex_oracle(CHUNKS), ["xabcabd", "xabdabcabcyz"]),
    "regex key": (lambda: Regex(KEY), lambda: regex_oracle(KEY), ['{"key":7}', '{"key":42}']),
    "lark": (lambda: Grammar(LIST), lambda: cfg_oracle(LIST), ["true", "[null,true]", "[[true]],null"]),
    "json schema": (lambda: JsonSchema(SCHEMA), lambda: potential_oracle(JsonSchema(SCHEMA)), ['{"id":1,"tag":"ab"}', '{"id":23,"tag":"abc"}']),
    "genlm BoolFSA": (lambda: genlm_fsa(KEY), lambda: potential_oracle(genlm_fsa(KEY)), ['{"key":7}', '{"key":42}']),
    # a non-ASCII automaton: its arcs read the two UTF-8 bytes of é one by one
    "genlm BoolFSA non-ASCII": (lambda: genlm_fsa("(é|e)+xé"), lambda: potential_oracle(genlm_fsa("(é|e)+xé")), ["éxé", "eéexé"]),
}


def random_words(samples: list[str], seed: int, draws: int = 12) -> list[str]:
    """Every character of the samples, and `draws` random substrings of 2 to 4 characters of them."""
    rng = random.Random(seed)
    words = {c for s in samples for c in s}
    for _ in range(draws):
        s = rng.choice(samples)
        start = rng.randrange(len(s) - 1)
        words.add(s[start : start + rng.randint(2, 4)])
    return sorted(words)


def random_tokenization(text: str, words: list[str], rng: random.Random) -> list[int]:
    """Token ids spelling `text`, each next token drawn uniformly among the words that fit."""
    out, i = [], 0
    while i < len(text):
        fitting = [t for t, w in enumerate(words) if text.startswith(w, i)]
        out.append(rng.choice(fitting))
        i += len(words[out[-1]])
    return out


def test_masks_allow_the_non_canonical_first_token():
    # "(" then ")" spells "()", which the language holds: "(" is allowed at the start
    lm = WordLM(["(", ")", "()", "(("])
    mask = as_token_constraint(Regex(PARENS), lm).mask([[]])
    assert mask.tolist() == [[True, False, True, False, False]]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_masks_equal_brute_force_for_every_tokenization(case, seed):
    make, oracle, samples = CASES[case]
    words = random_words(samples, seed)
    lm = WordLM(words, seed=seed)
    constraint = as_token_constraint(make(), lm)
    assert isinstance(constraint, GrammarConstraint)
    rng = random.Random(seed)
    letters = range(len(words))
    # every prefix of one token, 64 random ones of two, and every prefix of random tokenizations
    # of the samples
    prefixes = [[]] + [[a] for a in letters] + [[rng.choice(letters), rng.choice(letters)] for _ in range(64)]
    for text in samples * 4:
        tokens = random_tokenization(text, words, rng)
        prefixes += [tokens[:n] for n in range(1, len(tokens) + 1)]
    expected = brute_force_masks(lm, prefixes, *oracle())
    assert torch.equal(constraint.mask(prefixes), expected)


def byte_brute_force_mask(lm, prefix: list[int], viable, complete) -> list[bool]:
    """mask[v] = viable(bytes(prefix) + bytes(v)), mask[EOS] = complete(bytes(prefix)); special
    tokens and padding rows (no bytes) are never allowed."""
    from smc_sd.constraints.byte_vocabulary import token_bytes

    vocabulary = token_bytes(lm)
    context = b"".join(vocabulary[t] for t in prefix)
    eos = lm.vocabulary.eos_token_id
    return [complete(context) if t == eos else data is not None and viable(context + data) for t, data in enumerate(vocabulary)]


@pytest.mark.model
def test_smollm2_masks_allow_every_prefix_token_of_a_forced_key(default_lm):
    # after '{"' the schema forces 'name_of_the_person"': its canonical first token is "name", but
    # "n", "na" and "nam" spell the same bytes in more tokens and must be allowed too (and "t",
    # "th", "the" after '{"name_of_')
    schema = {
        "type": "object",
        "properties": {"name_of_the_person": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name_of_the_person", "age"],
        "additionalProperties": False,
    }
    tokenizer = default_lm.tokenizer
    potential = JsonSchema(schema)
    constraint = as_token_constraint(potential, default_lm)
    for context, shorter in (('{"', ["n", "na", "nam", "name"]), ('{"name_of_', ["t", "th", "the"])):
        # the schema's grammar over single bytes after the context: a token's bytes are viable
        # iff the byte matcher would accept all of them (validate_tokens leaves it unchanged)
        matcher = llguidance.LLMatcher(byte_tokenizer(), potential.grammar, log_level=0)
        assert matcher.consume_tokens(list(context.encode()))

        def viable(data: bytes) -> bool:
            return matcher.validate_tokens(list(data[len(context) :])) == len(data) - len(context)

        def complete(data: bytes) -> bool:
            # asked of the context alone
            return matcher.is_accepting()

        prefix = tokenizer.encode(context, add_special_tokens=False)
        mask = constraint.mask([prefix])[0]
        assert mask.tolist() == byte_brute_force_mask(default_lm, prefix, viable, complete)
        assert mask[tokenizer.convert_tokens_to_ids(shorter)].all()


@pytest.mark.model
def test_smollm2_masks_of_a_non_ascii_automaton_equal_brute_force(default_lm):
    # "é" is the bytes C3 A9: a token holding only C3 is allowed where C3 fits
    constraint = as_token_constraint(genlm_fsa("é+"), default_lm)
    assert isinstance(constraint, GrammarConstraint)
    pattern = regex.compile(rb"(\xc3\xa9)+")
    viable = lambda data: pattern.fullmatch(data, partial=True) is not None  # noqa: E731
    complete = lambda data: pattern.fullmatch(data) is not None  # noqa: E731
    tokenizer = default_lm.tokenizer
    half, whole = tokenizer.convert_tokens_to_ids(["Ã", "Ã©"])
    for prefix in ([], [whole], [half], [whole, half]):
        mask = constraint.mask([prefix])[0]
        assert mask.tolist() == byte_brute_force_mask(default_lm, prefix, viable, complete)
    assert constraint.mask([[]])[0, [half, whole]].all()
