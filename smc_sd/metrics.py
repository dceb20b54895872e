"""Distances between distributions over completions, and the sampling tolerance of a TV estimate."""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Iterable


def empirical(samples: Iterable[Hashable]) -> dict:
    """Relative frequencies of the samples."""
    counts = Counter(samples)
    n = sum(counts.values())
    return {x: c / n for x, c in counts.items()}


def total_variation(p: dict, q: dict) -> float:
    """TV(p, q) = 1/2 sum_x |p(x) - q(x)| over the union of supports."""
    return 0.5 * sum(abs(p.get(x, 0.0) - q.get(x, 0.0)) for x in set(p) | set(q))


def tv_tolerance(p: dict, n: int, failure_probability: float = 1e-6) -> float:
    """A bound that TV(p_hat_n, p) exceeds with probability at most `failure_probability`, where
    p_hat_n is the empirical distribution of n independent draws from p.

    E|p_hat(x) - p(x)| <= sqrt(p(x)(1 - p(x)) / n) (Jensen), so E TV <= mu = 1/2 sum_x of that;
    one draw moves TV by at most 1/n, so McDiarmid gives P(TV >= mu + t) <= exp(-2 n t^2).
    """
    mu = 0.5 * sum(math.sqrt(px * (1 - px) / n) for px in p.values())
    return mu + math.sqrt(math.log(1 / failure_probability) / (2 * n))


def tv_null_quantile(p: dict, n: int, level: float = 0.95, replicates: int = 2000, seed: int = 0) -> float:
    """The `level` quantile of TV(p_hat_n, p) when p_hat_n is the empirical law of n exact draws
    from p, estimated from `replicates` simulated samples of size n (a multinomial per replicate).

    Exact sampling at n draws exceeds it with probability 1 - level: a method whose TV at n draws
    lies above it is measurably off p. Much tighter than `tv_tolerance`, which bounds the same
    quantile by an inequality.
    """
    import numpy as np

    outcomes = list(p)
    probs = np.array([p[x] for x in outcomes], dtype=np.float64)
    counts = np.random.default_rng(seed).multinomial(n, probs / probs.sum(), size=replicates)
    # [replicates] TV of each simulated empirical law
    tvs = 0.5 * np.abs(counts / n - probs / probs.sum()).sum(axis=1)
    return float(np.quantile(tvs, level))
