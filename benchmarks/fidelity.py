"""How close each method's output is to its target: exactly on toy LMs, by log-probability on the
default model.

Toy part: a random ToyLM target (3 tokens: "a", "b", EOS) and a draft that adds noise to its
logits. Its completion distribution pi(x) ∝ p(x)^alpha is enumerated exactly, so the total
variation TV(empirical, pi) of M independent runs (seeds 0..M-1, one returned text per run) is
measured for smc-sd over a grid of N and K, for exact sd (the control: it samples p exactly) and
for smc-sd with alpha = 2 against the power target p^2. TV of M exact draws is not 0; the
`floor` row is the mean TV of M draws from pi itself, the sampling noise every row shares.

Default-model part: each method's outputs (several prompts x seeds) scored by the target at
T = 1: the mean log p_T(x_t | x_<t) per generated token, with its standard error over outputs.
ar and sd sample p_T, so they agree in expectation; smc-sd at small N leans towards the draft;
alpha > 1 moves mass to likelier text (higher log-probability).

Usage: python benchmarks/fidelity.py [--samples 2000] [--lm-prompts 3] [--lm-seeds 4] [--skip-lm]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from _common import DRAFT_HELP, RESULTS, build_program, describe_draft, emit, environment, load_default_models, mean_stderr, pyplot, save_figure, setting_label

PARTICLES = (1, 2, 4, 8, 16)
DRAFT_LENS = (1, 2, 4)
TOY = {"vocab_size": 3, "seed": 3, "scale": 1.5, "draft_noise": 1.0, "prompt": [0], "max_tokens": 5}

LM_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your favourite city in detail.",
    "Give three tips for learning a language.",
]
LM_SETTINGS = [
    {"method": "ar"},
    {"method": "sd", "draft_len": 4},
    {"method": "smc-sd", "particles": 2, "draft_len": 4},
    {"method": "smc-sd", "particles": 8, "draft_len": 4},
    {"method": "smc-sd", "particles": 8, "draft_len": 4, "alpha": 2.0},
]


def sample_tv(program, particles: int, exact: dict, samples: int) -> float:
    """TV between the empirical distribution of `samples` runs' returned texts and `exact`."""
    from smc_sd import Schedule
    from smc_sd.metrics import empirical, total_variation

    schedule = Schedule(particles, max_tokens=TOY["max_tokens"])
    outputs = [tuple(program.run(TOY["prompt"], schedule, seed=s).tokens) for s in range(samples)]
    return total_variation(empirical(outputs), exact)


def noise_floor(exact: dict, samples: int, repeats: int = 20) -> float:
    """Mean TV between `samples` iid draws from `exact` and `exact` itself."""
    from smc_sd.metrics import empirical, total_variation

    rng = random.Random(0)
    keys, weights = list(exact), list(exact.values())
    tvs = [total_variation(empirical(rng.choices(keys, weights, k=samples)), exact) for _ in range(repeats)]
    return sum(tvs) / repeats


def toy_fidelity(samples: int, particles=PARTICLES, draft_lens=DRAFT_LENS) -> dict:
    """TV to the exact target for smc-sd (N x K grid, alpha 1 and 2) and sd (each K)."""
    from smc_sd.backends.toy import ToyLM
    from smc_sd.programs import smc_speculative, speculative

    target = ToyLM.random(vocab_size=TOY["vocab_size"], seed=TOY["seed"], scale=TOY["scale"])
    draft = ToyLM.perturbed(target, noise=TOY["draft_noise"])
    exact = {a: target.completion_distribution(TOY["prompt"], TOY["max_tokens"], alpha=a)[0] for a in (1.0, 2.0)}
    rows = []
    for k in draft_lens:
        tv = sample_tv(speculative.program(target, draft, draft_len=k), 1, exact[1.0], samples)
        rows.append({"method": "sd", "particles": 1, "draft_len": k, "alpha": 1.0, "tv": tv})
        for alpha in (1.0, 2.0):
            program = smc_speculative.program(target, draft, draft_len=k, alpha=alpha)
            for n in particles:
                tv = sample_tv(program, n, exact[alpha], samples)
                rows.append({"method": "smc-sd", "particles": n, "draft_len": k, "alpha": alpha, "tv": tv})
    return {
        "toy": TOY,
        "support": len(exact[1.0]),
        "samples": samples,
        "floor": {str(a): noise_floor(exact[a], samples) for a in exact},
        "rows": rows,
    }


def target_logprob_per_token(target, prompt: list[int], tokens: list[int]) -> float:
    """(1/L) sum_t log p_T(x_t | prompt, x_<t) at T = 1 for generated tokens x_1..x_L."""
    rows, first = target.open(prompt, 1)
    try:
        logits = [first[None]]
        if len(tokens) > 1:
            # [L - 1, V]: the distribution after each of x_1 .. x_{L-1}
            logits.append(rows.extend(torch.tensor([tokens[:-1]]))[0])
        # [L, V]
        logp = torch.log_softmax(torch.cat(logits).double(), -1)
        return logp[torch.arange(len(tokens)), torch.tensor(tokens)].mean().item()
    finally:
        rows.close()


def lm_fidelity(target, draft, prompts: int, seeds: int, max_tokens: int) -> dict:
    """Mean target log-probability per token of each setting's outputs, with standard errors."""
    from smc_sd import Schedule
    from smc_sd.backends.hf import chat_prompt

    encoded = [chat_prompt(target.tokenizer, p) for p in LM_PROMPTS[:prompts]]
    rows = []
    for setting in LM_SETTINGS:
        options = {k: v for k, v in setting.items() if k not in ("method", "particles")}
        program = build_program(setting["method"], target, draft, **options)
        schedule = Schedule(setting.get("particles", 1), max_tokens=max_tokens)
        scores = []
        for prompt in encoded:
            for seed in range(seeds):
                tokens = program.run(prompt, schedule, seed=seed).tokens
                scores.append(target_logprob_per_token(target, prompt, tokens))
        mean, stderr = mean_stderr(scores)
        rows.append({**setting, "alpha": setting.get("alpha", 1.0), "outputs": len(scores),
                     "mean_logprob_per_token": mean, "stderr": stderr})
    return {"prompts": prompts, "seeds": seeds, "max_tokens": max_tokens, "rows": rows}


def plot(toy: dict, lm: dict | None) -> list[str]:
    plt = pyplot()
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, alpha in zip(axes, (1.0, 2.0)):
        for k in sorted({r["draft_len"] for r in toy["rows"]}):
            pts = [(r["particles"], r["tv"]) for r in toy["rows"]
                   if r["method"] == "smc-sd" and r["draft_len"] == k and r["alpha"] == alpha]
            ax.plot(*zip(*pts), "o-", label=f"smc-sd K={k}")
        if alpha == 1.0:
            for r in (r for r in toy["rows"] if r["method"] == "sd"):
                ax.axhline(r["tv"], ls=":", color="tab:blue", alpha=0.6)
            ax.plot([], [], ":", color="tab:blue", label="exact sd (each K)")
        ax.axhline(toy["floor"][str(alpha)], color="black", ls="--", label=f"floor: {toy['samples']} exact draws")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("particles N")
        ax.set_title(f"Toy LM, target p^{alpha:g}: TV of {toy['samples']} outputs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("total variation to the exact target")
    paths.append(save_figure(fig, "fidelity_toy"))
    if lm is not None:
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(lm["rows"]) + 1.8))
        labels = [setting_label(r) for r in lm["rows"]]
        ax.errorbar([r["mean_logprob_per_token"] for r in lm["rows"]], labels,
                    xerr=[1.96 * r["stderr"] for r in lm["rows"]], fmt="o", capsize=4)
        ax.invert_yaxis()
        ax.set_xlabel("mean target log-probability per token (nats), 95% interval")
        ax.set_title(f"Default model: each method's outputs scored by the target\n"
                     f"({lm['rows'][0]['outputs']} outputs each, up to {lm['max_tokens']} tokens, T = 1)")
        ax.grid(axis="x", alpha=0.3)
        paths.append(save_figure(fig, "fidelity_lm"))
    return paths


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replot", action="store_true", help="redraw the plots from results/fidelity.json")
    parser.add_argument("--samples", type=int, default=2000, help="toy runs per configuration")
    parser.add_argument("--lm-prompts", type=int, default=3)
    parser.add_argument("--lm-seeds", type=int, default=4)
    parser.add_argument("--lm-max-tokens", type=int, default=16)
    parser.add_argument("--skip-lm", action="store_true", help="toy part only (no model load)")
    parser.add_argument("--draft", default=None, help=DRAFT_HELP)
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)
    if args.replot:
        data = json.loads((RESULTS / "fidelity.json").read_text())
        return {"plots": plot(data["toy"], data["lm"])}

    started = time.perf_counter()
    toy = toy_fidelity(args.samples)
    lm = None
    if not args.skip_lm:
        target, draft = load_default_models(args.draft)
        lm = lm_fidelity(target, draft, args.lm_prompts, args.lm_seeds, args.lm_max_tokens)
        lm["draft"] = describe_draft(args.draft)
    data = {"benchmark": "fidelity", "environment": environment(), "toy": toy, "lm": lm,
            "wall_seconds": time.perf_counter() - started}
    if not args.no_write:
        data["plots"] = plot(toy, lm)
    emit("fidelity", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
