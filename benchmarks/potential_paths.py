"""What each way of writing your own potential costs (docs/potentials.md), on the default model.

One constraint written four ways: a lipogram, no letter "e" in the output.
- token_constraint: a `TokenConstraint` whose mask is one precomputed [V] row;
- genlm_potential: a genlm-control `Potential` over bytes with a `batch_prefix`, through the
  generic byte path (`BytePotentialConstraint`: every token's `prefix` for a new prefix in one
  `batch_prefix` call);
- block_potential: the soft version, log phi = -2 per "e", as a `FunctionPotential` scored once
  per particle per block;
- twist: the same score as a twist, which steers resampling and leaves the target unchanged.

Part 1 times each object alone, one call per new prefix (the prefixes of a text with no "e",
tokenised by the default model): seconds per masked position or per scored particle. Part 2 runs
each as a program (smc-sd, the default draft, N particles, K draft tokens, one prompt, one seed,
after one untimed warm-up run) next to the unconstrained program: seconds per generated position,
and the masks' time per particle-position.

Usage: OMP_NUM_THREADS=1 python benchmarks/potential_paths.py [--particles 4] [--draft-len 3]
       [--max-tokens 24] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import emit, environment, load_default_models

TEXT = "A cat is a small animal that purrs and naps in sunny spots all day long."
PROMPT = "Describe a cat."


def lipograms(lm):
    """The four forms of "no letter e" over `lm`'s tokens: the token constraint and the genlm-control
    byte potential of `benchmarks/lipogram_masks.py`, a soft score and a twist."""
    from lipogram_masks import lipograms as hard_forms

    from smc_sd.constraints.byte_vocabulary import token_bytes
    from smc_sd.constraints.scores import FunctionPotential

    spelled = token_bytes(lm)
    forms = hard_forms(lm)
    NoE, NoEBytes = forms["token_constraint"], forms["genlm_potential_batched"]

    def count_e(tokens):
        return sum((spelled[t] or b"").lower().count(b"e") for t in tokens)

    def twist(prefixes):
        return torch.tensor([-2.0 * count_e(p) for p in prefixes], dtype=torch.float64)

    fewer_e = FunctionPotential(lambda tokens, complete: -2.0 * count_e(tokens))
    return NoE, NoEBytes, fewer_e, twist


def per_call(fn, items) -> dict:
    """Median and mean seconds of fn(item) over items, one call each."""
    times = []
    for item in items:
        started = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - started)
    return {"calls": len(times), "median_s": statistics.median(times), "mean_s": statistics.fmean(times)}


def component_costs(target) -> dict:
    from smc_sd.constraints.byte_vocabulary import vocabulary_trie
    from smc_sd.constraints.potentials import BytePotentialConstraint

    NoE, NoEBytes, fewer_e, twist = lipograms(target)
    vocabulary_trie(target)  # built once per LM (about 1.5 s), outside every timing
    tokens = target.tokenizer.encode(TEXT, add_special_tokens=False)
    prefixes = [tokens[:t] for t in range(len(tokens))]
    token, generic = NoE(), BytePotentialConstraint(NoEBytes(), target)
    # every prefix is new to the generic path's cache, so each call walks the byte trie
    return {
        "prefixes": len(prefixes),
        "token_constraint_mask": per_call(lambda p: token.mask([p]), prefixes),
        "genlm_potential_mask": per_call(lambda p: generic.mask([p]), prefixes),
        "block_potential_score_4_particles": per_call(lambda p: fewer_e.log_score([p] * 4, [False] * 4), prefixes),
        "twist_4_particles": per_call(lambda p: twist([p] * 4), prefixes),
    }


def program_costs(target, draft, particles: int, draft_len: int, max_tokens: int) -> list[dict]:
    from smc_sd import Program, Proposal, Schedule, Target
    from smc_sd.backends.hf import chat_prompt

    NoE, NoEBytes, fewer_e, twist = lipograms(target)
    prompt = chat_prompt(target.tokenizer, PROMPT)
    schedule = Schedule(particles=particles, max_tokens=max_tokens)
    proposal = Proposal(draft, draft_len=draft_len)
    programs = {
        "unconstrained": Program("unconstrained", Target(target), proposal),
        "token_constraint": Program("token_constraint", Target(target, constraints=(NoE(),)), proposal),
        "genlm_potential": Program("genlm_potential", Target(target, constraints=(NoEBytes(),)), proposal),
        "block_potential": Program("block_potential", Target(target, potentials=(fewer_e,)), proposal),
        "twist": Program("twist", Target(target), proposal, twist=twist),
    }
    programs["unconstrained"].run(prompt, schedule, seed=0)  # warm-up: the first run pays one-off costs
    rows = []
    for name, program in programs.items():
        result = program.run(prompt, schedule, seed=0)
        per_row = sorted(result.mask_row_seconds)
        positions = sum(c.tokens for c in result.cycles)
        rows.append({
            "way": name,
            "seconds": result.seconds,
            "positions": positions,
            "seconds_per_position": result.seconds / positions,
            "mask_seconds": result.mask_seconds,
            # seconds per masked particle-position (each mask call's time over its rows), median
            "mask_seconds_per_particle_position": per_row[len(per_row) // 2] if per_row else None,
            "target_passes": result.target_passes,
            "text": result.text,
            "letters_e": result.text.lower().count("e"),
        })
    return rows


def main(argv=None) -> None:
    from lipogram_masks import program_arguments

    args = program_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    target, draft = load_default_models()
    data = {
        "environment": environment(),
        "lipogram": "no letter e; soft forms score -2 nats per e",
        "components": component_costs(target),
        "settings": {"particles": args.particles, "draft_len": args.draft_len, "max_tokens": args.max_tokens,
                     "draft": "self (the target without decoder layer 5)", "prompt": PROMPT, "seed": 0},
        "programs": program_costs(target, draft, args.particles, args.draft_len, args.max_tokens),
    }
    emit("potential_paths", data, write=not args.no_write)


if __name__ == "__main__":
    main()
