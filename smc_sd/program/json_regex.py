"""JSON schemas as regular expressions, so they become `BoolFSA` constraints with exact token masks.

A schema built from objects (properties emitted in the schema's order), arrays (items, minItems,
maxItems), strings (minLength, maxLength), integers, numbers, booleans, null, enum and const is a
regular language once nesting is bounded by the schema itself. The regex accepts a subset of the
JSON texts valid under the schema: every listed property appears, in order; whitespace is at most
one space after ':' and ','; strings are printable ASCII with JSON escapes. Every string it accepts
validates against the schema. Anything else (anyOf, $ref, patternProperties, ...) raises
`UnsupportedSchemaError`; genlm-control's `JsonSchema` potential covers those, more slowly.
"""

from __future__ import annotations

import json
import re

# printable ASCII except '"' and '\', or a JSON escape
STRING_CHAR = r'([ !#-\[\]-~]|\\["\\/bfnrt])'
INTEGER = r"-?(0|[1-9][0-9]{0,15})"
NUMBER = INTEGER + r"(\.[0-9]{1,15})?([eE][+-]?[0-9]{1,3})?"
SPACE = "[ ]?"


class UnsupportedSchemaError(ValueError):
    """The schema uses a feature this translation does not cover."""


def literal(value) -> str:
    """A regex matching exactly the JSON text of `value`."""
    return re.escape(json.dumps(value))


def schema_regex(schema: dict) -> str:
    """A regex whose language is a subset of the JSON texts valid under `schema` (module docstring).

    Raises:
        UnsupportedSchemaError: naming the first feature that is not covered.
    """
    if "enum" in schema:
        return "(" + "|".join(literal(v) for v in schema["enum"]) + ")"
    if "const" in schema:
        return literal(schema["const"])
    kind = schema.get("type")
    if kind == "object":
        return object_regex(schema)
    if kind == "array":
        return array_regex(schema)
    if kind == "string":
        # a bounded length costs one automaton state (and one mask walk) per character
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return f'"{STRING_CHAR}{{{low},{high}}}"'
    if kind == "integer":
        return INTEGER
    if kind == "number":
        return NUMBER
    if kind == "boolean":
        return "(true|false)"
    if kind == "null":
        return "null"
    unsupported = sorted(set(schema) - {"title", "description", "$schema"})
    raise UnsupportedSchemaError(f"cannot translate the schema part {unsupported or schema!r} to a regex")


def object_regex(schema: dict) -> str:
    """{"p1": v1, "p2": v2, ...} with every property of the schema, in order."""
    properties = schema.get("properties", {})
    if not properties:
        return r"\{\}"
    members = [literal(name) + SPACE + ":" + SPACE + schema_regex(sub) for name, sub in properties.items()]
    return r"\{" + ("," + SPACE).join(members) + r"\}"


def array_regex(schema: dict) -> str:
    """[item, item, ...] with minItems .. maxItems items."""
    item = schema_regex(schema.get("items", {"type": "string"}))
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if high == 0:
        return r"\[\]"
    rest = f"(,{SPACE}{item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
    body = f"{item}{rest}"
    return r"\[" + (body if low >= 1 else f"({body})?") + r"\]"


def json_schema_potential(schema: dict):
    """The genlm-control potential of a JSON schema: a `BoolFSA` from `schema_regex` when the
    schema is covered, else genlm-control's own `JsonSchema` (exact but slow to mask)."""
    from genlm.control import BoolFSA, JsonSchema

    try:
        return BoolFSA.from_regex(schema_regex(schema))
    except UnsupportedSchemaError:
        return JsonSchema(schema)
