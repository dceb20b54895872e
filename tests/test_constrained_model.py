"""JSON-schema-constrained generation on the embedded default model: outputs validate."""

import json

import jsonschema
import pytest

from smc_sd import Schedule
from smc_sd.backends.hf import chat_prompt
from smc_sd.cli import main
from smc_sd.programs import constrained, mask_at_verify

pytestmark = pytest.mark.model

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
    # the kinds the hand-written translation refused: $ref, anyOf, a string pattern
    "ref": {
        "$defs": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "type": "object",
        "properties": {"code": {"$ref": "#/$defs/code"}, "size": {"anyOf": [{"type": "integer"}, {"enum": ["small", "large"]}]}},
        "required": ["code", "size"],
        "additionalProperties": False,
    },
}
PROMPT = "Answer with JSON only: a person, a color or a list of numbers."


# Which sample a seed draws follows the processor's float rounding. The object's integer and the
# array's numbers may run to many digit tokens, so a seed completes within 40 tokens with
# probability p below 1 (every schema completed at seed 0 here, with the distilled draft); a run is
# checked for the properties that hold whatever it draws, and SEEDS seeds are tried until one
# completes: all fail with probability (1 - p)^4, below 0.004 even if p were only 0.75.
SEEDS = 4


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_constrained_smc_sd_output_validates(default_lm, default_draft, name):
    schema = SCHEMAS[name]
    program = constrained.program(default_lm, default_draft, json_schema=schema, draft_len=3)
    prompt = chat_prompt(default_lm.tokenizer, PROMPT)
    for seed in range(SEEDS):
        result = program.run(prompt, Schedule(3, max_tokens=40), seed=seed)
        live = [tokens for tokens, logw in zip(result.particles, result.log_weights.tolist()) if logw > float("-inf")]
        # a complete answer is valid, and so is every particle of nonzero final weight; an
        # incomplete one is returned only when every particle's weight is zero
        assert result.complete == bool(live)
        for tokens in live:
            jsonschema.validate(json.loads(default_lm.decode(tokens)), schema)
        if result.complete:
            jsonschema.validate(json.loads(result.text), schema)
            break
    assert result.complete, f"no particle completed the schema within the token budget for seeds 0-{SEEDS - 1}"


def test_masks_never_allow_special_tokens_or_padding_rows(default_lm):
    from smc_sd.constraints.llguidance_masks import GrammarConstraint
    from smc_sd.constraints.grammars import JsonSchema

    tokenizer = default_lm.tokenizer
    special = [t for t in tokenizer.all_special_ids + list(tokenizer.added_tokens_decoder) if t != tokenizer.eos_token_id]
    constraint = GrammarConstraint(JsonSchema({"type": "string"}).grammar, default_lm)
    inside = tokenizer.encode('"a', add_special_tokens=False)
    masks = constraint.mask([[], inside, tokenizer.encode('"a"', add_special_tokens=False)])
    assert not masks[:, special].any() and not masks[:, len(tokenizer):].any()
    # inside a string most tokens are allowed, EOS only after the closing quote
    assert masks[1].sum() > 40000 and masks[:, tokenizer.eos_token_id].tolist() == [False, False, True]


def test_mask_at_verify_output_validates(default_lm, default_draft):
    schema = SCHEMAS["enum"]
    program = mask_at_verify.program(default_lm, default_draft, constraints=constrained.potentials(json_schema=schema), draft_len=3)
    result = program.run(chat_prompt(default_lm.tokenizer, PROMPT), Schedule(1, max_tokens=16), seed=0)
    jsonschema.validate(json.loads(result.text), schema)


def test_cli_json_schema_flag(tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMAS["enum"]))
    code = main(["generate", "--method", "smc-sd", "--draft", "self", "--particles", "2", "--draft-len", "2", "--max-new-tokens", "12", "--json-schema", str(path), "--json", PROMPT])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(summary["text"]), SCHEMAS["enum"])


def test_cli_warns_and_fails_when_no_answer_is_complete(capsys):
    code = main(["generate", "--method", "smc-sd", "--draft", "self", "--particles", "2", "--draft-len", "2", "--max-new-tokens", "3", "--regex", "a{40}", "--json", PROMPT])
    captured = capsys.readouterr()
    assert code == 1 and "no particle completed" in captured.err
    assert json.loads(captured.out)["complete"] is False


def test_the_default_method_under_a_constraint_is_mask_at_verify(capsys):
    code = main(["generate", "--regex", r"(Yes|No)\.", "--json", "Is Paris in France?"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["method"] == "mask-at-verify" and summary["temperature"] == 0.0
    assert summary["complete"] and summary["text"] in ("Yes.", "No.")
