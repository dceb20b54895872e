"""The static (fixed-shape, compilable) KV path of the hf backend, on tiny random Llamas built in
code: the backend laws, agreement with the copy cache, the compiled step against the eager one,
exact speculative decoding through it (enumerated 2-token completions), the engine's runs; and
the laws once more on the default model."""

import pathlib
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from smc_sd import Schedule, testing
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.programs import autoregressive, smc_speculative, speculative
from tests.tiny_llama import EOS, PROMPT, continuation, lm, model, tiny_llama, tokenizer  # noqa: F401 (fixtures)

# fp32 batching noise of these tiny models is ~1e-5
ATOL = 1e-4


def test_extend_matches_full_forward(model, continuation):
    testing.assert_extend_matches_full_forward(lm(model, kv_cache="static"), PROMPT, continuation, ATOL)


@pytest.mark.parametrize("ancestors", [[1, 1, 0], [0, 0], [1, 0]], ids=["fork", "shrink", "permute"])
def test_select_consistent(model, continuation, ancestors):
    testing.assert_select_consistent(lm(model, kv_cache="static"), PROMPT, continuation, torch.tensor(ancestors), ATOL)


@pytest.mark.parametrize("kept", [0, 3])
def test_truncate_consistent(model, continuation, kept):
    testing.assert_truncate_consistent(lm(model, kv_cache="static"), PROMPT, continuation, kept, ATOL)


def test_static_logits_equal_the_copy_cache_through_growth_select_and_truncate(model, continuation):
    # capacity 8 < the 12 positions used at most: the rows move to larger buffers on the way
    static, copy = lm(model, kv_cache="static", static_length=8), lm(model, kv_cache="copy")
    (a, first_a), (b, first_b) = static.open(PROMPT, 2), copy.open(PROMPT, 2)
    deviations = [(first_a - first_b).abs().max()]
    steps = [("extend", continuation[:, :2]), ("select", torch.tensor([1, 1])), ("extend", continuation[:, 2:5]),
             ("truncate", 8), ("extend", continuation[:, 3:]), ("select", torch.tensor([1, 0]))]
    for op, arg in steps + [("extend", continuation[:, :1])]:
        if op == "extend":
            deviations.append((a.extend(arg) - b.extend(arg)).abs().max())
        else:
            getattr(a, op)(arg)
            getattr(b, op)(arg)
        a.check_invariants()
        assert (a.batch_size, a.length) == (b.batch_size, b.length)
    assert a.capacity > 8
    assert max(deviations) <= ATOL
    memory = a.memory()
    # at most 2 rows x 12 positions were in use, each keys and values of 2 layers x 2 heads x 8
    # dimensions x 4 bytes; the buffers held more
    assert memory["naive_peak_bytes"] == 2 * 12 * (2 * 2 * 2 * 8 * 4)
    assert memory["peak_bytes"] >= memory["naive_peak_bytes"]
    a.close()
    b.close()
    assert a.memory()["live_bytes"] == 0
    with pytest.raises(ValueError, match="closed"):
        a.extend(continuation[:, :1])


def test_compiled_step_gives_the_eager_steps_logits(model, continuation):
    """One shape, [2, 3] at capacity 384, compiled once (7-11 s on this project's CPU, shared
    with other jobs) and replayed at three start positions, before and after a select and a
    truncate."""
    eager, compiled = lm(model, kv_cache="static"), lm(model, kv_cache="static", compile=True)
    rows = {name: backend.open(PROMPT, 2)[0] for name, backend in (("eager", eager), ("compiled", compiled))}
    graphs_before = counters["stats"]["unique_graphs"]
    for step, tokens in enumerate([continuation[:, :3], continuation[:, 3:], continuation[:, 1:4]]):
        logits = {name: r.extend(tokens) for name, r in rows.items()}
        deviation = (logits["eager"] - logits["compiled"]).abs().max().item()
        assert deviation <= ATOL, f"step {step}: compiled logits differ by {deviation:.3g}"
        for r in rows.values():
            r.select(torch.tensor([1, 0]))
            r.truncate(r.length - 1)
    # one graph for the one shape: positions and the KV are read on the device, not baked in
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_compile_needs_the_static_cache(model):
    with pytest.raises(ValueError, match="compile=True needs kv_cache='static'"):
        lm(model, compile=True).open(PROMPT, 1)
    with pytest.raises(ValueError, match="static_length 5 leaves no position"):
        lm(model, kv_cache="static", static_length=5).open(PROMPT, 1)

    class Rescaled(HFLanguageModel):
        def _forward(self, *args, **kwargs):
            return 2 * super()._forward(*args, **kwargs)

    class Masked(HFLanguageModel):
        def _logits(self, cache, **inputs):
            return super()._logits(cache, **inputs).clamp(max=0.0)

    # the static step would bypass the subclass's logits
    for changed in (Rescaled, Masked):
        with pytest.raises(ValueError, match=f"{changed.__name__} changes its logits"):
            changed(model, tokenizer(64), kv_cache="static").open(PROMPT, 1)


def exact_two_token_distribution(model) -> dict[tuple[int, ...], float]:
    """p_T over completions of at most 2 tokens, enumerated with the copy cache (another code
    path): p(x1) for x1 = EOS, else p(x1) p(x2 | x1)."""
    reference = lm(model, kv_cache="copy")
    vocab = model.config.vocab_size
    rows, first = reference.open(PROMPT, vocab)
    # [V, V]: row x1 is p(. | prompt, x1)
    second = torch.softmax(rows.extend(torch.arange(vocab)[:, None])[:, 0].double(), -1)
    rows.close()
    p1 = torch.softmax(first.double(), -1)
    exact = {(EOS,): float(p1[EOS])}
    for x1 in range(1, vocab):
        for x2 in range(vocab):
            exact[(x1, x2)] = float(p1[x1] * second[x1, x2])
    return exact


def sample(program, schedule: Schedule, runs: int) -> list[tuple[int, ...]]:
    return [tuple(program.run(PROMPT, schedule, seed=s).tokens) for s in range(runs)]


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_exact_speculative_decoding_through_the_static_cache_matches_p_t(compile):
    target, draft = tiny_llama(vocab=12, seed=2), tiny_llama(vocab=12, seed=3, layers=1)
    exact = exact_two_token_distribution(target)
    # the draft alone is far from the target, so matching p_T is no accident
    assert total_variation(exact_two_token_distribution(draft), exact) > 0.4
    # tolerance 0.115 at n = 2000 (64 completions carry the mass)
    n = 2000
    static = {"kv_cache": "static", "compile": compile}
    program = speculative.program(lm(target, **static), lm(draft, **static), draft_len=2)
    samples = sample(program, Schedule(1, max_tokens=2), n)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


@pytest.mark.parametrize("method", ["ar", "smc-sd"])
def test_engine_runs_unchanged_on_the_static_cache(model, method):
    """ar and smc-sd give the same tokens on the static and the copy cache (same seed).

    Logits differ by ~1e-6 between the caches, so the schedule keeps tau = 0.5: at tau = 1 ar's
    equal weights put ESS on the edge N vs N - 1e-7, and a flipped resampling decision shifts
    the random stream."""
    draft = tiny_llama(seed=5, layers=1)

    def run(kv_cache):
        target = lm(model, kv_cache=kv_cache)
        if method == "ar":
            program = autoregressive.program(target)
        else:
            program = smc_speculative.program(target, lm(draft, kv_cache=kv_cache), draft_len=3)
        result = program.run(PROMPT, Schedule(4, max_tokens=12), seed=0)
        return result.particles, result.resamples

    (static_particles, resamples), (copy_particles, _) = run("static"), run("copy")
    assert static_particles == copy_particles
    assert method == "ar" or resamples > 0


@pytest.mark.model
def test_backend_laws_hold_on_the_default_model(default_lm):
    """The laws on SmolLM2-135M (30 layers, 3 KV heads), over natural text."""
    static = HFLanguageModel(default_lm.model, default_lm.tokenizer, kv_cache="static", static_length=64)
    words = default_lm.tokenizer.encode("The lighthouse keeper climbed the stairs every evening and lit the lamp.", add_special_tokens=False)
    continuation = torch.tensor([words[6:12], words[7:13]])
    atol = testing.float32_logit_tolerance(default_lm.model, [words[:13]])
    testing.assert_select_consistent(static, words[:6], continuation, torch.tensor([1, 1, 0]), atol)
    testing.assert_truncate_consistent(static, words[:6], continuation, 3, atol)


BLOCK_OPTIONAL_PACKAGES = """
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("vllm", "genlm", "llguidance"):
            raise ImportError(f"{name} is not installed on this machine")

sys.meta_path.insert(0, Absent())
"""


def test_unconstrained_engine_runs_without_vllm_genlm_and_llguidance():
    """The GPU machine has torch and transformers only: ar, sd and smc-sd on the static cache must
    not import vllm, genlm-control or llguidance (checked in a fresh interpreter that cannot)."""
    script = BLOCK_OPTIONAL_PACKAGES + """
from tests.tiny_llama import PROMPT, lm, tiny_llama
from smc_sd import Schedule
from smc_sd.programs import autoregressive, smc_speculative, speculative
target, draft = lm(tiny_llama(), kv_cache="static"), lm(tiny_llama(seed=5, layers=1), kv_cache="static")
for program, particles in ((autoregressive.program(target), 2), (speculative.program(target, draft, draft_len=2), 1),
                           (smc_speculative.program(target, draft, draft_len=2), 2)):
    program.run(PROMPT, Schedule(particles, max_tokens=6), seed=0)
"""
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
