"""The library's engine end to end on a GPU, with real-sized random models: the compiled
static-KV hf path at batch 1 and the batched engine on the paged hf path.

No weights travel to the GPU machine and timing does not depend on weight values, so the target
is a Llama-3.1-8B-shaped and the draft a Llama-3.2-1B-shaped model with random bf16 weights built
from a config (`--shapes 8b`; `--shapes tiny` for a smoke run). Both run as
`HFLanguageModel(kv_cache="static", compile=True)`: fixed-shape KV buffers and a torch.compile'd
step (CUDA: mode "reduce-overhead", one CUDA graph per shape). Batch 1, a 256-token random
prompt, 256 new tokens. Settings: ar, exact sd at K = 4, smc-sd at N in {4, 8, 16} x K in {4, 8},
each run through `Program.run` (the engine, unchanged) after an untimed short run that compiles
its shapes (its wall time is warmup_seconds; shapes compiled for an earlier setting are reused).

The engine draws its random numbers on the host (its generators are CPU ones), so every forward's
logits cross to the host (`smc_sd.engine.rows`): one device-to-host copy and sync per forward,
included in the timings. Per setting:
- cycle_ms: the median time between consecutive cycles of the timed run (one target pass each);
- forward_ms: the median time of the same cycle's backend calls alone (K draft steps [N, 1], the
  verify [N, K + 1], a resampling row gather), logits left on the device: what a cycle kept on the
  device (sampling, weights, ESS and resampling there) would approach;
- tokens_per_cycle: 1 for ar; K + 1 for smc-sd (exact: every particle advances K + 1 per pass);
  for sd (1 - a^(K+1)) / (1 - a) at the acceptance a of `--acceptance` (random weights make the
  drawn tokens meaningless; the default a is the distilled draft's held-out acceptance measured on
  the CPU, benchmarks/results/draft_quality.json);
- tokens_per_second = tokens_per_cycle / cycle_ms, and speedup_vs_ar;
- roofline_fraction = (bytes a cycle must read) / bandwidth / cycle_ms, where the bytes are the
  target's weights once, the draft's weights K times (input embeddings excluded unless tied to the
  head, since a step reads only N of their rows) and the KV of the live positions (mean length
  prompt + new / 2) of every row, once per forward; bandwidth is measured here by a device copy
  (bytes read + bytes written per second). forward_roofline_fraction is the same for forward_ms.
The batched engine (`batched` in the JSON): `Program.run_many` over `--batch` random prompts of
`--prompt-len` tokens, `--batched-tokens` new tokens each, the same models as paged
`HFLanguageModel`s (eager: no compile, rows of different lengths packed into one forward), after
an untimed run of two prompts. Rows: ar on one prompt alone, ar on all, smc-sd N=4 K=4 on all,
and ar and smc-sd N=4 K=4 on all again with the engine's compiled step (`compile_step=True`:
the verification scores and draft draws as `torch.compile` graphs, compiled in the untimed run);
output tokens per second over the wall time (prefill included) and the ratios between them.
Beside them `bare_pass_ms`: one synchronised [B, 1] target pass on the paged and on the copy cache
at B = 1 and 16, the backend's cost before the engine's host work (`--host-threads` sets the
torch threads of that host work).
smc-sd's tokens do not depend on acceptance (every particle advances K + 1 per cycle).

Before timing, correctness checks run on the device at tiny size in fp32: compiled vs eager
logits of the static step (within 1e-4) and the backend laws of `smc_sd.testing` for the static
and the paged rows; a path whose checks fail is not timed (the JSON says why).

Sections run in this order: checks, the batched engine, the static settings while `--budget`
seconds last (later ones are listed as skipped). With `--out PATH` the
JSON is also written to PATH after every row, so a run cut short leaves what it measured.

Usage: python benchmarks/gpu.py [--shapes 8b|tiny] [--device cuda|cpu] [--acceptance A] [--settings "sd K=4,smc-sd N=8 K=4"]
                                [--batch 16] [--budget SECONDS] [--host-threads T] [--out PATH]
(`--shapes tiny --device cpu` is a smoke run of the whole script, 28-127 s on this project's CPU; only a
CUDA run writes benchmarks/results/gpu.json.)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import traceback

import torch

from _common import RESULTS, build_program, drop_prefix_caches, emit, environment, progress

SHAPES = {
    "8b": {
        "target": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
        "draft": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                      tie_word_embeddings=True),
        "names": ("Llama-3.1-8B-shaped", "Llama-3.2-1B-shaped"),
    },
    "tiny": {
        "target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1024),
        "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024),
        "names": ("tiny target", "tiny draft"),
    },
}
SD_DRAFT_LEN = 4
PARTICLES = (4, 8, 16)
DRAFT_LENS = (4, 8)
ACCEPTANCE_FILE = RESULTS / "draft_quality.json"


def build(config_kwargs: dict, device: str, dtype: torch.dtype, seed: int):
    """A LlamaForCausalLM with random weights, created directly on `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=8192, **config_kwargs)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class RandomTokenizer:
    """What the backend needs of a tokenizer for models whose tokens mean nothing: V ids, EOS = V - 1."""

    def __init__(self, vocab: int):
        self.vocab, self.eos_token_id = vocab, vocab - 1

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab)}

    def decode(self, ids, **_) -> str:
        return " ".join(f"<{i}>" for i in ids)


def static_lm(model, compile: bool, static_length: int):
    from smc_sd.backends.hf import HFLanguageModel

    tokenizer = RandomTokenizer(model.config.vocab_size)
    return HFLanguageModel(model, tokenizer, kv_cache="static", compile=compile, static_length=static_length)


def device_name(device: str) -> str:
    """The GPU's name, or the processor's model name as lscpu reports it."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return "cpu: " + line.split(":", 1)[1].strip()
    return "cpu"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, megabytes: int) -> float:
    """Bytes read plus bytes written per second by a device copy of `megabytes` MB (median of 10)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(12):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() / statistics.median(times[2:])


CHECK_ATOL = 1e-4
CHECK_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64)


def run_laws(laws: dict) -> dict:
    """Run each law; {"passed": whether all held, "laws": their names, "failed": {name: error}}."""
    failed = {}
    for name, law in laws.items():
        try:
            law()
        except Exception as error:  # a law that raises anything has not held on this device
            failed[name] = f"{type(error).__name__}: {error}"
    return {"passed": not failed, "laws": sorted(laws), "failed": failed, "atol": CHECK_ATOL}


def check_static(device: str) -> dict:
    """Compiled vs eager logits of the static step and the backend laws, tiny fp32 Llama on `device`."""
    from smc_sd import testing

    model = build(CHECK_CONFIG, device, torch.float32, seed=1)
    eager, compiled = static_lm(model, False, 64), static_lm(model, True, 64)
    prompt = [5, 3, 9, 1, 7]
    # [2, 6] int64 continuation rows
    tokens = torch.randint(64, (2, 6), generator=torch.Generator().manual_seed(2))
    deviation = []

    def compiled_matches_eager():
        rows = [lm.open(prompt, 2)[0] for lm in (eager, compiled)]
        for chunk in (tokens[:, :3], tokens[:, 3:]):
            logits = [r.extend(chunk) for r in rows]
            deviation.append((logits[0] - logits[1]).abs().max().item())
            for r in rows:
                r.select(torch.tensor([1, 0]))
        for r in rows:
            r.close()
        assert max(deviation) <= CHECK_ATOL, f"compiled logits differ from eager ones by {max(deviation):.3g}"

    checks = run_laws({
        "compiled_matches_eager": compiled_matches_eager,
        "extend_matches_full_forward": lambda: testing.assert_extend_matches_full_forward(eager, prompt, tokens, CHECK_ATOL),
        "select_consistent": lambda: testing.assert_select_consistent(eager, prompt, tokens, torch.tensor([1, 1, 0]), CHECK_ATOL),
        "truncate_consistent": lambda: testing.assert_truncate_consistent(eager, prompt, tokens, 2, CHECK_ATOL),
    })
    return {**checks, "compiled_vs_eager_max_abs": max(deviation, default=None)}


def check_paged(device: str) -> dict:
    """The laws of rows of different lengths (packed forwards, joins, rollbacks) for the paged
    rows of a tiny fp32 Llama on `device`, with blocks of 2 positions so prompts share some."""
    from smc_sd import testing
    from smc_sd.backends.hf import HFLanguageModel

    model = build(CHECK_CONFIG, device, torch.float32, seed=1)
    lm = HFLanguageModel(model, RandomTokenizer(64), kv_cache="paged", block_size=2)
    prompts = [[3, 1, 4, 1, 5], [3, 1, 4, 1, 9, 2, 6, 5], [7]]
    # [3, 6] and [9, 6] int64 continuation rows
    tokens = torch.randint(64, (3, 6), generator=torch.Generator().manual_seed(2))
    more = torch.randint(64, (9, 6), generator=torch.Generator().manual_seed(3))
    return run_laws({
        "ragged_extend_matches_full_forward": lambda: testing.assert_ragged_extend_matches_full_forward(lm, prompts, tokens, CHECK_ATOL),
        "ragged_select_consistent": lambda: testing.assert_ragged_select_consistent(lm, prompts, tokens, torch.tensor([2, 0, 2, 1]), CHECK_ATOL),
        "ragged_truncate_consistent": lambda: testing.assert_ragged_truncate_consistent(lm, prompts, tokens, [0, 11, 6], CHECK_ATOL),
        "extend_rows_consistent": lambda: testing.assert_extend_rows_consistent(lm, prompts, tokens, [2, 5, 0], CHECK_ATOL),
        "join_many_consistent": lambda: testing.assert_join_many_consistent(
            lm, prompts + [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8, 8, 8]], [2, 1, 3, 1, 2], more, CHECK_ATOL),
    })


def read_bytes(model, rows: int, positions: float) -> float:
    """Bytes one forward must read: the weights (the input embedding only if tied to the head) and
    the KV of `positions` positions of `rows` rows."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not c.tie_word_embeddings:
        weights -= model.get_input_embeddings().weight.numel() * model.get_input_embeddings().weight.element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize
    return weights + rows * positions * kv_per_position


def time_engine(method: str, target, draft, particles: int, draft_len: int, prompt: list[int], new_tokens: int) -> dict:
    """Run the engine once untimed (compiling its shapes), then once timed; the timed run's cycles."""
    from smc_sd import Schedule

    options = {"draft_len": draft_len} if draft_len else {}
    program = build_program(method, target, draft, **options)
    started = time.perf_counter()
    program.run(prompt, Schedule(particles, max_tokens=3 * (draft_len + 1) + 2), seed=1)
    warmup = time.perf_counter() - started
    stamps = []
    result = program.run(prompt, Schedule(particles, max_tokens=new_tokens), seed=0,
                         on_cycle=lambda *_: stamps.append(time.perf_counter()))
    gaps = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return {"cycle_ms": statistics.median(gaps), "cycles": len(result.cycles), "seconds": result.seconds,
            "resamples": result.resamples, "generated": len(result.tokens), "warmup_seconds": warmup}


def time_forwards(method: str, target, draft, particles: int, draft_len: int, prompt: list[int], device: str,
                  iters: int) -> float:
    """Median ms of one cycle's backend calls alone, logits left on the device."""
    target_rows, _ = target.open(prompt, particles)
    draft_rows = draft.open(prompt, particles)[0] if draft_len else None
    vocab = target.vocabulary.size
    ancestors = torch.arange(particles).flip(0)
    times = []
    for i in range(iters + 2):
        # [N, K + 1] random ids: what a cycle feeds its forwards
        block = torch.randint(vocab - 1, (particles, draft_len + 1))
        synchronize(device)
        start = time.perf_counter()
        for k in range(draft_len):
            draft_rows.extend(block[:, k : k + 1])
        target_rows.extend(block)
        if method == "smc-sd":
            target_rows.select(ancestors)
            draft_rows.select(ancestors)
        synchronize(device)
        if i >= 2:
            times.append(1000 * (time.perf_counter() - start))
        # every timed cycle sees the same lengths
        target_rows.truncate(len(prompt))
        if draft_rows is not None:
            draft_rows.truncate(len(prompt))
    target_rows.close()
    if draft_rows is not None:
        draft_rows.close()
    return statistics.median(times)


def time_bare_passes(models: dict, vocab: int, prompt: list[int], device: str, iters: int) -> dict:
    """Median ms of one bare [B, 1] target pass (ar's `time_forwards`) on the paged and the copy
    cache at B = 1 and 16: what the backend costs before the engine's host work."""
    from smc_sd.backends.hf import HFLanguageModel

    out = {}
    for kv_cache in ("paged", "copy"):
        lm = HFLanguageModel(models["target"], RandomTokenizer(vocab), kv_cache=kv_cache)
        for rows_count in (1, 16):
            out[f"{kv_cache} B={rows_count}"] = time_forwards("ar", lm, None, rows_count, 0, prompt, device, iters)
    return out


# the batched engine's rows: (label, method, N, K, how many of the prompts, whether the engine
# compiles its step: `BatchEngine(compile_step=True)`, smc_sd/engine/kernels.py)
BATCHED = (("ar B=1", "ar", 1, 0, 1, False), ("ar", "ar", 1, 0, None, False), ("smc-sd N=4 K=4", "smc-sd", 4, 4, None, False),
           ("ar, compiled step", "ar", 1, 0, None, True), ("smc-sd N=4 K=4, compiled step", "smc-sd", 4, 4, None, True))


def time_batched(method: str, target, draft, particles: int, draft_len: int, prompts: list[list[int]], new_tokens: int, compile_step: bool) -> dict:
    """`Program.run_many` over all the prompts at once, after an untimed short run over two of
    them (which also compiles the step's graphs, when `compile_step`)."""
    from smc_sd import Schedule

    options = {"draft_len": draft_len} if draft_len else {}
    program = build_program(method, target, draft, **options)
    program.run_many(prompts[:2], Schedule(particles, max_tokens=2 * (draft_len + 1) + 2), seeds=[1, 2][: len(prompts)], compile_step=compile_step)
    drop_prefix_caches(program)
    started = time.perf_counter()
    results = program.run_many(prompts, Schedule(particles, max_tokens=new_tokens), seeds=list(range(len(prompts))), max_running=len(prompts), compile_step=compile_step)
    seconds = time.perf_counter() - started
    generated = sum(len(r.tokens) for r in results)
    return {"requests": len(prompts), "seconds": seconds, "generated": generated, "tokens_per_second": generated / seconds,
            "cycles": max(len(r.cycles) for r in results)}


def expected_sd_tokens(acceptance: float, draft_len: int) -> float:
    """E[tokens per sd cycle] = (1 - a^(K+1)) / (1 - a) for i.i.d. acceptance a (Leviathan et al.)."""
    return (1 - acceptance ** (draft_len + 1)) / (1 - acceptance)


def settings() -> dict[str, tuple[str, int, int]]:
    """label -> (method, N, K): compiled ar, exact sd at K = SD_DRAFT_LEN, smc-sd over PARTICLES x DRAFT_LENS."""
    grid = [("ar", 1, 0), ("sd", 1, SD_DRAFT_LEN)] + [("smc-sd", n, k) for n in PARTICLES for k in DRAFT_LENS]
    return {setting_label(*setting): setting for setting in grid}


def setting_label(method: str, particles: int, draft_len: int) -> str:
    return {"ar": "ar", "sd": f"sd K={draft_len}", "smc-sd": f"smc-sd N={particles} K={draft_len}"}[method]


def default_acceptance() -> tuple[float | None, str]:
    if not ACCEPTANCE_FILE.exists():
        return None, "missing"
    value = json.loads(ACCEPTANCE_FILE.read_text())["acceptance"]
    return value, f"{ACCEPTANCE_FILE.relative_to(RESULTS.parent.parent)}: the distilled draft's held-out acceptance (1 - TV) against SmolLM2-135M, measured on CPU"


def static_row(label: str, method: str, n: int, k: int, models: dict, prompt: list[int], args, acceptance: float,
               mean_positions: float, bandwidth: float) -> dict:
    """One static setting timed through the engine and as bare forwards (the module docstring's fields)."""
    target, draft = models["static"]
    engine = time_engine(method, target, draft, n, k, prompt, args.new_tokens)
    forward_ms = time_forwards(method, target, draft, n, k, prompt, args.device, args.iters)
    tokens = {"ar": 1.0, "sd": expected_sd_tokens(acceptance, k), "smc-sd": float(k + 1)}[method]
    cycle_bytes = read_bytes(models["target"], n, mean_positions) + k * read_bytes(models["draft"], n, mean_positions)
    floor_ms = 1000 * cycle_bytes / bandwidth
    progress(f"gpu.py: {label}: cycle {engine['cycle_ms']:.2f} ms, forwards {forward_ms:.2f} ms")
    return {
        "label": label, "method": method, "particles": n, "draft_len": k, **engine,
        "forward_ms": forward_ms, "tokens_per_cycle": tokens,
        "tokens_per_second": 1000 * tokens / engine["cycle_ms"],
        "forward_tokens_per_second": 1000 * tokens / forward_ms,
        "bytes_per_cycle": cycle_bytes, "roofline_ms": floor_ms,
        "roofline_fraction": floor_ms / engine["cycle_ms"], "forward_roofline_fraction": floor_ms / forward_ms,
    }


def batched_section(models: dict, args, vocab: int) -> dict:
    """The batched engine's rows (`BATCHED`) on the paged models, and their ratios."""
    from smc_sd.backends.hf import HFLanguageModel

    paged = [HFLanguageModel(models[name], RandomTokenizer(vocab)) for name in ("target", "draft")]
    generator = torch.Generator().manual_seed(1)
    # [batch] random prompts of prompt_len ids below EOS
    prompts = torch.randint(vocab - 1, (args.batch, args.prompt_len), generator=generator).tolist()
    passes_ms = time_bare_passes(models, vocab, prompts[0], args.device, args.iters)
    rows = []
    for label, method, n, k, count, compile_step in BATCHED:
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        row = {"label": label, "method": method, "particles": n, "draft_len": k, "compile_step": compile_step,
               **time_batched(method, *paged, n, k, prompts[:count], args.batched_tokens, compile_step)}
        if args.device.startswith("cuda"):
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        progress(f"gpu.py: batched {label}: {row['tokens_per_second']:.1f} tokens/s over {row['requests']} requests")
        rows.append(row)
    alone, ar, smc, ar_compiled, smc_compiled = rows
    return {"batch": args.batch, "new_tokens": args.batched_tokens, "kv_cache": "paged", "bare_pass_ms": passes_ms, "rows": rows,
            "ar_batched_over_alone": ar["tokens_per_second"] / alone["tokens_per_second"],
            "smc-sd_over_ar_batched": smc["tokens_per_second"] / ar["tokens_per_second"],
            "ar_compiled_over_eager": ar_compiled["tokens_per_second"] / ar["tokens_per_second"],
            "smc-sd_compiled_over_eager": smc_compiled["tokens_per_second"] / smc["tokens_per_second"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="default: 8b on CUDA, tiny on CPU")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--acceptance", type=float, default=None, help="sd's per-token acceptance a (default: from draft_quality.json)")
    parser.add_argument("--iters", type=int, default=10, help="timed repetitions of each cycle's forwards")
    parser.add_argument("--settings", default=None, help="comma-separated labels to run (default: all; ar is always run)")
    parser.add_argument("--batch", type=int, default=16, help="requests the batched engine runs at once (0: skip it)")
    parser.add_argument("--batched-tokens", type=int, default=128, help="new tokens per request in the batched engine")
    parser.add_argument("--budget", type=float, default=None, help="seconds after which the remaining static settings are skipped")
    parser.add_argument("--host-threads", type=int, default=None, help="torch threads for the host's work (default: torch's own)")
    parser.add_argument("--out", default=None, help="also write the JSON here, after every row")
    parser.add_argument("--no-write", action="store_true", help="print JSON only (a CPU run never writes)")
    args = parser.parse_args(argv)
    chosen = settings()
    if args.settings is not None:
        wanted = {"ar"} | {label.strip() for label in args.settings.split(",")}
        if not wanted <= set(chosen):
            parser.error(f"unknown settings {sorted(wanted - set(chosen))}; known: {list(chosen)}")
        chosen = {label: setting for label, setting in chosen.items() if label in wanted}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --shapes tiny --device cpu for a smoke run")
    if args.batch < 0 or args.batched_tokens < 1:
        parser.error("--batch must be 0 or more and --batched-tokens 1 or more")
    shapes_name = args.shapes or ("8b" if args.device.startswith("cuda") else "tiny")
    acceptance, source = (args.acceptance, "--acceptance") if args.acceptance is not None else default_acceptance()
    if acceptance is None or not 0 <= acceptance < 1:
        parser.error(f"sd needs an acceptance in [0, 1) (--acceptance; {ACCEPTANCE_FILE} is {source})")

    if args.host_threads is not None:
        torch.set_num_threads(args.host_threads)
    started = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    shapes = SHAPES[shapes_name]
    data = {
        "benchmark": "gpu", "device": device_name(args.device), "shapes": shapes_name,
        "target": shapes["names"][0], "draft": shapes["names"][1], "dtype": str(dtype).removeprefix("torch."),
        "batch": 1, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "acceptance": acceptance, "acceptance_source": source, "environment": environment(),
        "checks": {"static": check_static(args.device), "paged": check_paged(args.device)},
        "rows": [], "skipped": [],
    }

    def save() -> None:
        data["wall_seconds"] = time.perf_counter() - started
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(data, indent=1) + "\n")

    save()
    models = {"target": build(shapes["target"], args.device, dtype, seed=0), "draft": build(shapes["draft"], args.device, dtype, seed=1)}
    # S: the prompt, the budget and one block of slack, as a multiple of 128
    capacity = -(-(args.prompt_len + args.new_tokens + max(DRAFT_LENS) + 2) // 128) * 128
    models["static"] = (static_lm(models["target"], True, capacity), static_lm(models["draft"], True, capacity))
    bandwidth = copy_bandwidth(args.device, 1024 if args.device.startswith("cuda") else 256)
    data.update(static_length=capacity, bandwidth_bytes_per_second=bandwidth)
    # [prompt_len] random ids below EOS
    prompt = torch.randint(shapes["target"]["vocab_size"] - 1, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    mean_positions = args.prompt_len + args.new_tokens / 2
    # the batched engine first (eager: its time is foreseeable), then the static settings while the budget lasts
    if args.batch and data["checks"]["paged"]["passed"]:
        try:
            data["batched"] = batched_section(models, args, shapes["target"]["vocab_size"])
        except Exception as error:  # recorded, so that the static settings still run
            traceback.print_exc()
            data["batched"] = {"error": f"{type(error).__name__}: {error}"}
        save()
    for label in chosen:
        if not data["checks"]["static"]["passed"] or (args.budget is not None and time.perf_counter() - started > args.budget):
            data["skipped"].append(label)
            continue
        data["rows"].append(static_row(label, *chosen[label], models, prompt, args, acceptance, mean_positions, bandwidth))
        save()
    rows = data["rows"]
    if rows and rows[0]["label"] == "ar":
        ar = rows[0]
        # the memory floor of one ar step (one target forward at batch 1)
        data["floor"] = {"ms": ar["roofline_ms"], "bytes": ar["bytes_per_cycle"], "bandwidth_bytes_per_second": bandwidth}
        for r in rows:
            r["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
            r["forward_speedup_vs_ar"] = r["forward_tokens_per_second"] / ar["forward_tokens_per_second"]
    smc = [r for r in rows if r["method"] == "smc-sd" and "speedup_vs_ar" in r]
    top = max(smc, key=lambda r: r["tokens_per_second"]) if smc else None
    data["best"] = {"smc-sd_vs_ar": top["speedup_vs_ar"], "label": top["label"]} if top else None
    save()
    emit("gpu", data, write=args.device.startswith("cuda") and not args.no_write)
    return data


if __name__ == "__main__":
    main()
