"""Speed of ar, exact sd and smc-sd on the default model, in one run, with ratios to ar.

For every configuration in CONFIGS (edit or extend the list; `--grid` swaps in a bigger N x K
grid) each prompt is decoded once with a fixed seed. Reported per configuration:
- tokens_per_second: generated tokens of the returned text / wall seconds (model load excluded);
- target_passes_per_token: target forwards, the prompt's included, per generated token;
- speedup_vs_ar: tokens_per_second / that of "ar" measured in the same run;
- mean_target_logprob (and its standard error): fidelity, the mean over generated tokens of
  log p_T(x_t | x_<t) at T = 1 (scored by the run's target, in its dtype); logprob_ratio_vs_ar:
  that mean / ar's (1.03 = 3% lower);
- mean_ess_per_cycle: the mean ESS (out of N) after each cycle's weight update;
- the row "hf-generate" is transformers' own `generate` (sampling, no top-k/top-p), a second
  anchor beside the library's ar;
- kv_peak_bytes: the KV cache's peak (target and draft); with --kv-compare every smc-sd
  configuration also runs with per-particle KV copies (kv_cache "copy") and its shared-cache
  row gets paged_over_copy = its tokens/s / the copy twin's;
- with --static-compare every configuration also runs on the static KV cache, eagerly and
  compiled (torch.compile, CPU: no CUDA graphs): static_over_paged = the static twin's tokens/s /
  the paged row's, compiled_over_eager = the compiled twin's / the static twin's. Compilation
  happens in an untimed decode of the first prompt before the timed ones.

On this project's CPU verification is not free (a [8, 5] forward costs about 3x a [1, 1] one),
so CPU ratios show costs as measured; they are not GPU predictions (see gpu.py).

Every configuration, ar and hf-generate included, runs in one dtype (`--dtype`, default float32;
`auto` takes bfloat16 where the CPU multiplies bf16 natively); every row names it and the
processor, and a run in another dtype than float32 writes its own results file. Every row samples
at one temperature (`--temperature`, default 1; a draft LM drafts at it too), and a run at
another temperature writes its own results file.

Free drafts (`--draft free`; `smc_sd.program.FreeDraft`: continuations found in the prompt and
the text so far, no model): the rows are ar, hf-generate, "sd free" (exact sd verifying the free
draft, one target token where it proposes nothing) and "smc-sd N=4 free" (each particle extended
by exact speculative sampling with the free draft). `--draft free+NAME` adds "sd K=k free+draft"
rows: the free draft where it proposes, the draft NAME elsewhere. Every row also reports
acceptance (drafted tokens accepted / verified: lookup tokens in a free row; None where no pass
verifies drafted tokens one by one), proposing_pass_fraction (verify passes that checked at
least one drafted token) and tokens_per_verify_pass (tokens after the first per target pass).

Prompt sets (`--prompts-set`): "chat", open questions where little of the answer repeats the
prompt, and "grounded", requests to summarise, rewrite or quote a given passage
(benchmarks/prompts/grounded.json: invented passages of 60-150 words), where much of it does.
A grounded run writes its own results file.

`--backend llama-cpp` runs the free-draft rows (`--draft free`, or `free+FILE.gguf` with a GGUF
draft LM) on the llama.cpp backend: the shipped GGUF as it ships, one thread per decode (torch's
thread count). Its anchor row, in place of hf-generate, is "llama-cpp-python": that package's own
high-level generation (`Llama.generate`, sampling at the same temperature with top-k, top-p,
min-p and the repeat penalty off, i.e. the same distribution as ar) on the same file. Its results
file ends in "_llama-cpp".

Usage: python benchmarks/speed.py [--max-tokens 128] [--prompts 4] [--prompts-set chat|grounded] [--temperature 1] [--grid]
       [--draft self|distilled|feature|DIR|free|free+NAME] [--kv-compare] [--static-compare]
       [--labels "ar,sd K=2,smc-sd K=4 N=4"] [--dtype float32|bfloat16|auto]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from dataclasses import asdict, dataclass, field, replace

from _common import (
    DRAFT_HELP,
    add_dtype_argument,
    build_program,
    describe_draft,
    drop_prefix_caches,
    emit,
    environment,
    load_default_models,
    mean_stderr,
    pyplot,
    save_figure,
)

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your favourite city in detail.",
    "List some uses of a paper clip and explain each.",
]

#: requests to summarise, rewrite or quote a passage: name, task, instruction, passage
GROUNDED = pathlib.Path(__file__).resolve().parent / "prompts" / "grounded.json"


def prompt_set(name: str) -> list[str]:
    """The user messages of a prompt set: "chat" (PROMPTS) or "grounded" (each GROUNDED item's
    instruction, a blank line, then its passage)."""
    if name == "chat":
        return list(PROMPTS)
    return [f"{item['instruction']}\n\n{item['passage']}" for item in json.loads(GROUNDED.read_text())]


PROMPT_SETS = ("chat", "grounded")


@dataclass(frozen=True)
class Config:
    """One measured configuration: a shipped method, its particles N and draft length K."""

    method: str
    particles: int = 1
    draft_len: int = 0
    options: dict = field(default_factory=dict)
    # the hf backend's KV cache: "paged" (shared by particles), "copy" (one per particle) or
    # "static" (fixed-shape buffers per particle)
    kv_cache: str = "paged"
    # static cache only: the fixed-shape step runs through torch.compile
    compile: bool = False
    # the free draft proposes first (`FreeDraft()`); with draft_len 0 it proposes alone
    free: bool = False

    @property
    def label(self) -> str:
        parts = [self.method]
        if self.draft_len:
            parts.append(f"K={self.draft_len}")
        if self.method == "smc-sd":
            parts.append(f"N={self.particles}")
        parts += [f"{k}={v}" for k, v in sorted(self.options.items())]
        if self.free:
            parts.append("free+draft" if self.draft_len else "free")
        if self.kv_cache != "paged":
            parts.append(f"kv={self.kv_cache}")
        if self.compile:
            parts.append("compiled")
        return " ".join(parts)


#: the label of transformers' `generate` (sampling), the second anchor row
HF_GENERATE = "hf-generate"
#: the label of llama-cpp-python's own generation, the anchor row of --backend llama-cpp
LLAMA_GENERATE = "llama-cpp-python"

CONFIGS = [
    Config("ar"),
    Config(HF_GENERATE),
    Config("sd", draft_len=1),
    Config("sd", draft_len=2),
    Config("sd", draft_len=3),
    Config("smc-sd", particles=2, draft_len=2),
    Config("smc-sd", particles=2, draft_len=4),
    Config("smc-sd", particles=4, draft_len=2),
    Config("smc-sd", particles=4, draft_len=4),
    Config("smc-sd", particles=8, draft_len=2),
    Config("smc-sd", particles=8, draft_len=4),
    Config("smc-sd", particles=16, draft_len=2),
]


#: the rows of --draft free: the free draft alone under exact sd and under smc-sd
FREE_CONFIGS = [
    Config("ar"),
    Config(HF_GENERATE),
    Config("sd", free=True),
    Config("smc-sd", particles=4, free=True),
]


def free_configs(with_lm: bool) -> list[Config]:
    """FREE_CONFIGS, and with a draft LM (--draft free+NAME) exact sd with the free draft first
    and the draft LM elsewhere at K = 1, 2, 3 (smc-sd takes the free draft alone)."""
    return FREE_CONFIGS + ([Config("sd", draft_len=k, free=True) for k in (1, 2, 3)] if with_lm else [])


def grid(particles=(1, 2, 4, 8, 16), draft_lens=(1, 2, 4, 8)) -> list[Config]:
    """ar, sd at every K and smc-sd at every (N, K)."""
    configs = [Config("ar"), Config(HF_GENERATE)] + [Config("sd", draft_len=k) for k in draft_lens]
    return configs + [Config("smc-sd", particles=n, draft_len=k) for n in particles for k in draft_lens]


def target_logprobs(target, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p_T(x_t | prompt, x_<t) at T = 1 for every generated token x_t (EOS included)."""
    import torch

    rows, first = target.open(prompt, 1)
    # [n, V]: the distribution before each generated token
    logits = first[None]
    if len(tokens) > 1:
        logits = torch.cat([logits, rows.extend(torch.tensor([tokens[:-1]]))[0]])
    rows.close()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def hf_generate(target, prompt: list[int], max_tokens: int, seed: int, temperature: float = 1.0) -> dict:
    """The second anchor: transformers' own `generate`, sampling at `temperature` with no top-k
    or top-p (the same distribution as ar), with its own dynamic KV cache."""
    import torch

    eos = target.vocabulary.eos_token_id
    torch.manual_seed(seed)
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(
            torch.tensor([prompt]), do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
            max_new_tokens=max_tokens, pad_token_id=eos, eos_token_id=eos,
        )
    seconds = time.perf_counter() - started
    tokens = out[0, len(prompt):].tolist()
    tokens = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
    return {
        "tokens": len(tokens), "seconds": seconds, "target_passes": len(tokens), "draft_passes": 0,
        "proposed": 0, "accepted": 0, "proposing_passes": 0,
        "resamples": 0, "kv_peak_bytes": 0, "ess": [], "logprobs": target_logprobs(target, prompt, tokens),
    }


def llama_generate(target, prompt: list[int], max_tokens: int, seed: int, temperature: float = 1.0) -> dict:
    """The anchor of --backend llama-cpp: llama-cpp-python's own `Llama.generate` on the target's
    GGUF file, sampling at `temperature` with every truncation and penalty off (the law of ar).
    One `Llama` per target, made on first use (its load is not timed)."""
    import llama_cpp

    if not hasattr(target, "anchor"):
        target.anchor = llama_cpp.Llama(str(target.path), n_ctx=4096, n_threads=target.n_threads, n_threads_batch=target.n_threads, verbose=False)
    llm = target.anchor
    eos = target.vocabulary.eos_token_id
    llm.set_seed(seed)
    llm.reset()
    tokens = []
    started = time.perf_counter()
    for token in llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if token == eos or len(tokens) == max_tokens:
            break
    seconds = time.perf_counter() - started
    return {
        "tokens": len(tokens), "seconds": seconds, "target_passes": len(tokens), "draft_passes": 0,
        "proposed": 0, "accepted": 0, "proposing_passes": 0,
        "resamples": 0, "kv_peak_bytes": 0, "ess": [], "logprobs": target_logprobs(target, prompt, tokens),
    }


def decode(config: Config, program, target, prompt: list[int], max_tokens: int, seed: int, temperature: float = 1.0) -> dict:
    """Decode one prompt once with `program` (built for `config`); its counts and target log-probs."""
    from smc_sd import Schedule

    if config.method == HF_GENERATE:
        return hf_generate(target, prompt, max_tokens, seed, temperature)
    if config.method == LLAMA_GENERATE:
        return llama_generate(target, prompt, max_tokens, seed, temperature)

    for lm in (target, program.proposal.lm if program.proposal is not None else None):
        if hasattr(lm, "kv_cache"):
            lm.kv_cache, lm.compile = config.kv_cache, config.compile
    drop_prefix_caches(program)
    result = program.run(prompt, Schedule(config.particles, max_tokens=max_tokens), seed=seed)
    return {
        "tokens": len(result.tokens),
        "seconds": result.seconds,
        # +1: the prompt's own forward, which also yields the first token
        "target_passes": result.target_passes + 1,
        # drafted tokens the passes verified and accepted (every particle's), passes that verified any
        "proposed": sum(c.proposed or 0 for c in result.cycles),
        "accepted": sum(c.accepted or 0 for c in result.cycles),
        "proposing_passes": sum(bool(c.proposed) for c in result.cycles),
        "draft_passes": result.draft_passes,
        "resamples": result.resamples,
        "kv_peak_bytes": result.kv["peak_bytes"] if result.kv else 0,
        "ess": [c.ess for c in result.cycles],
        "logprobs": target_logprobs(target, prompt, result.tokens),
    }


def measure(
    configs: list[Config], target, draft, prompts: list[list[int]], max_tokens: int, seed: int, temperature: float = 1.0
) -> list[dict]:
    """Decode every prompt once with every configuration; sum tokens, seconds and passes per configuration.

    Every configuration samples the target at `temperature`, and a draft LM drafts at it too.

    A free configuration verifies `FreeDraft()` (its default settings), with `draft` where it
    proposes nothing if its draft_len is nonzero, else with no draft LM.

    The configurations take turns prompt by prompt (prompt 1 with every configuration, then
    prompt 2, ...), so a change of load on the machine during the run hits them alike. Prompt i
    is decoded with seed + i by every configuration. Fidelity: mean_target_logprob = the mean over
    all generated tokens of log p_T(x_t | x_<t) (T = 1), with its standard error; scored after
    timing, so it costs no measured time.
    """
    from smc_sd.program import FreeDraft

    programs = []
    for config in configs:
        options = {"draft_len": config.draft_len, **config.options} if config.draft_len else dict(config.options)
        options = {"temperature": temperature, "draft_temperature": temperature, **options}
        if config.free:
            options["free_draft"] = FreeDraft()
        lm = None if config.free and not config.draft_len else draft
        programs.append(None if config.method in (HF_GENERATE, LLAMA_GENERATE) else build_program(config.method, target, lm, **options))
    # wall seconds of the untimed first decode of each compiled configuration, which compiles its
    # step shapes (those a configuration shares with an earlier one are compiled already)
    warmup = {}
    for config, program in zip(configs, programs):
        if config.compile:
            started = time.perf_counter()
            decode(config, program, target, prompts[0], max_tokens, seed, temperature)
            warmup[config.label] = time.perf_counter() - started
    runs = [[] for _ in configs]
    for i, prompt in enumerate(prompts):
        for config, program, done in zip(configs, programs, runs):
            done.append(decode(config, program, target, prompt, max_tokens, seed + i, temperature))
    rows = []
    for config, done in zip(configs, runs):
        tokens = sum(r["tokens"] for r in done)
        seconds = sum(r["seconds"] for r in done)
        mean_logprob, logprob_stderr = mean_stderr([lp for r in done for lp in r["logprobs"]])
        passes, proposed = sum(r["target_passes"] for r in done), sum(r["proposed"] for r in done)
        rows.append({
            "label": config.label,
            **asdict(config),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "target_passes_per_token": passes / tokens,
            # the first token comes from the prompt's pass; every later pass verifies a block
            "tokens_per_verify_pass": (tokens - len(done)) / max(1, passes - len(done)),
            # drafted tokens accepted / verified (None: no pass verified a drafted token)
            "acceptance": sum(r["accepted"] for r in done) / proposed if proposed else None,
            "proposing_pass_fraction": sum(r["proposing_passes"] for r in done) / max(1, passes - len(done)),
            "draft_passes_per_token": sum(r["draft_passes"] for r in done) / tokens,
            "resamples": sum(r["resamples"] for r in done),
            "kv_peak_bytes": max(r["kv_peak_bytes"] for r in done),
            # the mean over cycles of the ESS (out of N) after each cycle's weight update
            "mean_ess_per_cycle": sum(e for r in done for e in r["ess"]) / max(1, sum(len(r["ess"]) for r in done)),
            "mean_target_logprob": mean_logprob,
            "mean_target_logprob_stderr": logprob_stderr,
            **({"warmup_seconds": warmup[config.label]} if config.label in warmup else {}),
        })
    return rows


# fidelity tolerance: a setting counts as faithful when its mean target log-probability per token
# is within this fraction of ar's
FIDELITY_TOLERANCE = 0.03


def best(rows: list[dict], method: str, faithful: bool = False) -> dict | None:
    """The row of `method` with the most tokens/s, among the faithful ones if `faithful` (None if none)."""
    candidates = [r for r in rows if r["method"] == method]
    if faithful:
        candidates = [r for r in candidates if abs(r["logprob_ratio_vs_ar"] - 1) <= FIDELITY_TOLERANCE]
    return max(candidates, key=lambda r: r["tokens_per_second"]) if candidates else None


def results_name(draft: str | None, dtype: str = "float32", prompts_set: str = "chat", temperature: float = 1.0, backend: str = "hf") -> str:
    """The results file's stem: "speed" with the default (self) draft, "speed_distilled" or
    "speed_feature" with the shipped distilled or feature draft, "speed_other" with a draft from
    a directory, "speed_free" with the free draft alone and "speed_free_self", "speed_free_distilled",
    ... with free+NAME; then "_grounded" for the grounded prompts, "_T0.3" for a temperature
    other than 1 and "_bfloat16" for bfloat16; "_llama-cpp" on --backend llama-cpp."""
    from smc_sd.drafts import FREE, PACKAGE_DRAFTS, parse_draft

    choice = parse_draft(draft)
    lm = "self" if choice.lm is None else choice.lm if choice.lm in PACKAGE_DRAFTS else "other"
    if choice.free:
        name = f"speed_{FREE}_{lm}" if choice.has_lm else f"speed_{FREE}"
    else:
        name = "speed" if lm == "self" else f"speed_{lm}"
    if prompts_set != "chat":
        name += f"_{prompts_set}"
    if temperature != 1.0:
        name += f"_T{temperature:g}"
    if backend == "llama-cpp":
        return f"{name}_llama-cpp"
    return name if dtype == "float32" else f"{name}_{dtype}"


def plot(rows: list[dict], name: str) -> list[str]:
    plt = pyplot()
    labels = [r["label"] for r in rows]
    colours = ["tab:green" if r["free"] else {"ar": "grey", "sd": "tab:blue"}.get(r["method"], "tab:orange") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8))
    axes[0].barh(labels, [r["tokens_per_second"] for r in rows], color=colours)
    axes[0].set_xlabel("tokens / second (returned text, wall clock)")
    axes[0].set_title("Decoding speed")
    axes[1].barh(labels, [r["target_passes_per_token"] for r in rows], color=colours)
    axes[1].set_xlabel("target forward passes per generated token")
    axes[1].set_title("Target passes per token (lower is better)")
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    return [save_figure(fig, name)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=None, help="how many of the set's prompts (default all)")
    parser.add_argument(
        "--prompts-set", choices=PROMPT_SETS, default="chat",
        help="chat: open questions; grounded: summarise, rewrite or quote a given passage (benchmarks/prompts/grounded.json)",
    )
    parser.add_argument("--grid", action="store_true", help="N in 1..16 x K in 1..8 instead of CONFIGS")
    parser.add_argument(
        "--draft", default=None,
        help=DRAFT_HELP + "; distilled: --backend hf only; 'free' (no model: the rows ar, sd free, smc-sd N=4 free) "
        "or 'free+NAME' (also sd K=1..3 with the free draft first and NAME elsewhere)",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0,
        help="T of every row (ar, hf-generate, the target and any draft LM); fidelity is scored at T = 1 regardless",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no files")
    parser.add_argument("--json", dest="no_write", action="store_true", help="the same as --no-write")
    parser.add_argument(
        "--backend", choices=["hf", "vllm", "llama-cpp"], default="hf",
        help="vllm: one vLLM engine per model (needs the vLLM environment; the draft is the target without layer 5); "
        "llama-cpp: the shipped GGUF on llama.cpp, with --draft free or free+FILE.gguf (needs the llama extra)",
    )
    parser.add_argument(
        "--kv-compare", action="store_true",
        help="hf backend: also run every smc-sd configuration with per-particle KV copies",
    )
    parser.add_argument(
        "--static-compare", action="store_true",
        help="hf backend: also run every configuration on the static KV cache, eager and compiled",
    )
    parser.add_argument("--labels", default=None, help="comma-separated labels of the configurations to run (e.g. 'ar,sd K=2')")
    add_dtype_argument(parser)
    args = parser.parse_args(argv)

    from smc_sd.drafts import parse_draft

    try:
        choice = parse_draft(args.draft)
    except ValueError as error:
        parser.error(str(error))
    if choice.free and (args.grid or args.backend == "vllm"):
        parser.error("--draft free runs its own rows on --backend hf; it takes no --grid")
    if args.backend == "llama-cpp" and not choice.free:
        parser.error("--backend llama-cpp runs the free-draft rows: give --draft free or free+FILE.gguf")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if args.prompts is not None and args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")

    from smc_sd.backends.hf import HFLanguageModel, chat_prompt
    from smc_sd.backends.precision import choose_precision
    from smc_sd.backends.static_hf import round_up

    precision = choose_precision(args.dtype)
    if args.backend == "llama-cpp":
        from smc_sd.backends.llama_cpp import LlamaCppLanguageModel
        from smc_sd.backends.precision import Precision

        precision = Precision(precision.dtype, "llama.cpp: the GGUF's own weights (Q4_1 as shipped), float32 activations")
        target = LlamaCppLanguageModel.default(n_seq_max=16)
        draft = LlamaCppLanguageModel(choice.lm, tokenizer=target.tokenizer, n_seq_max=16) if choice.has_lm else None
    elif args.backend == "vllm":
        from smc_sd.backends.vllm import VLLMLanguageModel, VLLMOptions

        options = VLLMOptions(dtype=precision.name)
        target = VLLMLanguageModel.default(options)
        draft = VLLMLanguageModel(args.draft, options) if args.draft not in (None, "self") else VLLMLanguageModel.self_draft(options)
    elif choice.free and not choice.has_lm:
        target, draft = HFLanguageModel.default(dtype=precision.dtype), None
    else:
        target, draft = load_default_models(choice.lm, precision.dtype)
    prompts = [chat_prompt(target.tokenizer, p) for p in prompt_set(args.prompts_set)[: args.prompts]]
    # warm-up: the first forwards of a process are slower (allocations, kernel selection)
    build_program("ar", target, draft).run(prompts[0], __import__("smc_sd").Schedule(1, max_tokens=4))

    started = time.perf_counter()
    configs = free_configs(choice.has_lm) if choice.free else grid() if args.grid else CONFIGS
    if args.labels is not None:
        wanted = [label.strip() for label in args.labels.split(",")]
        unknown = sorted(set(wanted) - {c.label for c in configs})
        if unknown:
            parser.error(f"unknown configuration labels {unknown}; known: {[c.label for c in configs]}")
        configs = [c for c in configs if c.label in wanted]
    if args.backend == "vllm":
        configs = [c for c in configs if c.method != HF_GENERATE]
    if args.backend == "llama-cpp":
        configs = [Config(LLAMA_GENERATE) if c.method == HF_GENERATE else c for c in configs]
    if args.kv_compare and args.backend == "hf":
        configs = configs + [replace(c, kv_cache="copy") for c in configs if c.method == "smc-sd" and not c.free]
    if args.static_compare and args.backend == "hf":
        # free rows differ in length between particles: the paged cache only
        plain = [c for c in configs if c.kv_cache == "paged" and c.method != HF_GENERATE and not c.free]
        configs = configs + [replace(c, kv_cache="static") for c in plain] + [replace(c, kv_cache="static", compile=True) for c in plain]
        # S positions per row: the longest prompt, the budget and one block of slack
        for lm in (lm for lm in (target, draft) if lm is not None):
            lm.static_length = round_up(max(map(len, prompts)) + args.max_tokens + 16)
    rows = measure(configs, target, draft, prompts, args.max_tokens, args.seed, args.temperature)
    for copy in (r for r in rows if r["kv_cache"] == "copy"):
        twin = next(r for r in rows if r["label"] == copy["label"].removesuffix(" kv=copy"))
        twin["paged_over_copy"] = twin["tokens_per_second"] / copy["tokens_per_second"]
    for static in (r for r in rows if r["kv_cache"] == "static"):
        base = static["label"].removesuffix(" compiled").removesuffix(" kv=static")
        if static["compile"]:
            eager = next(r for r in rows if r["label"] == base + " kv=static")
            static["compiled_over_eager"] = static["tokens_per_second"] / eager["tokens_per_second"]
        else:
            paged = next(r for r in rows if r["label"] == base)
            static["static_over_paged"] = static["tokens_per_second"] / paged["tokens_per_second"]
    ar = next(r["tokens_per_second"] for r in rows if r["method"] == "ar")
    ar_logprob = next(r["mean_target_logprob"] for r in rows if r["method"] == "ar")
    env = environment()
    for r in rows:
        # one target and one draft serve every row, so ar ran in this dtype too
        r["dtype"], r["processor"] = ("gguf " + target.weight_format if args.backend == "llama-cpp" else precision.name), env["processor"]
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar
        # 1 = the same mean target log-probability per token as ar; 1.03 = 3% lower (more negative)
        r["logprob_ratio_vs_ar"] = r["mean_target_logprob"] / ar_logprob
    data = {
        "benchmark": "speed",
        "backend": args.backend,
        "model": f"SmolLM2-135M-Instruct ({'gguf ' + target.weight_format if args.backend == 'llama-cpp' else precision.name}, CPU)",
        "dtype": precision.name,
        "dtype_reason": precision.reason,
        "draft": describe_draft(args.draft),
        "processor": env["processor"],
        "prompts_set": args.prompts_set,
        "temperature": args.temperature,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "environment": env,
        "wall_seconds": time.perf_counter() - started,
        # the fastest setting of each method, and the fastest within FIDELITY_TOLERANCE of ar's
        # mean target log-probability ("faithful")
        "best": {
            f"{method}{' faithful' if faithful else ''}": {
                k: row[k] for k in ("label", "speedup_vs_ar", "logprob_ratio_vs_ar")
            }
            for method in ("sd", "smc-sd")
            for faithful in (False, True)
            if (row := best(rows, method, faithful)) is not None
        },
        "rows": rows,
    }
    name = results_name(args.draft, precision.name, args.prompts_set, args.temperature, args.backend)
    if not args.no_write:
        data["plots"] = plot(rows, name)
    emit(name, data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
