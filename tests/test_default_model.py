"""Every program on the embedded default model, and the CLI contract."""

import json
import math

import pytest

from smc_sd import Schedule
from smc_sd.backends.hf import chat_prompt
from smc_sd.cli import main
from smc_sd.programs import autoregressive, smc_speculative, speculative

pytestmark = pytest.mark.model

QUESTION = "What is the capital of France?"


@pytest.mark.parametrize("method", ["ar", "sd", "smc-sd"])
def test_every_method_generates_on_the_default_model(default_lm, default_draft, method):
    prompt = chat_prompt(default_lm.tokenizer, QUESTION)
    programs = {
        "ar": (autoregressive.program(default_lm), 1),
        "sd": (speculative.program(default_lm, default_draft, draft_len=3), 1),
        "smc-sd": (smc_speculative.program(default_lm, default_draft, draft_len=3), 3),
    }
    program, particles = programs[method]
    result = program.run(prompt, Schedule(particles, max_tokens=6), seed=0)
    assert 1 <= len(result.tokens) <= 6
    assert result.text.strip()
    assert math.isfinite(result.log_ml)
    if method == "smc-sd":
        # one pass for the prompt's first token, then K + 1 = 4 per pass
        assert result.target_passes <= math.ceil((6 - 1) / 4)


def test_cli_json_contract(capsys):
    code = main(
        ["generate", "--method", "smc-sd", "--draft", "self", "--particles", "2", "--draft-len", "2", "--max-new-tokens", "7",
         "--seed", "3", "--json", QUESTION]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ["method", "text", "new_tokens", "seconds", "tokens_per_second", "target_passes",
                "particles", "draft_len", "resamples", "ess", "log_z"]:
        assert key in out, key
    assert out["method"] == "smc-sd" and out["particles"] == 2 and out["draft_len"] == 2
    assert len(out["ess"]) == out["target_passes"] == math.ceil((out["positions"] - 1) / 3)
    assert out["new_tokens"] <= out["positions"] <= 7
    again = main(["generate", "--method", "smc-sd", "--draft", "self", "--particles", "2", "--draft-len", "2",
                  "--max-new-tokens", "7", "--seed", "3", "--json", QUESTION])
    assert again == 0 and json.loads(capsys.readouterr().out)["text"] == out["text"]


def test_cli_reports_bad_input_clearly(capsys):
    assert main(["generate", "--method", "smc-sd", "--particles", "0", "--json", QUESTION]) == 2
    assert "particles must be >= 1" in capsys.readouterr().err
    assert main(["generate", "--method", "smc-sd", "--max-new-tokens", "9000", "--json", QUESTION]) == 2
    assert "context window" in capsys.readouterr().err
    assert main(["generate", "--method", "ar", "--json", "  "]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--method", "sd", "--backend", "vllm", "--draft", "distilled", QUESTION]) == 2
    assert "runs on --backend hf only" in capsys.readouterr().err


def test_the_bare_command_names_paris(capsys):
    # the defaults (smc_sd.cli: sd with the free draft, greedy): what a first-time user types
    answers = []
    for seed in range(10):
        assert main(["generate", "--json", "--seed", str(seed), QUESTION]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["method"] == "sd" and out["temperature"] == 0.0 and out["draft_passes"] == 0
        answers.append(out["text"])
    assert sum("Paris" in answer for answer in answers) >= 8, answers
