"""`--dtype`: which dtype `auto` picks from the processor's flags (faked /proc/cpuinfo files), and
bfloat16 models on tiny random Llamas: float32 finite logits, KV in bfloat16, the backend laws
within a bfloat16 tolerance, the distilled and feature drafts in the chosen dtype."""

import pytest
import torch

from smc_sd import testing
from smc_sd.backends.feature_draft import FeatureDraftLM
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.backends.precision import as_dtype, choose_precision, read_processor
from smc_sd.backends.restricted_vocab import MASKED_LOGIT
from smc_sd.drafts import load_distilled_draft
from smc_sd.models.draft import build_student, load_draft_model, save_draft
from smc_sd.models.feature_draft import FeatureDraft, load_feature_draft
from tests.test_feature_draft import Paired
from tests.tiny_llama import PROMPT, continuation, lm, tiny_llama  # noqa: F401 (fixtures)

# One core's block of /proc/cpuinfo, trimmed; every real file repeats it once per core.
ZEN3 = """processor\t: {core}
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand lahf_lm abm sse4a fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero vaes vpclmulqdq rdpid fsrm
bogomips\t: 4890.85
"""
SAPPHIRE_RAPIDS = """processor\t: {core}
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov sse sse2 ht syscall nx lm pni ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8
bogomips\t: 4000.00
"""
# avx512_bf16 without AMX (Cooper Lake; AMD Zen 4 alike)
COOPER_LAKE = SAPPHIRE_RAPIDS.replace("Platinum 8480+", "Gold 6348H").replace(" amx_bf16", "").replace(" amx_tile amx_int8", "")
# AMX tiles for int8 and fp16 arithmetic but neither bf16 flag: names that merely contain "amx" or "fp16" must not count
NO_BF16_AMX = SAPPHIRE_RAPIDS.replace(" avx512_bf16", "").replace(" amx_bf16", "")

# bfloat16 keeps 8 significant bits (eps = 2^-7): a logit z comes back rounded to within
# eps/2 |z|, so rows that agree up to reordered sums may differ by a few such steps at the
# largest |z| (about 8 for these tiny models)
BF16_ATOL = 4 * torch.finfo(torch.bfloat16).eps * 10


def cpuinfo(tmp_path, block: str, cores: int = 2):
    path = tmp_path / "cpuinfo"
    path.write_text("\n".join(block.format(core=core) for core in range(cores)))
    return path


@pytest.mark.parametrize("block", [ZEN3, NO_BF16_AMX], ids=["epyc-zen3", "amx-without-bf16"])
def test_auto_never_picks_bfloat16_without_native_bf16(tmp_path, block):
    precision = choose_precision("auto", "cpu", cpuinfo(tmp_path, block))
    assert precision.dtype == torch.float32 and precision.name == "float32"
    assert "no native bf16" in precision.reason


@pytest.mark.parametrize("block, flags", [(SAPPHIRE_RAPIDS, "amx_bf16, avx512_bf16"), (COOPER_LAKE, "avx512_bf16")],
                         ids=["sapphire-rapids", "cooper-lake"])
def test_auto_picks_bfloat16_with_native_bf16_and_names_the_flags(tmp_path, block, flags):
    precision = choose_precision("auto", "cpu", cpuinfo(tmp_path, block))
    assert precision.dtype == torch.bfloat16 and precision.name == "bfloat16"
    assert precision.reason.endswith(f"({flags})")


def test_the_processor_is_read_from_the_first_cores_block(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(ZEN3.format(core=0) + "\n" + SAPPHIRE_RAPIDS.format(core=1))
    processor = read_processor(path)
    assert processor.model == "AMD EPYC 7763 64-Core Processor" and processor.native_bf16_flags == ()
    assert read_processor(cpuinfo(tmp_path, SAPPHIRE_RAPIDS)).to_json() == {
        "model": "Intel(R) Xeon(R) Platinum 8480+", "amx_bf16": True, "avx512_bf16": True}


def test_an_unreadable_cpuinfo_gives_float32(tmp_path):
    assert read_processor(tmp_path / "missing") is None
    precision = choose_precision("auto", "cpu", tmp_path / "missing")
    assert precision.dtype == torch.float32 and "cannot read" in precision.reason


def test_a_named_dtype_is_taken_whatever_the_processor(tmp_path):
    assert choose_precision("bfloat16", "cpu", cpuinfo(tmp_path, ZEN3)).dtype == torch.bfloat16
    assert choose_precision("float32", "cpu", cpuinfo(tmp_path, SAPPHIRE_RAPIDS)).dtype == torch.float32
    assert as_dtype(torch.bfloat16) == torch.bfloat16 and as_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float16'; use one of auto, float32, bfloat16"):
        choose_precision("float16")


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_cuda_follows_the_devices_bf16_support(monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    precision = choose_precision("auto", "cuda")
    assert precision.dtype == (torch.bfloat16 if supported else torch.float32) and "Some GPU" in precision.reason


def kv_dtypes(rows) -> set:
    """The dtypes of the tensors holding the rows' KV, whichever cache they use."""
    if hasattr(rows, "_kv") and hasattr(rows._kv, "store"):
        return {t.dtype for t in (*rows._kv.store.keys, *rows._kv.store.values)}
    if hasattr(rows, "_kv"):
        return {t.dtype for t in (*rows._kv.keys, *rows._kv.values)}
    return {t.dtype for layer in rows._cache.layers for t in (layer.keys, layer.values)}


@pytest.mark.parametrize("kv_cache", ["paged", "copy", "static"])
def test_bfloat16_rows_keep_kv_in_bfloat16_and_return_float32_logits(kv_cache, continuation):
    rows, first = lm(tiny_llama().to(torch.bfloat16), kv_cache=kv_cache).open(PROMPT, 2)
    logits = rows.extend(continuation)
    assert first.dtype == logits.dtype == torch.float32
    testing.assert_logits_valid(logits)
    assert kv_dtypes(rows) == {torch.bfloat16}
    rows.close()


@pytest.mark.parametrize("kv_cache", ["paged", "copy", "static"])
def test_bfloat16_models_keep_the_backend_laws(kv_cache, continuation):
    model = lm(tiny_llama().to(torch.bfloat16), kv_cache=kv_cache)
    testing.assert_extend_matches_full_forward(model, PROMPT, continuation, BF16_ATOL)
    testing.assert_select_consistent(model, PROMPT, continuation, torch.tensor([1, 1, 0]), BF16_ATOL)
    testing.assert_truncate_consistent(model, PROMPT, continuation, 3, BF16_ATOL)


def test_bfloat16_logits_are_the_float32_models_up_to_rounding(continuation):
    rows32, _ = lm(tiny_llama()).open(PROMPT, 2)
    rows16, _ = lm(tiny_llama().to(torch.bfloat16)).open(PROMPT, 2)
    exact, rounded = rows32.extend(continuation), rows16.extend(continuation)
    gap = (exact - rounded).abs().max()
    # the bfloat16 passes really ran (a float32 pass would agree to ~1e-6) and stay within a
    # few percent of the largest logit (errors compound over the layers)
    assert 1e-3 < gap < 0.1 * exact.abs().max()


def test_from_pretrained_loads_the_dtype_asked_for(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    assert HFLanguageModel.from_pretrained(tmp_path, dtype="bfloat16").model.dtype == torch.bfloat16
    assert HFLanguageModel.from_pretrained(tmp_path, dtype=torch.float32).model.dtype == torch.float32
    assert HFLanguageModel.from_pretrained(tmp_path, dtype="auto").model.dtype == choose_precision("auto").dtype


def tiny_tokenizer():
    """A word-level tokenizer over 64 ids t0 .. t63 (t0 is EOS), savable with a model directory."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(64)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="t1")), eos_token="t0", unk_token="t1")


@pytest.fixture(scope="module")
def saved_draft(tmp_path_factory):
    """(target_dir, draft_dir): a tiny target saved with its tokenizer and a 1-layer distilled
    draft over 20 of its tokens, saved in int8 with fp16 scales."""
    root = tmp_path_factory.mktemp("draft")
    target = tiny_llama()
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    vocab_ids = torch.arange(0, 40, 2)
    torch.manual_seed(3)
    student = build_student(target.config, 1, vocab_ids)
    for parameter in student.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    save_draft(student, vocab_ids, root / "draft")
    return root / "target", root / "draft"


def test_the_distilled_draft_dequantises_into_the_chosen_dtype(saved_draft):
    exact, _ = load_draft_model(*saved_draft)
    rounded, _ = load_draft_model(*saved_draft, dtype=torch.bfloat16)
    weights = rounded.state_dict()
    for name, value in exact.state_dict().items():
        # W' = s Q in float32, rounded once to bfloat16
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], value.to(torch.bfloat16)), name


def test_a_bfloat16_distilled_draft_has_float32_logits_and_q_zero_off_its_vocabulary(saved_draft, continuation):
    draft = load_distilled_draft(*saved_draft, dtype="bfloat16")
    rows, first = draft.open(PROMPT, 2)
    logits = rows.extend(continuation)
    assert first.dtype == logits.dtype == torch.float32
    off = torch.ones(64, dtype=torch.bool)
    off[draft.vocab_ids] = False
    assert torch.isfinite(logits).all() and (logits[..., off] == MASKED_LOGIT).all()
    assert (torch.softmax(logits, -1)[..., off] == 0).all()
    testing.assert_extend_matches_full_forward(draft, PROMPT, continuation, BF16_ATOL)


def bf16_feature_draft(tmp_path) -> FeatureDraftLM:
    """A feature draft with random own weights, saved and loaded over a bfloat16 tiny target."""
    target = tiny_llama().to(torch.bfloat16)
    torch.manual_seed(7)
    draft = FeatureDraft.from_target(target, (1,))
    torch.nn.init.normal_(draft.fc.weight, std=0.3)
    draft.save(tmp_path)
    return FeatureDraftLM(lm(target), load_feature_draft(target, tmp_path).requires_grad_(False))


def test_a_feature_draft_takes_its_targets_dtype_and_keeps_the_laws(tmp_path, continuation):
    draft = bf16_feature_draft(tmp_path)
    assert {p.dtype for p in draft.model.parameters()} == {torch.bfloat16}
    paired = Paired(draft)
    rows, first = paired.open(PROMPT, 2)
    assert first.dtype == rows.extend(continuation).dtype == torch.float32
    testing.assert_extend_matches_full_forward(paired, PROMPT, continuation, BF16_ATOL)
    testing.assert_select_consistent(paired, PROMPT, continuation, torch.tensor([1, 0]), BF16_ATOL)
    testing.assert_truncate_consistent(paired, PROMPT, continuation, 3, BF16_ATOL)
