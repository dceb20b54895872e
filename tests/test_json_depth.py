"""JSON nested past `MAX_JSON_DEPTH` levels is refused in one line naming the limit, wherever it
comes from (a schema as a dict or as text; the server's body and the CLI's flag are tested in
test_serve and test_cli), and JSON at the limit passes."""

import json

import pytest

from smc_sd.constraints.json_depth import MAX_JSON_DEPTH, JSONTooDeepError, check_json_depth, load_json
from smc_sd.constraints.languages import json_schema_language


def nested_objects(n: int) -> dict:
    """A schema of n nested objects around an integer: 2n + 1 levels deep."""
    schema = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_objects_text(n: int) -> str:
    """`nested_objects(n)` as JSON text (json.dumps recurses once per level)."""
    text = '{"type": "integer"}'
    for _ in range(n):
        text = f'{{"type": "object", "properties": {{"a": {text}}}, "required": ["a"]}}'
    return text


def nested_lists(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_depth_counts_arrays_and_objects():
    for value, depth in [(1, 0), ({}, 1), ([], 1), ({"a": [1]}, 2), ([[], [[{}]]], 4), (nested_objects(3), 7)]:
        check_json_depth(value, "x", limit=depth)
        if depth:
            with pytest.raises(JSONTooDeepError):
                check_json_depth(value, "x", limit=depth - 1)


def test_the_limit_passes_and_one_more_level_is_refused():
    assert load_json(nested_lists(MAX_JSON_DEPTH), "the body") is not None
    with pytest.raises(JSONTooDeepError, match=f"^the body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"):
        load_json(nested_lists(MAX_JSON_DEPTH + 1), "the body")


def test_json_deep_enough_to_exhaust_the_parser_is_refused_not_a_recursion_error():
    for depth in (1_000, 100_000):
        with pytest.raises(JSONTooDeepError, match=f"more than {MAX_JSON_DEPTH} levels"):
            load_json(nested_lists(depth), "the body")
    # built in Python, as deep as the parser cannot read: the walk does not recurse
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(JSONTooDeepError):
        check_json_depth(deep, "x")


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_of_500_nested_objects_is_one_line(as_text):
    assert json.loads(nested_objects_text(3)) == nested_objects(3)
    schema = nested_objects_text(500) if as_text else nested_objects(500)
    with pytest.raises(JSONTooDeepError, match=f"^the JSON schema nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"):
        json_schema_language(schema)
    # within the limit, the schema compiles
    assert json_schema_language(nested_objects(60)).grammar
