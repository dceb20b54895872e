"""What a command imports, each checked in a fresh interpreter (the start's seconds are measured by
benchmarks/startup.py, not here):

- the parser (`smc-sd --help`, `smc-sd generate --help`) imports no torch, transformers,
  genlm-control, vLLM, server or plotting package;
- a run whose constraints are a regex, a grammar or a JSON schema never imports genlm-control,
  nor jsonschema's iri parsers (`rfc3987_syntax`), on a toy model and on the README's first
  command;
- jsonschema imported with those parsers deferred registers the same format checks as a plain
  import, and an iri check loads the real parsers and refuses a bad iri.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from startup import readme_first_command  # noqa: E402  (benchmarks/ is on the path from here)

# packages a command loads only when it needs them
HEAVY = ["torch", "transformers", "genlm", "vllm", "fastapi", "uvicorn", "matplotlib", "networkx", "rfc3987_syntax"]
# prints the packages of HEAVY the code before it has loaded, as a JSON list
LOADED = f"\nimport json, sys\nprint(json.dumps(sorted({{m.partition('.')[0] for m in sys.modules}} & set({HEAVY!r}))))\n"


def loaded_after(code: str) -> list[str]:
    """The HEAVY packages loaded once `code` has run in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", code + LOADED], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"]])
def test_the_parser_imports_nothing_heavy(argv):
    code = f"from smc_sd.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as end:\n    assert end.code == 0\n"
    assert loaded_after(code) == []


def test_a_run_with_a_json_schema_on_a_toy_model_never_loads_genlm_control():
    code = """
import json
from smc_sd.program import FreeDraft, Schedule
from smc_sd.programs import constrained, get
from tests.toy_programs import WordLM

lm = WordLM(['{', '}', '"a"', ':', '1', '2', '12', '"b"'], seed=0)
schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
for method in ("smc-sd", "mask-at-verify"):
    program = get(method).program(lm, None, constraints=constrained.potentials(json_schema=schema), free_draft=FreeDraft())
    result = program.run([0], Schedule(get(method).DEFAULT_PARTICLES, max_tokens=12), seed=0)
    assert result.complete and isinstance(json.loads(lm.decode(result.tokens))["a"], int), lm.decode(result.tokens)
"""
    loaded = loaded_after(code)
    assert "genlm" not in loaded and "rfc3987_syntax" not in loaded


@pytest.mark.model
def test_the_readme_first_command_never_loads_genlm_control():
    argv = readme_first_command()[1:] + ["--json"]
    code = f"import json\nfrom smc_sd.cli import main\nassert main({argv!r}) == 0\n"
    loaded = loaded_after(code)
    assert set(loaded) == {"torch", "transformers"}


def test_deferred_iri_parsers_register_the_same_format_checks():
    checks = """
import json
import jsonschema
drafts = ["Draft4Validator", "Draft6Validator", "Draft7Validator", "Draft201909Validator", "Draft202012Validator"]
print(json.dumps({d: sorted(getattr(jsonschema, d).FORMAT_CHECKER.checkers) for d in drafts}))
"""
    plain = subprocess.run([sys.executable, "-c", checks], capture_output=True, text=True, cwd=ROOT, check=True)
    deferred = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom smc_sd.constraints.json_validation import jsonschema_module\njsonschema_module()\n"
         "assert 'rfc3987_syntax' not in sys.modules\n" + checks],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )
    registered = json.loads(deferred.stdout)
    assert registered == json.loads(plain.stdout)
    assert "iri" in registered["Draft202012Validator"] and "iri-reference" in registered["Draft202012Validator"]


def test_an_iri_check_loads_the_parsers_and_refuses_a_bad_iri():
    code = """
import sys
from smc_sd.constraints.json_validation import schema_validator
validator = schema_validator({"type": "string", "format": "iri"})
assert "rfc3987_syntax" not in sys.modules
assert validator.is_valid("https://example.org/caf\u00e9")
assert not validator.is_valid("no scheme and spaces")
assert hasattr(sys.modules["rfc3987_syntax"], "make_syntax_validator")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
