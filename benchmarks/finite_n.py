"""Finite-N bias of SMC-SD against the exact target, by ESS threshold, on toy LMs.

SMC-SD is consistent as N grows and biased at finite N; resampling decides how. For each case
(a toy LM, a constraint and alpha), each proposal (a draft LM, or the free draft alone), each N
and each ESS threshold tau, `--runs` seeded runs estimate the law of the returned string, and
its total variation from the exact target pi(x) ∝ p_T(x)^alpha phi(x) (enumerated,
`ToyLM.completion_distribution`) is reported two ways:

- tv_weighted: TV(mean over runs of each run's normalised final weights, pi). A run returns a
  particle drawn from its final weights, so the mean of the weights is an unbiased estimate of
  the returned string's law, with less noise than the returned strings themselves;
- tv_sampled: TV(empirical law of the returned strings, pi);
- minus_never: tv_weighted minus the same seeds' tv_weighted with tau = 0 (never resampling).

Noise: `floor_median` and `floor_q95` are the median and 95th percentile of the TV of `--runs`
exact draws from pi (simulated), the noise of tv_sampled when the method is exact; `tv_weighted_sd`
is the bootstrap standard deviation (runs resampled) of tv_weighted, `minus_never_sd` the paired
bootstrap's of minus_never.

Cases (`CASES`): "regex" ("[ab]+", alpha = 1), "alpha2" (alpha = 2, no constraint) and
"regex_alpha2" (both), on `ToyLM.random(4, seed=0, scale=1.0)` (letters a, b, c and EOS) after a
prompt that repeats its tokens; "ends" and "ends_alpha2" ("(a|b)*c|a+", alpha 1 and 2) on the
tests' toy target `ToyLM.random(4, seed=3)`, where "c" ends the string. The draft LM is the
target with N(0, 1) noise on its logits (K = 2); the free draft proposes continuations found by
lookup in the prompt and the text (min_match 1, at most 3 tokens) and the tokens a constraint forces.

    OMP_NUM_THREADS=1 python benchmarks/finite_n.py [--runs 400] [--particles 2,4,16,64] [--thresholds 0,0.5,1] [--no-write]
"""

from __future__ import annotations

import argparse
import random
import time

from _common import emit, environment
from constrained import processor

#: a prompt that repeats its tokens, so that lookup proposes; the second is the tests' WORDS_PROMPT
PROMPT = [0, 1, 0, 1, 1, 0, 1, 0, 0, 1]
WORDS_PROMPT = [1, 2, 2, 1, 2, 1, 2, 2, 0]
#: target ToyLM.random(4, seed, scale); "ends" cases: "c" must end the string, after which only
#: EOS is allowed (a one-token look-ahead normaliser p(EOS | c)^alpha, small beside the others)
CASES = {
    "regex": {"regex": "[ab]+", "alpha": 1.0, "max_tokens": 6, "seed": 0, "scale": 1.0, "prompt": PROMPT},
    "alpha2": {"regex": None, "alpha": 2.0, "max_tokens": 5, "seed": 0, "scale": 1.0, "prompt": PROMPT},
    "regex_alpha2": {"regex": "[ab]+", "alpha": 2.0, "max_tokens": 6, "seed": 0, "scale": 1.0, "prompt": PROMPT},
    "ends": {"regex": "(a|b)*c|a+", "alpha": 1.0, "max_tokens": 6, "seed": 3, "scale": 1.5, "prompt": WORDS_PROMPT},
    "ends_alpha2": {"regex": "(a|b)*c|a+", "alpha": 2.0, "max_tokens": 6, "seed": 3, "scale": 1.5, "prompt": WORDS_PROMPT},
}
DRAFT_LEN = 2


def models(case: dict):
    """The case's toy target and the draft LM: the target's logits plus N(0, 1) noise."""
    from smc_sd.backends.toy import ToyLM

    target = ToyLM.random(4, seed=case["seed"], scale=case["scale"])
    return target, ToyLM.perturbed(target, 1.0)


def program(target, draft, proposal: str, case: dict):
    from smc_sd.constraints.grammars import Regex
    from smc_sd.program import FreeDraft
    from smc_sd.programs import smc_speculative

    constraints = (Regex(case["regex"]),) if case["regex"] else ()
    free = FreeDraft(min_match=1, max_len=3) if proposal == "free" else None
    return smc_speculative.program(target, draft if proposal == "lm" else None, draft_len=DRAFT_LEN, alpha=case["alpha"], constraints=constraints, free_draft=free)


def exact_target(target, case: dict) -> dict:
    from smc_sd.constraints.grammars import Regex
    from smc_sd.constraints.potentials import as_token_constraint

    constraint = as_token_constraint(Regex(case["regex"]), target) if case["regex"] else None
    return target.completion_distribution(case["prompt"], case["max_tokens"], alpha=case["alpha"], constraint=constraint)[0]


def bootstrap_sd(posteriors: list[dict], pi: dict, baseline: list[dict] | None = None, replicates: int = 200, seed: int = 0) -> float:
    """The standard deviation of tv_weighted over runs resampled with replacement; with
    `baseline` (the same seeds' runs under another setting), of the difference tv_weighted -
    tv_weighted(baseline), both from the same resampled seeds (a paired bootstrap)."""
    from smc_sd.metrics import total_variation

    def mean_law(runs: list[dict], picks: list[int]) -> dict:
        mean: dict = {}
        for k in picks:
            for x, w in runs[k].items():
                mean[x] = mean.get(x, 0.0) + w / len(picks)
        return mean

    rng, n, values = random.Random(seed), len(posteriors), []
    for _ in range(replicates):
        picks = [rng.randrange(n) for _ in range(n)]
        value = total_variation(mean_law(posteriors, picks), pi)
        if baseline is not None:
            value -= total_variation(mean_law(baseline, picks), pi)
        values.append(value)
    average = sum(values) / replicates
    return (sum((v - average) ** 2 for v in values) / (replicates - 1)) ** 0.5


def study(prog, pi: dict, prompt: list[int], particles: int, threshold: float, runs: int, max_tokens: int) -> tuple[dict, list[dict]]:
    """One setting's row, and its runs' normalised final weights (seed by seed)."""
    from smc_sd.metrics import empirical, total_variation
    from smc_sd.program import Schedule

    schedule = Schedule(particles, ess_threshold=threshold, max_tokens=max_tokens)
    samples, posteriors, resamples, started = [], [], 0, time.perf_counter()
    for seed in range(runs):
        result = prog.run(prompt, schedule, seed=seed)
        samples.append(tuple(result.tokens))
        posteriors.append(result.posterior)
        resamples += result.resamples
    mean: dict = {}
    for posterior in posteriors:
        for x, w in posterior.items():
            mean[x] = mean.get(x, 0.0) + w / runs
    return {
        "particles": particles,
        "ess_threshold": threshold,
        "tv_weighted": round(total_variation(mean, pi), 4),
        "tv_weighted_sd": round(bootstrap_sd(posteriors, pi), 4),
        "tv_sampled": round(total_variation(empirical(samples), pi), 4),
        "resamples_per_run": round(resamples / runs, 3),
        "seconds_per_run": round((time.perf_counter() - started) / runs, 4),
    }, posteriors


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400, help="seeded runs per setting")
    parser.add_argument("--particles", default="2,4,16,64")
    parser.add_argument("--thresholds", default="0,0.5,1")
    parser.add_argument("--cases", default=",".join(CASES), help="a comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--proposals", default="lm,free")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    from smc_sd.metrics import tv_null_quantile

    cases = [c.strip() for c in args.cases.split(",")]
    out = []
    for name in cases:
        case = CASES[name]
        target, draft = models(case)
        pi = exact_target(target, case)
        rows = []
        for proposal in args.proposals.split(","):
            prog = program(target, draft, proposal, case)
            for n in (int(x) for x in args.particles.split(",")):
                never = None
                for tau in (float(x) for x in args.thresholds.split(",")):
                    row, posteriors = study(prog, pi, case["prompt"], n, tau, args.runs, case["max_tokens"])
                    if tau == 0.0:
                        never = (row, posteriors)
                    elif never is not None:
                        # the change from never resampling, same seeds, and its paired noise
                        row["minus_never"] = round(row["tv_weighted"] - never[0]["tv_weighted"], 4)
                        row["minus_never_sd"] = round(bootstrap_sd(posteriors, pi, never[1]), 4)
                    rows.append(row | {"proposal": proposal})
        out.append({
            "case": name,
            "settings": case,
            "outcomes": len(pi),
            "floor_median": round(tv_null_quantile(pi, args.runs, 0.5), 4),
            "floor_q95": round(tv_null_quantile(pi, args.runs, 0.95), 4),
            "rows": rows,
        })
    data = {
        "benchmark": "finite_n",
        "environment": environment() | {"processor_name": processor()},
        "settings": {"runs": args.runs, "draft_len": DRAFT_LEN, "target": "ToyLM.random(4, seed, scale)", "draft": "ToyLM.perturbed(target, 1.0)", "free_draft": "FreeDraft(min_match=1, max_len=3)"},
        "cases": out,
    }
    emit("finite_n", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
