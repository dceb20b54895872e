"""The exact conditional of the default model over {0,1}^5, against constrained SMC-SD and
mask-at-verify.

The language is the 32 strings of five binary digits (`Regex("[01]{5}")`). SmolLM2 has exactly two
tokens made only of binary digits ("0" and "1", checked below), so every string has one
tokenization, five tokens, and the target's exact law over the language is enumerable from one
batched forward:

    pi(x) ∝ prod_{t=1..5} p_T(x_t | prompt, x_<t) · p_T(EOS | prompt, x)          (conditional)
    lambda(x) = prod_{t=1..6} p_T(x_t | ...) m_t(x_t) / sum_v p_T(v | ...) m_t(v)    (local projection)

with m_t the constraint's mask (x_6 = EOS). Constrained SMC-SD targets pi and approaches it as N
grows (consistent, biased at finite N); mask-at-verify samples lambda. TV is measured from
`--runs` seeded runs per setting, for the returned strings (`tv_to_conditional`; `floor` is the
expected TV of that many exact draws from pi, sampling noise alone) and for the runs' weighted
particles averaged (`weighted_tv_to_conditional`, R N particles: less noisy at large N).

    OMP_NUM_THREADS=1 python benchmarks/constrained_law.py --runs 64
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from _common import emit, environment, load_default_models
from constrained import processor

PATTERN = "[01]{5}"
PROMPT = "Write a random binary number with five digits. Reply with the digits only."


def binary_tokens(tokenizer) -> dict[str, int]:
    """The tokens whose text consists of binary digits only; the study needs exactly "0" and "1"."""
    found = {}
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text and set(text) <= {"0", "1"}:
            found[text] = token_id
    if set(found) != {"0", "1"}:
        raise SystemExit(f"tokenization of {{0,1}}^5 is not unique: binary tokens {sorted(found)}")
    return found


def exact_laws(target, prompt: list[int], constraint, digits: dict[str, int]) -> tuple[dict, dict]:
    """(pi, lambda) over the 32 strings as {token tuple + (EOS,): probability} (module docstring)."""
    eos = target.vocabulary.eos_token_id
    strings = [tuple(digits[c] for c in bits) for bits in itertools.product("01", repeat=5)]
    rows, first = target.open(prompt, len(strings))
    try:
        # [32, 6, V] log p_T before each of the 5 digits and before EOS
        logits = torch.cat([first.expand(len(strings), 1, -1), rows.extend(torch.tensor(strings))], 1)
    finally:
        rows.close()
    logp = torch.log_softmax(logits.double(), -1)
    joint, local = {}, {}
    for b, string in enumerate(strings):
        full = string + (eos,)
        masks = constraint.mask([list(string[:t]) for t in range(6)])
        joint[full] = sum(float(logp[b, t, full[t]]) for t in range(6))
        local[full] = sum(float(logp[b, t, full[t]] - torch.logsumexp(logp[b, t][masks[t]], 0)) for t in range(6))
    return normalise(joint), normalise(local)


def normalise(log_weights: dict) -> dict:
    top = max(log_weights.values())
    weights = {x: math.exp(w - top) for x, w in log_weights.items()}
    total = sum(weights.values())
    return {x: w / total for x, w in weights.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=64, help="seeded runs per setting")
    parser.add_argument("--particles", default="1,4,16,64")
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    from smc_sd.backends.hf import chat_prompt
    from smc_sd.metrics import empirical, total_variation, tv_tolerance
    from smc_sd.program import Schedule
    from smc_sd.constraints.grammars import Regex
    from smc_sd.constraints.potentials import as_token_constraint
    from smc_sd.programs import mask_at_verify, smc_speculative

    target, draft = load_default_models()
    digits = binary_tokens(target.tokenizer)
    prompt = chat_prompt(target.tokenizer, PROMPT)
    potential = Regex(PATTERN)
    pi, local = exact_laws(target, prompt, as_token_constraint(potential, target), digits)
    # every run stops by EOS after five digits: the budget never cuts a string
    schedule_tokens = 8

    def study(program, particles: int) -> dict:
        samples, seconds = [], 0.0
        # the runs' weighted particle systems, averaged: SMC's estimate of pi from all R N particles
        weighted: dict = {}
        for seed in range(args.runs):
            result = program.run(prompt, Schedule(particles, max_tokens=schedule_tokens), seed=seed)
            samples.append(tuple(result.tokens))
            seconds += result.seconds
            for x, w in result.posterior.items():
                weighted[x] = weighted.get(x, 0.0) + w / args.runs
        observed = empirical(samples)
        return {
            "particles": particles,
            "tv_to_conditional": total_variation(observed, pi),
            "tv_to_local": total_variation(observed, local),
            "weighted_tv_to_conditional": total_variation(weighted, pi),
            "outside_language": sum(p for x, p in observed.items() if x not in pi),
            "seconds_per_run": seconds / args.runs,
        }

    smc = smc_speculative.program(target, draft, draft_len=args.draft_len, constraints=(potential,))
    rows = [study(smc, int(n)) | {"method": "smc-sd"} for n in args.particles.split(",")]
    mav = mask_at_verify.program(target, draft, draft_len=args.draft_len, constraints=(potential,))
    rows.append(study(mav, 1) | {"method": "mask-at-verify"})
    top = sorted(pi.items(), key=lambda kv: -kv[1])[:5]
    data = {
        "benchmark": "constrained_law",
        "environment": environment() | {"processor": processor()},
        "settings": {"pattern": PATTERN, "prompt": PROMPT, "runs": args.runs, "draft_len": args.draft_len, "max_tokens": schedule_tokens},
        "tv_conditional_vs_local": total_variation(pi, local),
        # expected TV of `runs` exact draws (Jensen bound), and the bound the tests use
        "floor": 0.5 * sum(math.sqrt(p * (1 - p) / args.runs) for p in pi.values()),
        "tolerance": tv_tolerance(pi, args.runs),
        "top_strings": {target.decode(list(x)): round(p, 4) for x, p in top},
        "local_of_top_strings": {target.decode(list(x)): round(local[x], 4) for x, _ in top},
        "rows": rows,
    }
    emit("constrained_law", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
