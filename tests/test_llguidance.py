"""llguidance masks: exact against brute force on toy vocabularies, the constructors' errors, the
token budget as part of the target, and the exact check behind an over-approximated schema."""

import asyncio
import itertools
import json
import math

import pytest
import regex
import torch

from smc_sd.backends.toy import ToyLM
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import Schedule
from smc_sd.constraints.grammars import Grammar, JsonSchema, Regex
from smc_sd.constraints.llguidance_masks import GrammarConstraint, unpack_bitmask
from smc_sd.constraints.potentials import BytePotentialConstraint, as_token_constraint
from smc_sd.programs import mask_at_verify, smc_speculative
from tests.toy_programs import PROMPT, WordLM, sample_completions, target_and_draft


def brute_force_masks(lm, prefixes, viable, complete) -> torch.Tensor:
    """mask[b, v] = viable(text(prefix_b) + text(v)), mask[b, EOS] = complete(text(prefix_b))."""
    eos = lm.vocabulary.eos_token_id
    rows = []
    for prefix in prefixes:
        text = lm.decode(prefix)
        rows.append([complete(text) if v == eos else viable(text + lm.decode([v])) for v in range(lm.vocabulary.size)])
    return torch.tensor(rows, dtype=torch.bool)


def all_prefixes(lm, length: int) -> list[list[int]]:
    letters = range(lm.vocabulary.size - 1)
    return [list(p) for n in range(length + 1) for p in itertools.product(letters, repeat=n)]


REGEX = "(ab|b)*c?a"
REGEX_WORDS = ["a", "b", "c", "ab", "ba", "bc", "abc", "ca"]
LARK = 'start: expr\nexpr: term | expr "+" term\nterm: "1" | "(" expr ")"'
LARK_WORDS = ["1", "+", "(", ")", "1+", "((", "))", "+1", ")+"]


def regex_oracle(pattern):
    return (lambda s: regex.fullmatch(pattern, s, partial=True) is not None), (lambda s: regex.fullmatch(pattern, s) is not None)


def cfg_oracle(lark):
    """genlm-control's Earley parser over bytes: an implementation independent of llguidance."""
    from genlm.control import BoolCFG

    cfg = BoolCFG.from_lark(lark)
    loop = asyncio.new_event_loop()
    viable = lambda s: loop.run_until_complete(cfg.prefix(s.encode())) == 0.0  # noqa: E731
    complete = lambda s: loop.run_until_complete(cfg.complete(s.encode())) == 0.0  # noqa: E731
    return viable, complete


@pytest.mark.parametrize(
    "make,words,oracle",
    [
        (lambda: Regex(REGEX), REGEX_WORDS, lambda: regex_oracle(REGEX)),
        (lambda: Grammar(LARK), LARK_WORDS, lambda: cfg_oracle(LARK)),
        # genlm-control's own potentials, read back into llguidance grammars
        (lambda: __import__("genlm.control", fromlist=["BoolFSA"]).BoolFSA.from_regex(REGEX), REGEX_WORDS, lambda: regex_oracle(REGEX)),
        (lambda: __import__("genlm.control", fromlist=["BoolCFG"]).BoolCFG.from_lark(LARK), LARK_WORDS, lambda: cfg_oracle(LARK)),
    ],
    ids=["Regex", "Grammar", "BoolFSA", "BoolCFG"],
)
def test_llguidance_masks_equal_brute_force_masks(make, words, oracle):
    lm = WordLM(words)
    constraint = as_token_constraint(make(), lm)
    assert isinstance(constraint, GrammarConstraint)
    prefixes = all_prefixes(lm, 3)
    expected = brute_force_masks(lm, prefixes, *oracle())
    # one batch, and again in shuffled small batches (the matcher pool must not depend on order)
    assert torch.equal(constraint.mask(prefixes), expected)
    order = torch.randperm(len(prefixes), generator=torch.Generator().manual_seed(0)).tolist()
    for start in range(0, len(order), 7):
        rows = order[start : start + 7]
        assert torch.equal(constraint.mask([prefixes[i] for i in rows]), expected[rows])


def test_generic_path_masks_equal_brute_force_masks():
    from genlm.control import BoolCFG

    lm = WordLM(LARK_WORDS)
    constraint = BytePotentialConstraint(BoolCFG.from_lark(LARK), lm)
    prefixes = all_prefixes(lm, 2)
    assert torch.equal(constraint.mask(prefixes), brute_force_masks(lm, prefixes, *cfg_oracle(LARK)))


def test_bitmask_unpacking_matches_bit_arithmetic():
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int64, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    expected = torch.tensor([[(int(words[b, t // 32]) >> (t % 32)) & 1 for t in range(150)] for b in range(3)], dtype=torch.bool)
    assert torch.equal(unpack_bitmask(words, 150), expected)
    # rows past the bit words (the LM's padding rows) are never allowed
    assert not unpack_bitmask(words, 170)[:, 160:].any()


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Regex("("), r"invalid regex '\(': .*unclosed group"),
        (lambda: Grammar("start: foo"), 'invalid Lark grammar: unknown name: "foo"'),
        (lambda: JsonSchema("{not json"), "not valid JSON"),
        (lambda: JsonSchema({"type": "strin"}), "invalid JSON schema: 'strin' is not valid"),
        (lambda: JsonSchema({"type": "string", "format": "url"}), "format 'url' can be enforced neither"),
        (lambda: JsonSchema({"type": "string", "pattern": "(a"}), r"invalid JSON schema: '\(a' is not a 'regex'"),
        # valid schemas (they pass the metaschema) that llguidance cannot compile
        (lambda: JsonSchema(TREE_WITH_SIBLING_KEYS), "^unsupported JSON schema feature: circular references with sibling keys"),
        (lambda: JsonSchema({"type": "string", "pattern": "(?=a)b"}), "^unsupported JSON schema feature: regex parse error: look-around"),
        (lambda: JsonSchema({"type": "integer", "minimum": 5, "maximum": 2}), r"^the JSON schema admits no value: minimum \(5\) is greater"),
    ],
)
def test_bad_constraints_raise_one_line_errors(make, message):
    with pytest.raises(ValueError, match=message) as error:
        make()
    assert "\n" not in str(error.value)


# a tree whose child reference carries a sibling keyword
TREE_WITH_SIBLING_KEYS = {
    "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node", "minProperties": 1}}}},
    "$ref": "#/$defs/node",
}


def test_json_has_no_whitespace_before_or_after_the_value():
    lm = WordLM(["[", "1", "]", "\n", " "])
    potential = JsonSchema({"type": "array", "items": {"type": "integer"}})
    start, closed = as_token_constraint(potential, lm).mask([[], [0, 1, 2]])
    # no whitespace before "[" or after "]": EOS right after "]", nothing else
    assert start.tolist() == [True, False, False, False, False, False]
    assert closed.tolist() == [False, False, False, False, False, True]
    assert asyncio.run(potential.complete(b"[1]")) == 0.0
    for text in (b"[1]\n", b"[1] ", b" [1]"):
        assert asyncio.run(potential.prefix(text)) == float("-inf")


def test_json_schema_from_text_and_file(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for given in (schema, json.dumps(schema), str(path), path):
        potential = JsonSchema(given)
        assert asyncio.run(potential.complete(b'{"n":3}')) == 0.0
        assert asyncio.run(potential.complete(b'{"n":"3"}')) == float("-inf")


def test_an_unknown_json_layout_is_refused():
    with pytest.raises(ValueError, match="unknown JSON layout 'pretty'"):
        JsonSchema({"type": "integer"}, layout="pretty")


def test_one_of_is_over_approximated_and_checked_exactly():
    overlapping = JsonSchema({"oneOf": [{"type": "integer", "maximum": 15}, {"type": "integer", "minimum": 10}]})
    assert overlapping.approximations and overlapping.exact_check is not None
    # 12 matches both branches: the mask lets it through, the exact check does not
    assert asyncio.run(overlapping.prefix(b"12")) == 0.0
    assert asyncio.run(overlapping.complete(b"12")) == float("-inf")
    assert asyncio.run(overlapping.complete(b"16")) == 0.0 and asyncio.run(overlapping.complete(b"7")) == 0.0
    assert JsonSchema({"type": "integer"}).exact_check is None


def test_genlm_control_smc_runs_our_potentials():
    from genlm.control import SMC, direct_token_sampler

    sampler = SMC(direct_token_sampler(Regex("[0-9]{1,3}")), critic=JsonSchema({"type": "integer", "multipleOf": 2}))
    sequences = asyncio.run(sampler(n_particles=32, ess_threshold=0.5, max_tokens=5))
    weighted = [c for c, logw in zip(sequences.contexts, sequences.log_weights) if logw > float("-inf")]
    assert weighted
    for context in weighted:
        text = bytes(t for t in context if isinstance(t, int))
        assert int(text) % 2 == 0 and str(int(text)).encode() == text


BUDGET = 3


def test_budget_gives_incomplete_strings_weight_zero():
    # "aaa" and "abc" are complete when the budget cuts them; "aba", "abb" are not and get phi = 0
    target, draft = target_and_draft(noise=1.0)
    potential = Regex("(a|b)*c|a+")
    constraint = as_token_constraint(potential, target)
    exact, _ = target.completion_distribution(PROMPT, BUDGET, constraint=constraint)
    local, _ = target.completion_distribution(PROMPT, BUDGET, constraint=constraint, local=True)

    def in_language(x) -> bool:
        text = target.decode(list(x))
        return regex.fullmatch("(a|b)*c|a+", text) is not None

    assert all(in_language(x) for x in exact)
    # the local projection (what ignoring the budget rule returns) puts real mass on cut strings
    assert sum(p for x, p in local.items() if not in_language(x)) > 0.1
    runs = 300
    program = smc_speculative.program(target, draft, draft_len=2, constraints=(potential,))
    samples = sample_completions(program, Schedule(16, max_tokens=BUDGET), runs)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, runs)


def test_no_complete_particle_returns_an_incomplete_string_marked_as_such():
    target, draft = target_and_draft(noise=1.0)
    for program in (
        smc_speculative.program(target, draft, draft_len=1, constraints=(Regex("aaaa"),)),
        mask_at_verify.program(target, draft, draft_len=1, constraints=(Regex("aaaa"),)),
    ):
        result = program.run(PROMPT, Schedule(4 if program.name == "smc-sd" else 1, max_tokens=2), seed=0)
        assert result.text == "aa" and not result.complete and result.to_json()["complete"] is False
        if program.name == "smc-sd":
            assert result.log_ml == -math.inf
    result = smc_speculative.program(target, draft, draft_len=1, constraints=(Regex("aaaa"),)).run(PROMPT, Schedule(4, max_tokens=5), seed=0)
    assert result.complete and result.text == "aaaa"


DIGITS = ["1", "2", "0"]


def test_over_approximated_schema_targets_the_exact_conditional():
    # oneOf read as anyOf lets 10..20 (in both branches) through the masks; the exact check at
    # completion (also of strings the budget cuts, such as "120") removes them from the target
    schema = {"oneOf": [{"type": "integer", "minimum": 10}, {"type": "integer", "maximum": 20}]}
    target = WordLM(DIGITS, seed=7)
    draft = ToyLM.perturbed(target, 1.0)
    potential = JsonSchema(schema)
    masked, _ = target.completion_distribution(PROMPT, BUDGET, constraint=as_token_constraint(potential, target))
    valid = {x: p for x, p in masked.items() if potential.exact_check(target.decode(list(x)).encode())}
    exact = {x: p / sum(valid.values()) for x, p in valid.items()}
    runs = 300
    tolerance = tv_tolerance(exact, runs)
    # without the check the sampler would follow `masked`, which the test tells apart
    assert total_variation(masked, exact) > tolerance + 0.05
    program = smc_speculative.program(target, draft, draft_len=2, constraints=(potential,))
    samples = sample_completions(program, Schedule(16, max_tokens=BUDGET), runs)
    assert total_variation(empirical(samples), exact) < tolerance
    with pytest.raises(ValueError, match="over-approximated"):
        mask_at_verify.program(target, draft, constraints=(potential,)).run(PROMPT, Schedule(1, max_tokens=BUDGET))


def test_products_split_into_factors_each_lowered():
    from genlm.control import JsonSchema as GenlmJsonSchema
    from genlm.control import Potential

    from smc_sd.constraints.token_constraints import ConjunctionConstraint

    lm = WordLM(LARK_WORDS)
    # genlm-control's JsonSchema is itself a product: it is read back whole
    assert isinstance(as_token_constraint(GenlmJsonSchema({"type": "integer"}), lm), GrammarConstraint)
    # Grammar * a user potential llguidance cannot read: each factor takes its own path
    class NoClosing(Potential):
        def __init__(self):
            super().__init__(list(range(256)))

        async def prefix(self, context):
            return 0.0 if b"))" not in bytes(context) else float("-inf")

        async def complete(self, context):
            return await self.prefix(context)

    product = as_token_constraint(Grammar(LARK) * NoClosing(), lm)
    assert isinstance(product, ConjunctionConstraint)
    assert [type(m).__name__ for m in product.members] == ["GrammarConstraint", "BytePotentialConstraint"]
    viable, complete = cfg_oracle(LARK)
    prefixes = all_prefixes(lm, 2)
    expected = brute_force_masks(lm, prefixes, lambda s: viable(s) and "))" not in s, lambda s: complete(s) and "))" not in s)
    assert torch.equal(product.mask(prefixes), expected)


def test_the_coverage_benchmark_items_build_except_the_unenforceable_one():
    import pathlib

    folder = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "schemas"
    prompts = json.loads((folder / "prompts.json").read_text())
    files = [p for p in folder.iterdir() if p.suffix in (".json", ".lark") and p.name != "prompts.json"]
    assert len(files) >= 20 and {p.stem for p in files} == set(prompts)
    refused = []
    for path in files:
        try:
            JsonSchema(path) if path.suffix == ".json" else Grammar(path.read_text())
        except ValueError as error:
            refused.append((path.stem, str(error)))
    assert refused == [("url_format", "JSON schema format 'url' can be enforced neither by llguidance nor by jsonschema")]
