"""The extraction benchmark's items: well-formed, each answer valid under its schema, every schema
enforced exactly by llguidance, and the compact answer a string of the fixed-layout JSON grammar."""

import json
import pathlib

import llguidance
import pytest

from smc_sd.constraints.grammars import JsonSchema
from smc_sd.constraints.json_validation import schema_validator
from smc_sd.constraints.languages import byte_tokenizer

ITEMS = json.loads((pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "extraction_items.json").read_text())
# llguidance's fixed JSON layout: no free whitespace, separators without spaces
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def by_name(test):
    return pytest.mark.parametrize("item", ITEMS, ids=[item["name"] for item in ITEMS])(test)


def objects(schema):
    """Every object schema in a schema: itself, its properties' and its array items' (recursively)."""
    if schema.get("type") == "object":
        yield schema
        for sub in schema["properties"].values():
            yield from objects(sub)
    if schema.get("type") == "array":
        yield from objects(schema["items"])


def string_leaves(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for sub in value.values():
            yield from string_leaves(sub)
    elif isinstance(value, list):
        for sub in value:
            yield from string_leaves(sub)


def accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for the grammar takes the text's bytes and accepts there."""
    matcher = llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_enough_items_with_distinct_names():
    names = [item["name"] for item in ITEMS]
    assert len(names) >= 24 and len(set(names)) == len(names)


@by_name
def test_item_shape(item):
    assert set(item) == {"name", "document", "schema", "answer"}
    assert 40 <= len(item["document"].split()) <= 120
    assert 3 <= len(item["schema"]["properties"]) <= 8
    for schema in objects(item["schema"]):
        assert schema["required"] == list(schema["properties"])
        assert schema["additionalProperties"] is False


@by_name
def test_answer_is_valid_and_ordered_like_its_schema(item):
    schema_validator(item["schema"]).validate(item["answer"])

    def same_order(schema, value):
        if schema.get("type") == "object":
            assert list(value) == list(schema["properties"])
            for key, sub in schema["properties"].items():
                same_order(sub, value[key])
        if schema.get("type") == "array":
            for sub in value:
                same_order(schema["items"], sub)

    # llguidance writes properties in the schema's order
    same_order(item["schema"], item["answer"])


@by_name
def test_answer_strings_mostly_appear_in_the_document(item):
    strings = list(string_leaves(item["answer"]))
    found = [s for s in strings if s in item["document"]]
    assert len(found) >= len(strings) / 2, f"not in the document: {sorted(set(strings) - set(found))}"


@by_name
def test_llguidance_enforces_the_schema_in_a_fixed_layout(item):
    schema, answer = item["schema"], item["answer"]
    # exact: no over-approximation left to a check at completion
    assert JsonSchema(schema).exact_check is None
    compact = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    assert llguidance.LLMatcher.validate_grammar(compact) == ""
    spaced = json.dumps(answer)
    assert accepts(compact, json.dumps(answer, separators=(",", ":")))
    assert not accepts(compact, spaced)
    assert accepts(llguidance.LLMatcher.grammar_from_json_schema(schema), spaced)
