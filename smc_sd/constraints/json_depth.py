"""A bound on how deeply JSON may nest: request bodies, and JSON schemas from any source.

Parsing, validating and lowering JSON recurse once or more per level of nesting, so a document
nested about a thousand levels deep (a schema of 500 nested objects) exhausts Python's recursion
limit somewhere inside them. Input nested past `MAX_JSON_DEPTH` levels is refused up front with
one line naming the limit. The depth counts arrays and objects: a scalar is 0 deep, `{}` and
`[]` are 1, `{"a": [1]}` is 2. A schema of n nested objects, `{"type": "object", "properties":
{"a": ...}}` around `{"type": "integer"}`, is 2n + 1 deep. (llguidance refuses such a schema
past 61 objects by itself, with an error of its own; without the bound, Python's recursion
gave out in `json_schema_language` between 64 and 100 objects.)
"""

from __future__ import annotations

import json

#: the deepest nesting of arrays and objects accepted (request bodies and schemas alike)
MAX_JSON_DEPTH = 128


class JSONTooDeepError(ValueError):
    """JSON nested past `MAX_JSON_DEPTH` levels."""


def check_json_depth(value, what: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse `value` (parsed JSON: dicts, lists, scalars) if it nests past `limit` levels.

    The walk is iterative and stops at the first container past the limit, so it costs at most
    the size of the value and never recurses.

    Raises:
        JSONTooDeepError: "`what` nests arrays and objects more than `limit` levels deep".
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth + 1 > limit:
            raise JSONTooDeepError(too_deep(what, limit))
        stack.extend((child, depth + 1) for child in children)


def load_json(text: str | bytes, what: str, limit: int = MAX_JSON_DEPTH):
    """`json.loads(text)` bounded in depth: text nested past `limit` levels (deep enough to
    exhaust the parser's own recursion, or merely past the limit) is refused.

    Raises:
        json.JSONDecodeError: text that is not JSON.
        JSONTooDeepError: naming `what` and the limit.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONTooDeepError(too_deep(what, limit)) from None
    check_json_depth(value, what, limit)
    return value


def too_deep(what: str, limit: int) -> str:
    return f"{what} nests arrays and objects more than {limit} levels deep (the limit is {limit})"
