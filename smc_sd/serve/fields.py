"""Typed reads of a JSON request body, each refusal a 400 naming the field.

JSON null reads as "not given" (clients send null for unset fields). JSON has one number type:
an integer field takes 4 but not 4.5 or true; a number field takes 4 and 4.5 but not true.
"""

from __future__ import annotations

import json

from smc_sd.serve.errors import bad_request

#: what a field's type is called in messages
INTEGER, NUMBER, STRING, BOOLEAN, OBJECT, ARRAY = "an integer", "a number", "a string", "a boolean", "an object", "an array"


def shown(value) -> str:
    """A value as JSON, cut to 60 characters, for messages."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_kind(value, kind: str) -> bool:
    """Whether a JSON value has the kind (booleans are not numbers)."""
    if kind == BOOLEAN:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, {INTEGER: int, NUMBER: (int, float), STRING: str, OBJECT: dict, ARRAY: list}[kind])


def read(body: dict, name: str, kind: str, default=None, param: str | None = None):
    """body[name] checked to be of `kind`, or `default` when absent or null.

    Raises:
        APIError: 400 "<param> must be <kind>, got <value>".
    """
    value = body.get(name)
    if value is None:
        return default
    if not is_kind(value, kind):
        raise bad_request(f"{param or name} must be {kind}, got {shown(value)}", param or name)
    return value


def check_fields(body: dict, supported: set[str], neutral: dict, ignored: set[str]) -> None:
    """Refuse every field the server would otherwise drop silently.

    Args:
        supported: fields the endpoint implements.
        neutral: fields it does not implement, each with the values that mean "off" (a tuple),
            which are accepted: e.g. top_p 1, presence_penalty 0.
        ignored: fields that do not change the output (user, metadata), accepted as they are.

    Raises:
        APIError: 400 naming the first field that is unknown or set to a value it cannot honour.
    """
    for name, value in body.items():
        if name in supported or name in ignored or value is None:
            continue
        if name in neutral:
            if value not in neutral[name]:
                raise bad_request(f"{name} {shown(value)} is not supported by smc-sd serve "
                                  f"(only {' or '.join(map(shown, neutral[name]))})", name, "unsupported_value")
            continue
        raise bad_request(f"unknown field {name!r}; smc-sd serve reads {', '.join(sorted(supported))}",
                          name, "unknown_field")
