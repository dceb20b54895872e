"""jsonschema validators, imported without the cost of the iri format checks.

`import jsonschema` imports `rfc3987_syntax` (when installed, as genlm-control's
`jsonschema[format-nongpl]` installs it) to check the formats `iri` and `iri-reference`, and that
module builds 38 Lark parsers as it imports: 2.6 s of the README's first command on one core,
for formats few schemas use. `jsonschema_module` imports jsonschema with a stand-in for
`rfc3987_syntax` whose `is_valid_syntax` imports the real module at its first call and hands the
call over, so jsonschema registers exactly the checks it would (the same formats, drafts and
errors) and the parsers are built only when a schema checks an iri. The stand-in leaves
`sys.modules` once jsonschema is imported; a process that imported jsonschema before keeps it
as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

#: the module jsonschema's iri format checks import
IRI_SYNTAX = "rfc3987_syntax"
_IMPORTING = threading.Lock()


def is_valid_syntax(term: str, value: str) -> bool:
    """`rfc3987_syntax.is_valid_syntax`, the real module imported at the first call."""
    return importlib.import_module(IRI_SYNTAX).is_valid_syntax(term, value)


def jsonschema_module() -> types.ModuleType:
    """jsonschema, imported with `rfc3987_syntax` deferred to its first use (module docstring)."""
    # one stand-in at a time (server threads may compile schemas at once)
    with _IMPORTING:
        if "jsonschema" in sys.modules or IRI_SYNTAX in sys.modules or importlib.util.find_spec(IRI_SYNTAX) is None:
            return importlib.import_module("jsonschema")
        stand_in = types.ModuleType(IRI_SYNTAX)
        stand_in.is_valid_syntax = is_valid_syntax
        sys.modules[IRI_SYNTAX] = stand_in
        try:
            return importlib.import_module("jsonschema")
        finally:
            del sys.modules[IRI_SYNTAX]


def schema_validator(schema):
    """A jsonschema validator for the schema's draft, checking formats.

    Raises:
        ValueError: "invalid JSON schema: ..." when the schema breaks its metaschema.
    """
    jsonschema = jsonschema_module()
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ValueError(f"invalid JSON schema: {error.message} at {'/'.join(map(str, error.path)) or 'the root'}") from None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)
