"""Constraints users write: `Regex`, `Grammar` (Lark) and `JsonSchema`, each a boolean potential
over bytes that carries an llguidance grammar.

Each is a genlm-control `Potential` whose vocabulary is the 256 byte values, so it composes with
genlm-control's `*` and runs inside genlm-control's samplers; the compiler lowers it to exact
llguidance token masks of the target (`smc_sd.program.llguidance_masks`). On bytes x:

    prefix(x)   = 0 if some completion of x lies in the language, else -inf
    complete(x) = 0 if x lies in the language (and passes the exact check, below), else -inf

Bad input (an invalid regex, grammar or schema, a schema feature that can be enforced neither by
llguidance nor by jsonschema) raises a one-line ValueError at construction, before any model
loads. Where llguidance only over-approximates a schema (`oneOf` read as `anyOf`, a keyword it does
not implement, a format it does not know), the masks admit a superset of the schema's texts and
`exact_check` (jsonschema validation with format checks) is the factor phi applied to complete
strings, so the target is still exactly the schema's conditional.
"""

from __future__ import annotations

import json
import pathlib
import re
from functools import lru_cache
from typing import Callable

import llguidance
import numpy as np

from genlm.control.potential import Potential

from smc_sd.program.constraints import UnsatisfiableConstraintError

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


class _ByteVocabulary:
    """The 256 bytes and an EOS (id 256), the tokenizer genlm-control byte potentials run on."""

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


class GrammarPotential(Potential):
    """A boolean potential over bytes given by an llguidance grammar (module docstring).

    Attributes:
        grammar: the llguidance grammar (a string `LLMatcher` accepts).
        description: what the user wrote, for messages ("regex '[0-9]+'").
        exact_check: None when llguidance enforces the language exactly, else a test of a
            complete byte string (True iff it lies in the language) applied as phi at completion.
        approximations: llguidance's words for what it over-approximates (empty when exact).
    """

    def __init__(self, grammar: str, description: str, exact_check: Callable[[bytes], bool] | None = None, approximations=()):
        self.grammar, self.description = grammar, description
        self.exact_check, self.approximations = exact_check, tuple(approximations)
        self._root = llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0)
        if self._root.is_error():
            raise ValueError(f"invalid {description}: {one_line(self._root.get_error())}")
        super().__init__(vocabulary=list(range(256)))

    def _matcher(self, context) -> llguidance.LLMatcher:
        matcher = self._root.deep_copy()
        matcher.consume_tokens(list(bytes(context)))
        return matcher

    async def prefix(self, context) -> float:
        return 0.0 if not self._matcher(context).is_error() else float("-inf")

    async def complete(self, context) -> float:
        matcher = self._matcher(context)
        ok = not matcher.is_error() and matcher.is_accepting()
        if ok and self.exact_check is not None:
            ok = self.exact_check(bytes(context))
        return 0.0 if ok else float("-inf")

    async def logw_next(self, context):
        """log phi(next byte | context) over the 256 bytes and EOS, from one llguidance mask.

        EOS gets the exact check where there is one; a byte's weight is that of the prefix."""
        matcher = self._matcher(context)
        # [257] bool: the bytes, then EOS
        allowed = np.zeros(257, dtype=bool)
        if not matcher.is_error():
            words = np.frombuffer(matcher.compute_bitmask(), dtype="<u4")
            allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:257].astype(bool)
            if allowed[256] and self.exact_check is not None:
                allowed[256] = self.exact_check(bytes(context))
        return self.make_lazy_weights(np.where(allowed, 0.0, -np.inf))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"


def Regex(pattern: str) -> GrammarPotential:
    """The strings that fully match the regular expression `pattern` (llguidance's regex syntax,
    which is Rust's `regex`: no backreferences or lookaround)."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex must be a string, got {type(pattern).__name__}")
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    check_grammar(grammar, f"regex {pattern!r}")
    return GrammarPotential(grammar, f"regex {pattern!r}")


def Grammar(lark: str) -> GrammarPotential:
    """The strings a Lark grammar (llguidance's Lark dialect, start symbol `start`) derives."""
    if not isinstance(lark, str):
        raise ValueError(f"a Lark grammar must be a string, got {type(lark).__name__}")
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    check_grammar(grammar, "Lark grammar")
    return GrammarPotential(grammar, "Lark grammar")


def JsonSchema(schema, layout: str = "compact") -> GrammarPotential:
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
        UnsatisfiableConstraintError: "the JSON schema admits no value: ...".
    """
    if layout not in JSON_LAYOUTS:
        raise ValueError(f"unknown JSON layout {layout!r}; choose one of {sorted(JSON_LAYOUTS)}")
    schema = load_schema(schema)
    validator = schema_validator(schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUTS[layout])
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not failed:
        return GrammarPotential(grammar, "JSON schema")
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

    return GrammarPotential(grammar, "JSON schema", valid, [one_line(m) for m in approximations] or [strict_error])


def load_schema(schema) -> dict | bool:
    """A schema given as a dict, JSON text or file path, as a Python object."""
    if isinstance(schema, (dict, bool)):
        return schema
    if isinstance(schema, pathlib.Path) or (isinstance(schema, str) and not schema.lstrip().startswith(("{", "[")) and pathlib.Path(schema).is_file()):
        schema = pathlib.Path(schema).read_text()
    if not isinstance(schema, str):
        raise ValueError(f"a JSON schema must be a dict, JSON text or a file path, got {type(schema).__name__}")
    try:
        return json.loads(schema)
    except json.JSONDecodeError as error:
        raise ValueError(f"the JSON schema is not valid JSON: {error}") from None


def schema_validator(schema):
    """A jsonschema validator for the schema's draft, checking formats.

    Raises:
        ValueError: "invalid JSON schema: ..." when the schema breaks its metaschema.
    """
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ValueError(f"invalid JSON schema: {error.message} at {'/'.join(map(str, error.path)) or 'the root'}") from None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)
