"""Languages users write (a regex, a Lark grammar, a JSON schema), compiled to llguidance grammars
over bytes without any model, and checked at once.

A `Language` is what the compiler lowers to exact token masks of the target
(`smc_sd.constraints.llguidance_masks`); `smc_sd.constraints.grammars` wraps the same object as a
genlm-control potential (`Regex`, `Grammar`, `JsonSchema`) for programs that compose it with
genlm-control's. The command line and the server build `Language`s directly, so a run whose
constraints are all regexes, grammars and schemas never loads genlm-control.

Bad input (an invalid regex, grammar or schema, a schema feature that can be enforced neither by
llguidance nor by jsonschema) raises a one-line ValueError here, before any model loads. Where
llguidance only over-approximates a schema (`oneOf` read as `anyOf`, a keyword it does not
implement, a format it does not know), the masks admit a superset of the schema's texts and
`exact_check` (jsonschema validation with format checks) is the factor phi applied to complete
strings, so the target is still exactly the schema's conditional.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import llguidance

from smc_sd.constraints.json_depth import check_json_depth, load_json
from smc_sd.constraints.token_constraints import UnsatisfiableConstraintError
from smc_sd.constraints.json_validation import schema_validator

#: the compile options that let llguidance over-approximate what it cannot enforce exactly
LENIENT = {"lenient": True, "coerce_one_of": True}
#: JSON layouts: "compact" fixes the whitespace (none) and the separators, so the grammar forces
#: keys and punctuation (what a free draft proposes); "flexible" is llguidance's default, any
#: whitespace between tokens
JSON_LAYOUTS = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "flexible": {},
}
#: how llguidance's error for a schema no value satisfies begins
UNSATISFIABLE = "Unsatisfiable schema: "


@dataclass(frozen=True)
class Language:
    """A set of byte strings given by an llguidance grammar:

        x in the language  iff  llguidance accepts bytes(x) under `grammar`
                                and (exact_check is None or exact_check(bytes(x))).

    Attributes:
        grammar: the llguidance grammar (a string `LLMatcher` accepts).
        description: what the user wrote, for messages ("regex '[0-9]+'", "JSON schema").
        exact_check: None when llguidance enforces the language exactly, else a test of a
            complete byte string (True iff it lies in the language) applied as phi at completion.
        approximations: llguidance's words for what it over-approximates (empty when exact).
    """

    grammar: str
    description: str
    exact_check: Callable[[bytes], bool] | None = None
    approximations: tuple[str, ...] = ()


class _ByteVocabulary:
    """The 256 bytes and an EOS (id 256), the tokenizer byte-level matchers run on."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def byte_tokenizer() -> llguidance.LLTokenizer:
    """The llguidance tokenizer over single bytes (made once)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def check_grammar(grammar: str, what: str) -> list[str]:
    """Compile an llguidance grammar without a tokenizer.

    Returns:
        its warnings.

    Raises:
        ValueError: "invalid <what>: <llguidance's first error line>".
    """
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise ValueError(f"invalid {what}: {one_line(messages[0])}")
    return messages


def one_line(message: str) -> str:
    """An llguidance error as one line: its first line (without the "at L(C):" position and the
    repeated regex) and, for a regex parse error, the "error: ..." line that says what is wrong."""
    lines = [s.strip() for s in message.splitlines() if s.strip()] or [message]
    first = re.sub(r'^at \d+\(\d+\): (invalid regex ".*?" \(in regex\): )?', "", lines[0])
    detail = next((s[len("error: "):] for s in lines[1:] if s.startswith("error: ")), None)
    return f"{first} {detail}" if detail else first


def regex_language(pattern: str) -> Language:
    """The strings that fully match the regular expression `pattern` (llguidance's regex syntax,
    which is Rust's `regex`: no backreferences or lookaround)."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex must be a string, got {type(pattern).__name__}")
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    check_grammar(grammar, f"regex {pattern!r}")
    return Language(grammar, f"regex {pattern!r}")


def lark_language(lark: str) -> Language:
    """The strings a Lark grammar (llguidance's Lark dialect, start symbol `start`) derives."""
    if not isinstance(lark, str):
        raise ValueError(f"a Lark grammar must be a string, got {type(lark).__name__}")
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    check_grammar(grammar, "Lark grammar")
    return Language(grammar, "Lark grammar")


def json_schema_language(schema, layout: str = "compact") -> Language:
    """The JSON texts valid under a JSON schema, in a layout.

    Args:
        schema: a dict, its JSON text, or the path of a file holding it.
        layout: "compact" (the default): no whitespace anywhere, separators "," and ":"
            (`{"a":1,"b":[2,3]}`), so that keys and punctuation are forced; "flexible": any
            whitespace between tokens, as llguidance's default JSON grammar allows.

    The language is llguidance's JSON for the schema: properties in the schema's order, no
    whitespace before or after the value (b"[1]\\n" is refused), and between tokens what the
    layout allows.
    Features llguidance does not enforce exactly make it over-approximate; the complete string
    is then validated by jsonschema (module docstring).

    Raises:
        ValueError: "the JSON schema is not valid JSON: ...", "invalid JSON schema: ..." (it
            breaks its metaschema), "unsupported JSON schema feature: ..." (a valid schema
            llguidance cannot compile, such as circular references with sibling keys), or a
            format neither llguidance nor jsonschema can enforce (naming it).
        JSONTooDeepError: a schema nested past `MAX_JSON_DEPTH` levels (a ValueError too).
        UnsatisfiableConstraintError: "the JSON schema admits no value: ...".
    """
    if layout not in JSON_LAYOUTS:
        raise ValueError(f"unknown JSON layout {layout!r}; choose one of {sorted(JSON_LAYOUTS)}")
    schema = load_schema(schema)
    validator = schema_validator(schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUTS[layout])
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not failed:
        return Language(grammar, "JSON schema")
    strict_error = one_line(messages[0])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUTS[layout], overrides=LENIENT)
    failed, approximations = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        # the schema passed its metaschema: what llguidance refuses now is beyond it, or empty
        error = one_line(approximations[0])
        if error.startswith(UNSATISFIABLE):
            raise UnsatisfiableConstraintError(f"the JSON schema admits no value: {error[len(UNSATISFIABLE):]}")
        raise ValueError(f"unsupported JSON schema feature: {error}")
    # formats llguidance does not know are left to jsonschema, which must know them
    unknown = [f for m in messages + approximations for f in re.findall(r"Unknown format: (\S+)", m)]
    unknown = [f for f in unknown if f not in validator.format_checker.checkers]
    if unknown:
        raise ValueError(f"JSON schema format {unknown[0]!r} can be enforced neither by llguidance nor by jsonschema")

    def valid(text: bytes) -> bool:
        try:
            instance = json.loads(text)
        except ValueError:
            return False
        return validator.is_valid(instance)

    return Language(grammar, "JSON schema", valid, tuple(one_line(m) for m in approximations) or (strict_error,))


def load_schema(schema) -> dict | bool:
    """A schema given as a dict, JSON text or file path, as a Python object, at most
    `MAX_JSON_DEPTH` levels deep (`JSONTooDeepError` otherwise)."""
    if isinstance(schema, (dict, bool)):
        check_json_depth(schema, "the JSON schema")
        return schema
    if isinstance(schema, pathlib.Path) or (isinstance(schema, str) and not schema.lstrip().startswith(("{", "[")) and pathlib.Path(schema).is_file()):
        schema = pathlib.Path(schema).read_text()
    if not isinstance(schema, str):
        raise ValueError(f"a JSON schema must be a dict, JSON text or a file path, got {type(schema).__name__}")
    try:
        return load_json(schema, "the JSON schema")
    except json.JSONDecodeError as error:
        raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
