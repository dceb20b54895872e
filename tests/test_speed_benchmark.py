"""benchmarks/speed.py's model-free parts: the grounded prompt set, the free rows, the results
names and the refusals that come before any model loads."""

import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import speed  # noqa: E402  (the benchmark script, importable once its folder is on the path)


def test_grounded_set_has_eight_passages_of_60_to_150_words_to_summarise_rewrite_or_quote():
    items = json.loads(speed.GROUNDED.read_text())
    assert len(items) >= 8
    assert len({item["name"] for item in items}) == len(items)
    assert {item["task"] for item in items} == {"summarise", "rewrite", "quote"}
    for item in items:
        assert 60 <= len(item["passage"].split()) <= 150, item["name"]
    messages = speed.prompt_set("grounded")
    # every message is the instruction and then the passage itself, so a lookup can copy from it
    assert all(m.endswith(item["passage"]) and m.startswith(item["instruction"]) for m, item in zip(messages, items))
    assert speed.prompt_set("chat") == speed.PROMPTS


def test_free_rows_and_their_labels():
    labels = [c.label for c in speed.free_configs(with_lm=True)]
    assert labels[:4] == ["ar", "hf-generate", "sd free", "smc-sd N=4 free"]
    assert len(set(labels)) == len(labels) and "sd K=2 free+draft" in labels
    assert [c.label for c in speed.free_configs(with_lm=False)] == labels[:4]


def test_every_draft_prompt_set_dtype_and_temperature_writes_its_own_file():
    drafts = [None, "distilled", "feature", "/some/dir", "free", "free+self", "free+distilled", "free+/some/dir"]
    names = [
        speed.results_name(d, dtype, s, t)
        for d in drafts for dtype in ("float32", "bfloat16") for s in speed.PROMPT_SETS for t in (1.0, 0.3)
    ]
    assert len(set(names)) == len(names)
    # the earlier results keep their names
    assert speed.results_name(None) == speed.results_name("self") == "speed"
    assert speed.results_name("distilled", "bfloat16") == "speed_distilled_bfloat16"
    assert speed.results_name("free", "float32", "grounded") == "speed_free_grounded"
    assert speed.results_name("free", "bfloat16", "grounded", 0.3) == "speed_free_grounded_T0.3_bfloat16"


@pytest.mark.parametrize("argv", [["--draft", "free", "--grid"], ["--draft", "free+"], ["--prompts", "0"], ["--prompts-set", "news"], ["--temperature", "0"]])
def test_bad_arguments_fail_before_any_model_loads(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        speed.main(argv)
    assert stopped.value.code == 2
    assert "error:" in capsys.readouterr().err
