"""Structured outputs: OpenAI's `response_format` and vLLM's `structured_outputs` body field, read
into the constraint potentials of `smc_sd.programs.constrained.potentials`.

    response_format: {"type": "text"}                      no constraint
                     {"type": "json_object"}               any JSON object
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    structured_outputs: {"json": schema (object or JSON text)} | {"regex": "..."}
                        | {"grammar": "<Lark grammar>"} | {"choice": ["yes", "no", ...]}
                        | {"json_object": true}

At most one constraint per request. `json_layout` ("compact", the default: no whitespace, keys
and punctuation forced; or "flexible") chooses the JSON's layout, as the CLI's --json-layout
does. A schema given as text is parsed here, so a string never
reaches `JsonSchema` as a file path. Invalid schemas, regexes and grammars are 400s carrying the
constraint's own one-line message.
"""

from __future__ import annotations

import json

from smc_sd.constraints.json_depth import JSONTooDeepError, load_json
from smc_sd.constraints.languages import JSON_LAYOUTS
from smc_sd.serve.errors import bad_request
from smc_sd.serve.fields import ARRAY, BOOLEAN, OBJECT, STRING, read, shown

#: the structured_outputs keys this server implements
STRUCTURED_KEYS = ("json", "regex", "grammar", "choice", "json_object")
#: characters with a meaning in llguidance's (Rust) regex syntax
REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def constraint_potentials(body: dict) -> tuple:
    """The potentials `response_format` or `structured_outputs` asks for (empty without either).

    Raises:
        APIError: 400 naming the field, for a malformed field or an invalid constraint.
    """
    from smc_sd.programs.constrained import potentials

    given = [name for name in ("response_format", "structured_outputs") if body.get(name) is not None]
    if len(given) == 2 and read(body, "response_format", OBJECT).get("type") != "text":
        raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
    if "structured_outputs" in given:
        param, kind, value = structured_output(read(body, "structured_outputs", OBJECT))
    elif given:
        param, kind, value = response_format(read(body, "response_format", OBJECT))
    else:
        param, kind, value = None, None, None
    layout = read(body, "json_layout", STRING)
    if layout is not None and kind != "json_schema":
        raise bad_request("json_layout applies to a JSON schema or json_object constraint; give one or drop it", "json_layout")
    if layout is not None and layout not in JSON_LAYOUTS:
        raise bad_request(f"json_layout must be one of {', '.join(sorted(JSON_LAYOUTS))}, got {shown(layout)}", "json_layout")
    if kind is None:
        return ()
    try:
        return potentials(**{kind: value}, **({} if layout is None else {"json_layout": layout}))
    except ValueError as error:
        raise bad_request(" ".join(str(error).split()), param) from None


def response_format(spec: dict) -> tuple[str, str | None, object]:
    """(param, potentials keyword or None, its value) of a response_format object."""
    kind = read(spec, "type", STRING, param="response_format.type")
    if kind == "text":
        return "response_format", None, None
    if kind == "json_object":
        return "response_format", "json_schema", {"type": "object"}
    if kind == "json_schema":
        inner = read(spec, "json_schema", OBJECT, param="response_format.json_schema")
        if inner is None or inner.get("schema") is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format.json_schema.schema")
        return "response_format.json_schema.schema", "json_schema", schema_object(inner["schema"], "response_format.json_schema.schema")
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {shown(kind)}", "response_format.type")


def structured_output(spec: dict) -> tuple[str, str | None, object]:
    """(param, potentials keyword or None, its value) of a structured_outputs object."""
    given = [key for key, value in spec.items() if value is not None]
    unknown = [key for key in given if key not in STRUCTURED_KEYS]
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported; give one of {', '.join(STRUCTURED_KEYS)}",
                          f"structured_outputs.{unknown[0]}", "unsupported_value")
    if len(given) != 1:
        raise bad_request(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}, got {len(given)}",
                          "structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json":
        return param, "json_schema", schema_object(spec[key], param)
    if key == "json_object":
        if read(spec, key, BOOLEAN, param=param) is not True:
            raise bad_request(f"{param} must be true when given", param)
        return param, "json_schema", {"type": "object"}
    if key == "choice":
        return param, "regex", choice_regex(read(spec, key, ARRAY, param=param), param)
    return param, key, read(spec, key, STRING, param=param)


def schema_object(schema, param: str):
    """A JSON schema given as an object, a boolean or JSON text, as a Python object."""
    if isinstance(schema, str):
        try:
            schema = load_json(schema, param)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param} is not valid JSON: {error}", param) from None
        except JSONTooDeepError as error:
            raise bad_request(str(error), param, code="json_too_deep") from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object), got {shown(schema)}", param)
    return schema


def choice_regex(choices: list, param: str) -> str:
    """The regex matching exactly one of the strings (each escaped)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise bad_request(f"{param} must be a non-empty array of strings, got {shown(choices)}", param)
    return "|".join("(" + "".join("\\" + ch if ch in REGEX_META else ch for ch in c) + ")" for c in choices)
