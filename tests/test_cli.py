"""The CLI's bad input: one line `smc-sd: error: ...` on stderr, exit status 2, never a traceback,
and no model loaded for everything that can be judged before loading."""

import importlib.util
import json

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import smc_sd.cli as cli
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.backends.precision import choose_precision

PROMPT = "a b"
WORDS = ["<eos>", "<unk>", "a", "b", "c", "d"]


def tiny_model_dir(path, words, max_positions=64):
    """A random 1-layer Llama over a whitespace word-level tokenizer of `words` (ids in that order)."""
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         eos_token_id=0, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths the cases name: tiny models, a directory without a model, constraint files good and bad."""
    root = tmp_path_factory.mktemp("cli")
    (root / "empty").mkdir()
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text("{}")
    (root / "not-json.json").write_text("{'type': 'object'")
    (root / "bad-schema.json").write_text(json.dumps({"type": "bogus"}))
    (root / "binary.lark").write_bytes(b"\xff\xfe\x00start")
    (root / "bad.lark").write_text("start: ((\n")
    (root / "plain.txt").write_text("not a directory")
    return {
        "tiny": tiny_model_dir(root / "tiny", WORDS),
        # the same words in another order: another token-to-id map, the same vocabulary size
        "other": tiny_model_dir(root / "other", WORDS[:2] + WORDS[:1:-1]),
        "short": tiny_model_dir(root / "short", WORDS, max_positions=8),
        **{name.split(".")[0].replace("-", "_"): str(root / name) for name in (
            "empty", "config-only", "not-json.json", "bad-schema.json", "binary.lark", "bad.lark", "plain.txt")},
        "missing": str(root / "missing"),
    }


def run_cli(argv, capsys):
    """main(["generate", *argv]) in-process: (exit status, stdout, stderr lines)."""
    try:
        code = cli.main(["generate", *argv])
    except SystemExit as exit:
        # argparse exits by itself
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def assert_refused(flags, phrase, files, capsys):
    """The CLI on `flags` ({name}: a path of `files`) exits 2 with one error line holding `phrase`."""
    code, out, err = run_cli([flag.format(**files) for flag in flags], capsys)
    assert code == 2 and out == ""
    assert len(err) == 1 and err[0].startswith("smc-sd: error: "), err
    assert phrase.format(**files) in err[0], err[0]


# (flags, a phrase the error must contain); {name} is a path from the `files` fixture
BEFORE_LOADING = [
    (["--target", "{missing}"], "--target {missing}: no such directory"),
    (["--target", "{plain}"], "not a directory"),
    (["--target", "{empty}", "--draft", "{empty}"], "--target {empty}: the directory holds no model"),
    (["--target", "{tiny}", "--draft", "{missing}"], "--draft {missing}: no such directory"),
    (["--target", "{tiny}", "--draft", "self"], "--draft self is a draft of the default model"),
    (["--target", "{tiny}", "--draft", "feature"], "--draft feature is a draft of the default model"),
    (["--method", "ar", "--draft", "self"], "--method ar drafts nothing"),
    (["--method", "ar", "--draft-len", "3"], "drop --draft-len"),
    (["--method", "ar", "--draft-temperature", "0.5"], "drop --draft-temperature"),
    (["--regex", "("], "--regex '('"),
    (["--json-schema", "{missing}"], "--json-schema {missing}: cannot read it"),
    (["--json-schema", "{empty}"], "--json-schema {empty}: cannot read it"),
    (["--json-schema", "{not_json}"], "not valid JSON"),
    # the schema itself (braces doubled for str.format)
    (["--json-schema", '{{"type": '], "not valid JSON"),
    (["--json-schema", "{bad_schema}"], "--json-schema {bad_schema}:"),
    (["--grammar", "{missing}"], "--grammar {missing}: cannot read it"),
    (["--grammar", "{binary}"], "--grammar {binary}: 'utf-8' codec"),
    (["--grammar", "{bad}"], "--grammar {bad}:"),
    (["--method", "ar", "--draft", "free"], "--method ar drafts nothing"),
    (["--draft", "free+"], "--draft free+NAME needs a draft after the '+'"),
    (["--method", "sd", "--draft", "free+{missing}"], "--draft {missing}: no such directory"),
    (["--method", "sd", "--regex", "a"], "--method sd takes no constraints"),
    (["--method", "smc-sd", "--particles", "0"], "particles must be >= 1"),
    (["--particles", "two"], "argument --particles: invalid int value"),
    (["--method", "sd", "--particles", "4"], "set particles to 1"),
    (["--method", "smc-sd", "--draft", "self", "--draft-len", "0"], "draft length K must be >= 1"),
    (["--draft-len", "0"], "a free draft's block length must be >= 1"),
    (["--max-new-tokens", "0"], "max tokens must be >= 1"),
    (["--method", "smc-sd", "--ess-threshold", "2"], "ESS threshold must lie in [0, 1]"),
    (["--method", "smc-sd", "--resampling", "bogus"], "unknown resampling scheme 'bogus'"),
    (["--method", "smc-sd", "--alpha", "0"], "alpha must be > 0"),
    (["--method", "ar", "--alpha", "2"], "--method ar samples p_T (alpha = 1)"),
    (["--method", "sd", "--alpha", "2"], "--method sd samples p_T (alpha = 1)"),
    (["--temperature", "-1"], "target temperature must be >= 0"),
    (["--method", "smc-sd", "--temperature", "0"], "smc-sd needs a target temperature > 0"),
    (["--method", "smc-sd", "--draft", "self", "--draft-temperature", "-0.5"], "draft temperature must be >= 0"),
    (["--temperature", "inf"], "target temperature must be >= 0 and finite, got inf"),
    (["--method", "smc-sd", "--draft", "self", "--draft-temperature", "nan"], "draft temperature must be >= 0 and finite, got nan"),
    (["--method", "smc-sd", "--alpha", "inf"], "alpha must be > 0 and finite, got inf"),
    (["--method", "bogus"], "argument --method: invalid choice: 'bogus'"),
    (["--device", "bogus"], "unknown --device 'bogus'"),
    (["--device", "mps"], "unknown --device 'mps'"),
    (["--device", "cuda:99"], "--device cuda:99: this machine has"),
    (["--seed", "-1"], "--seed must lie in 0 .. 2^64 - 1"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size is an option of --backend vllm"),
    (["--dtype", "float16"], "--dtype float16 runs on --backend vllm only; the hf backend takes auto, float32, bfloat16"),
    (["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["--backend", "vllm", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--backend", "vllm", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must lie in (0, 1]"),
    (["--backend", "vllm", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["--backend", "vllm", "--draft", "distilled"], "runs on --backend hf only"),
    (["--backend", "vllm", "--draft", "feature"], "runs on --backend hf only"),
    (["--backend", "fast"], "argument --backend: invalid choice"),
    (["--threads", "2"], "--threads is an option of --backend llama-cpp"),
    (["--threads", "two"], "argument --threads: invalid int value"),
]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything tries to load a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("smc_sd.loading.load_models", refuse)
    monkeypatch.setattr(HFLanguageModel, "from_pretrained", refuse)


@pytest.mark.parametrize("flags, phrase", BEFORE_LOADING, ids=lambda case: " ".join(case) if isinstance(case, list) else None)
def test_bad_flag_is_one_line_before_any_model_loads(flags, phrase, files, no_model_loads, capsys):
    assert_refused(flags + [PROMPT], phrase, files, capsys)


def test_a_schema_nested_past_the_limit_is_one_line(files, no_model_loads, capsys, tmp_path):
    from smc_sd.constraints.json_depth import MAX_JSON_DEPTH
    from tests.test_json_depth import nested_objects_text

    deep = nested_objects_text(500)
    (tmp_path / "deep.json").write_text(deep)
    for schema in (deep, str(tmp_path / "deep.json")):
        code, out, err = run_cli(["--json-schema", schema, PROMPT], capsys)
        assert code == 2 and out == "" and len(err) == 1, err
        assert err[0].startswith(f"smc-sd: error: --json-schema: the JSON schema nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"), err[0]


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt_is_one_line(prompt, files, no_model_loads, capsys):
    assert_refused(["--method", "ar", prompt], "the prompt is empty", files, capsys)


def test_missing_vllm_is_one_line(files, monkeypatch, no_model_loads, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "vllm" else find_spec(name, *rest))
    assert_refused(["--backend", "vllm", PROMPT], "--backend vllm needs the vllm package", files, capsys)


# found only once the (tiny) models are loaded
AFTER_LOADING = [
    (["--target", "{tiny}", "--draft", "{other}"], "draft and target tokenizers differ"),
    (["--method", "ar", "--target", "{short}", "--max-new-tokens", "20"], "the model's context window is 8"),
    (["--method", "ar", "--target", "{config_only}"], "--target {config_only}: cannot load a model"),
]


@pytest.mark.parametrize("flags, phrase", AFTER_LOADING, ids=lambda case: " ".join(case) if isinstance(case, list) else None)
def test_bad_model_is_one_line_after_loading(flags, phrase, files, capsys):
    assert_refused(flags + ["--raw", PROMPT], phrase, files, capsys)


@pytest.mark.parametrize("method", ["ar", "sd", "smc-sd"])
def test_good_flags_pass_every_check(method, files, capsys):
    # the checks refuse nothing valid: each method runs on tiny models and returns 0
    draft = [] if method == "ar" else ["--draft", files["tiny"], "--draft-len", "2"]
    particles = ["--particles", "3", "--alpha", "2"] if method == "smc-sd" else []
    code, out, _ = run_cli(["--method", method, "--target", files["tiny"], *draft, *particles,
                            "--max-new-tokens", "5", "--raw", "--json", PROMPT], capsys)
    assert code == 0
    summary = json.loads(out)
    assert summary["method"] == method and 1 <= summary["new_tokens"] <= 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_dtype_loads_both_models_in_it_and_the_json_names_it(dtype, files, monkeypatch, capsys):
    loaded = []
    from_pretrained = HFLanguageModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        model = from_pretrained(cls, *args, **kwargs)
        loaded.append(model.model.dtype)
        return model

    monkeypatch.setattr(HFLanguageModel, "from_pretrained", classmethod(spy))
    code, out, err = run_cli(["--method", "sd", "--target", files["tiny"], "--draft", files["tiny"], "--dtype", dtype,
                              "--max-new-tokens", "5", "--raw", "--json", PROMPT], capsys)
    assert code == 0, err
    summary = json.loads(out)
    expected = choose_precision(dtype)
    assert loaded == [expected.dtype] * 2
    assert summary["dtype"] == expected.name and summary["dtype_reason"] == expected.reason
    # the target that ran: its directory and the dtype its weights ran in
    assert summary["target_file"] == str(files["tiny"]) and summary["weight_format"] == expected.name


def test_every_particle_dying_is_one_line_with_status_1(files, monkeypatch, capsys):
    from smc_sd.engine.result import AllParticlesDiedError

    def die(self, *args, **kwargs):
        raise AllParticlesDiedError("every particle has weight zero", partial=None)

    monkeypatch.setattr("smc_sd.program.spec.Program.run", die)
    code, out, err = run_cli(["--method", "ar", "--target", files["tiny"], "--raw", PROMPT], capsys)
    assert code == 1 and out == "" and err == ["smc-sd: error: every particle has weight zero"]


def test_interrupt_is_one_line_with_status_130(files, monkeypatch, capsys):
    def interrupt(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("smc_sd.program.spec.Program.run", interrupt)
    code, out, err = run_cli(["--method", "ar", "--target", files["tiny"], "--raw", PROMPT], capsys)
    assert code == 130 and out == "" and err == ["", "smc-sd: interrupted"]


@pytest.mark.parametrize("draft", ["free", "free+{tiny}"])
def test_free_drafts_run_from_the_command_line(draft, files, capsys):
    code, out, _ = run_cli(["--method", "sd", "--target", files["tiny"], "--draft", draft.format(**files),
                            "--max-new-tokens", "6", "--raw", "--json", PROMPT + " " + PROMPT], capsys)
    assert code == 0
    summary = json.loads(out)
    assert summary["method"] == "sd" and 1 <= summary["new_tokens"] <= 6
    # a free draft alone runs no draft model
    assert (summary["draft_passes"] == 0) == (draft == "free")
