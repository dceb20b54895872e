"""A lipogram (no letter "e") as token masks of the default model: a `TokenConstraint` against a
user-written genlm-control `Potential` over bytes on the generic path (`BytePotentialConstraint`).

Three forms of the one constraint:
- token_constraint: a `TokenConstraint` whose mask is one precomputed [V] row (as tutorial 02);
- genlm_potential: a genlm-control `Potential` over bytes that defines `prefix`, `complete` and a
  constant `logw_next`, one context at a time, as a user writes it first;
- genlm_potential_batched: the same with a `batch_prefix` that answers a list of contexts in one
  call (genlm-control's batched method), as a user writes it for speed.

Part 1 ("masks") times `mask` alone along the prefixes of a text with no "e" (tokenised by the
default model), every prefix new to the constraint: one row per call, and four rows per call
(four consecutive prefixes, as the N = 4 particles of one cycle ask). Seconds per masked
position = a call's seconds / its rows. Part 2 ("programs") runs smc-sd (the default draft, N = 4,
K = 3, one prompt, one seed, after an untimed warm-up) with each form: seconds per generated
position, and the masks' seconds per masked particle-position (`Result.mask_row_seconds`,
median). The masks of the generic path are checked equal to the token constraint's on every
prefix of part 1.

    OMP_NUM_THREADS=1 python benchmarks/lipogram_masks.py [--label after] [--max-tokens 24] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from _common import emit, environment, load_default_models
from constrained import processor

TEXT = "A cat is a small animal that purrs and naps in sunny spots all day long, or hunts a mouth."
PROMPT = "Describe a cat."
FORMS = ("token_constraint", "genlm_potential", "genlm_potential_batched")


def lipograms(lm) -> dict:
    """The three forms of "no e" over `lm`'s tokens (module docstring): name -> a factory."""
    from genlm.control.potential import Potential

    from smc_sd.constraints.byte_vocabulary import token_bytes
    from smc_sd.constraints.token_constraints import TokenConstraint

    spelled = token_bytes(lm)

    class NoE(TokenConstraint):
        def __init__(self):
            # [V] bool: tokens whose bytes hold no e; special tokens never, EOS always
            self.allowed = torch.tensor([bool(b) and b"e" not in b.lower() for b in spelled])
            self.allowed[lm.vocabulary.eos_token_id] = True

        def mask(self, prefixes):
            return self.allowed.expand(len(prefixes), -1)

    class NoEBytes(Potential):
        def __init__(self):
            super().__init__(vocabulary=list(range(256)))
            self.row = np.zeros(257)
            self.row[[ord("e"), ord("E")]] = -np.inf

        async def prefix(self, context):
            return float("-inf") if b"e" in bytes(context).lower() else 0.0

        async def complete(self, context):
            return await self.prefix(context)

        async def logw_next(self, context):
            return self.make_lazy_weights(self.row)

    class NoEBytesBatched(NoEBytes):
        async def batch_prefix(self, contexts):
            texts = [bytes(c) for c in contexts]
            return np.array([float("-inf") if b"e" in t or b"E" in t else 0.0 for t in texts])

    return {"token_constraint": NoE, "genlm_potential": NoEBytes, "genlm_potential_batched": NoEBytesBatched}


def lowered(form: str, factory, lm):
    """The constraint the engine masks with (a fresh lowering: no masks cached yet)."""
    from smc_sd.constraints.potentials import as_token_constraint

    return factory() if form == "token_constraint" else as_token_constraint(factory(), lm)


def seconds_per_row(constraint, calls: list[list[list[int]]]) -> tuple[dict, list[torch.Tensor]]:
    """Median and mean seconds per masked row over the calls, and every call's mask."""
    times, masks = [], []
    for rows in calls:
        started = time.perf_counter()
        masks.append(constraint.mask(rows))
        times.append((time.perf_counter() - started) / len(rows))
    return {"calls": len(calls), "median_s": statistics.median(times), "mean_s": statistics.fmean(times)}, masks


def mask_costs(target, forms: dict) -> dict:
    from smc_sd.constraints.byte_vocabulary import vocabulary_trie

    vocabulary_trie(target)  # built once per LM (about 2 s), outside every timing
    tokens = target.tokenizer.encode(TEXT, add_special_tokens=False)
    prefixes = [tokens[:t] for t in range(len(tokens))]
    modes = {"1 row": [[p] for p in prefixes], "4 rows": [prefixes[t : t + 4] for t in range(0, len(prefixes), 4)]}
    out, reference = {}, None
    for mode, calls in modes.items():
        for form, factory in forms.items():
            stats, masks = seconds_per_row(lowered(form, factory, target), calls)
            joined = torch.cat([m.reshape(-1, m.shape[-1]) for m in masks])
            if form == "token_constraint":
                reference = joined
            stats["masks_equal_token_constraint"] = bool(torch.equal(joined, reference))
            out[f"{form}, {mode}"] = stats
    return {"prefixes": len(prefixes), "modes": out}


def program_costs(target, draft, forms: dict, particles: int, draft_len: int, max_tokens: int) -> list[dict]:
    from smc_sd import Program, Proposal, Schedule, Target
    from smc_sd.backends.hf import chat_prompt

    prompt = chat_prompt(target.tokenizer, PROMPT)
    schedule = Schedule(particles=particles, max_tokens=max_tokens)
    proposal = Proposal(draft, draft_len=draft_len)
    Program("warm-up", Target(target), proposal).run(prompt, schedule, seed=0)
    rows = []
    for form, factory in forms.items():
        result = Program(form, Target(target, constraints=(factory(),)), proposal).run(prompt, schedule, seed=0)
        positions = sum(c.tokens for c in result.cycles)
        rows.append({
            "form": form,
            "seconds": result.seconds,
            "positions": positions,
            "seconds_per_position": result.seconds / positions,
            "mask_seconds": result.mask_seconds,
            "mask_seconds_per_particle_position_median": statistics.median(result.mask_row_seconds),
            "target_passes": result.target_passes,
            "text": result.text,
        })
    return rows


def program_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of the lipogram's program runs (this script's and `potential_paths.py`'s)."""
    parser.add_argument("--particles", type=int, default=4)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--no-write", action="store_true")
    return parser


def main(argv=None) -> dict:
    parser = program_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--label", default="", help="a name for this tree (before, after), kept in the JSON and the file name")
    args = parser.parse_args(argv)

    target, draft = load_default_models()
    forms = lipograms(target)
    data = {
        "benchmark": "lipogram_masks",
        "label": args.label,
        "environment": environment() | {"processor_name": processor()},
        "settings": {"particles": args.particles, "draft_len": args.draft_len, "max_tokens": args.max_tokens, "prompt": PROMPT, "text": TEXT, "dtype": "float32"},
        "masks": mask_costs(target, forms),
        "programs": program_costs(target, draft, forms, args.particles, args.draft_len, args.max_tokens),
    }
    emit("lipogram_masks" + (f"_{args.label}" if args.label else ""), data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
