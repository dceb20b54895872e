"""Cost of one categorical draw per row over the default model's 49,152 tokens: the engine's
inverse-CDF sampler (`smc_sd.engine.sampling.sample_tokens`) against `torch.multinomial`, in one run.

Both draw from softmax(scores) given the same [B, V] float32 scores (random logits at the scale of
real ones); B covers a draft step (N rows) and a verify's bonus and drafted positions (N (K + 1)).
Reported per B: median milliseconds per call of each, and multinomial_over_inverse_cdf.

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
            "environment": environment(), "rows": rows}
    emit("sampling", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
