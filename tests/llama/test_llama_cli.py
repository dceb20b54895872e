"""`smc-sd generate --backend llama-cpp` in a fresh interpreter: the shipped GGUF, a requantized
GGUF as the draft, and one-line refusals of choices this backend cannot run.

Run with the llama extra installed: `python -m pytest tests/llama -m llama` (docs/backends.md).
"""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from smc_sd.backends.llama_cpp import default_threads
from smc_sd.backends.llama_formats import DEFAULT_FORMAT, format_path

pytestmark = [pytest.mark.llama, pytest.mark.model]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "born": {"type": "integer"}},
    "required": ["name", "born"],
    "additionalProperties": False,
}


def run_cli(*flags: str) -> subprocess.CompletedProcess:
    """`smc-sd generate --backend llama-cpp --seed 0 ...` in a subprocess."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "smc_sd.cli", "generate", "--backend", "llama-cpp", "--seed", "0", *flags],
        capture_output=True, text=True, env=env, timeout=600,
    )


def summary(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_smc_sd_with_the_free_draft_fills_a_schema():
    done = run_cli("--method", "smc-sd", "--draft", "free", "--temperature", "0.3", "--max-new-tokens", "48", "--json-schema", json.dumps(SCHEMA), "--json",
                   "Text: Ada Lovelace was born in 1815. Answer in JSON with the keys name and born.")
    out = summary(done)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["complete"] and out["particles"] == 4
    # the particles shared the prompt's cells: fewer cells than four full copies
    assert out["kv_peak_bytes"] < out["kv_naive_bytes"]
    # without --threads: one thread per physical core (at most 8), as llama.cpp reports them;
    # without --target: the default model in the default format
    assert out["threads"] == default_threads()
    assert out["target_file"] == str(format_path(DEFAULT_FORMAT)) and out["weight_format"] == DEFAULT_FORMAT


def test_sd_with_a_requantized_gguf_draft(q8_gguf):
    out = summary(run_cli("--method", "sd", "--draft", str(q8_gguf), "--temperature", "1", "--max-new-tokens", "24", "--json", "Name three colours."))
    assert out["new_tokens"] >= 1 and out["draft_passes"] > 0
    assert out["acceptance"] is not None and out["acceptance"] > 0.5


def test_another_gguf_as_the_target(q8_gguf):
    out = summary(run_cli("--target", str(q8_gguf), "--threads", "2", "--method", "mask-at-verify", "--draft", "free", "--regex", "(yes|no)", "--json", "Is Paris in France?"))
    assert out["text"] in ("yes", "no") and out["complete"]
    # the file that ran, its format, and the threads llama.cpp reports for its passes
    assert out["target_file"] == str(q8_gguf) and out["weight_format"] == "q8_0" and out["threads"] == 2


def test_streamed_text_and_progress_line():
    done = run_cli("--method", "ar", "--max-new-tokens", "12", "--regex", "(yes|no)", "Is Paris in France?")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(r"(yes|no)\n", done.stdout), done.stdout
    assert "tok/s" in done.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--method", "sd", "--draft", "self"], "--draft self runs on --backend hf only"),
        (["--method", "sd", "--draft", "free+distilled"], "--draft distilled runs on --backend hf only"),
        (["--method", "ar", "--target", "README.md"], "not a GGUF file"),
        (["--method", "ar", "--target", "missing.gguf"], "no such file"),
        (["--method", "ar", "--dtype", "bfloat16"], "runs the GGUF's own weight format"),
        (["--method", "ar", "--threads", "0"], "--threads must be >= 1, got 0"),
    ],
)
def test_choices_this_backend_cannot_run_are_one_line_errors(flags, message):
    done = run_cli(*flags, "Hi")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smc-sd: error:") and message in lines[0], done.stderr
