"""Cost of one categorical draw per row over the default model's 49,152 tokens: the engine's
inverse-CDF sampler (`smc_sd.engine.sampling.sample_tokens`) against `torch.multinomial`, in one run.

Both draw from softmax(scores) given the same [B, V] float32 scores (random logits at the scale of
real ones); B covers a draft step (N rows) and a verify's bonus and drafted positions (N (K + 1)).
Reported per B: median milliseconds per call of each, and multinomial_over_inverse_cdf.

`exp` times the engine's floored exp and logsumexp (`exp_floored`, `logsumexp_floored`) against
torch.exp and torch.logsumexp over 16 rows of three kinds: random logits at scale 3; log-probabilities
masked to 1% of the tokens (the rest -inf, as under a constraint); log-probabilities at T = 0.3 of
logits at scale 10 (most entries below the floor, -70). Reported per kind: median milliseconds of each and
torch_over_floored.

`scratch` times the vocabulary-sized intermediates of a cycle written into fresh memory (outside an
engine cycle) against the engine's scratch blocks kept from one call to the next
(`smc_sd.engine.scratch`): a draft step's draw and log q over 64 rows (`tokens_and_logprobs`,
16 requests of N = 4) and the log-softmax of their verification's [64, 5, V] logits. Reported
per kind: median milliseconds of each and fresh_over_scratch.

Usage: OMP_NUM_THREADS=1 python benchmarks/sampling.py [--repeats 40] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import emit, environment

VOCABULARY = 49152
BATCHES = (1, 4, 8, 20, 40)
#: rows of the exp comparison: a verify of 16 positions
EXP_ROWS = 16


def multinomial(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The former sampler: torch.multinomial on exp(scores - max)."""
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def median_ms(sample, scores: torch.Tensor, repeats: int) -> float:
    generator = torch.Generator().manual_seed(0)
    sample(scores, generator)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sample(scores, generator)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def exp_kinds() -> dict[str, torch.Tensor]:
    """The rows the floored exp is timed on (module docstring), [EXP_ROWS, V] float32 each."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(EXP_ROWS, VOCABULARY, generator=generator)
    allowed = torch.rand(EXP_ROWS, VOCABULARY, generator=generator) < 0.01
    return {"random logits": 3 * logits,
            "masked to 1%": torch.log_softmax(3 * logits, -1).masked_fill(~allowed, float("-inf")),
            "T = 0.3": torch.log_softmax(10 * logits / 0.3, -1)}


def exp_rows(repeats: int) -> list[dict]:
    """torch.exp and torch.logsumexp against the engine's floored ones, per kind of row."""
    from smc_sd.engine.sampling import EXP_FLOOR, exp_floored, logsumexp_floored

    pairs = {"exp": (torch.exp, exp_floored),
             "logsumexp": (lambda x: torch.logsumexp(x, -1), lambda x: logsumexp_floored(x, -1))}
    rows = []
    for kind, scores in exp_kinds().items():
        row = {"kind": kind, "below_floor": float((scores < EXP_FLOOR).double().mean())}
        for name, (exact, floored) in pairs.items():
            torch_ms = median_ms(lambda x, _: exact(x), scores, repeats)
            floored_ms = median_ms(lambda x, _: floored(x), scores, repeats)
            row |= {f"torch_{name}_ms": torch_ms, f"floored_{name}_ms": floored_ms, f"{name}_torch_over_floored": torch_ms / floored_ms}
        rows.append(row)
    return rows


def scratch_rows(repeats: int) -> list[dict]:
    """A draw and a block's log-softmax in fresh memory against the engine's scratch blocks."""
    from smc_sd.engine.cycle_locals import lending
    from smc_sd.engine.keyed_random import BONUS, counter, keyed_uniform
    from smc_sd.engine.sampling import tempered_logprobs_rows, tokens_and_logprobs
    from smc_sd.engine.scratch import Scratch

    generator = torch.Generator().manual_seed(1)
    draft = 3 * torch.randn(64, VOCABULARY, generator=generator)
    block = 3 * torch.randn(64, 5, VOCABULARY, generator=generator)
    u = keyed_uniform(3, counter(0, torch.arange(64), 0, BONUS))
    ones = torch.ones(64)
    kinds = {"draw 64 rows": (draft, lambda x, _: tokens_and_logprobs(x, u)),
             "log-softmax [64, 5, V]": (block, lambda x, _: tempered_logprobs_rows(x, ones, scaled=False, scratch_purpose="block_logp"))}
    rows = []
    for kind, (scores, call) in kinds.items():
        fresh_ms = median_ms(call, scores, repeats)
        with lending(scratch=Scratch()):
            scratch_ms = median_ms(call, scores, repeats)
        rows.append({"kind": kind, "fresh_ms": fresh_ms, "scratch_ms": scratch_ms, "fresh_over_scratch": fresh_ms / scratch_ms})
    return rows


def main(argv: list[str] | None = None) -> dict:
    from smc_sd.engine.sampling import sample_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no file")
    args = parser.parse_args(argv)
    rows = []
    for batch in BATCHES:
        scores = 3 * torch.randn(batch, VOCABULARY, generator=torch.Generator().manual_seed(batch))
        inverse_cdf = median_ms(sample_tokens, scores, args.repeats)
        former = median_ms(multinomial, scores, args.repeats)
        rows.append({"rows": batch, "inverse_cdf_ms": inverse_cdf, "multinomial_ms": former,
                     "multinomial_over_inverse_cdf": former / inverse_cdf})
    data = {"benchmark": "sampling", "vocabulary": VOCABULARY, "repeats": args.repeats,
            "environment": environment(), "rows": rows, "exp": exp_rows(args.repeats), "scratch": scratch_rows(args.repeats)}
    emit("sampling", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
