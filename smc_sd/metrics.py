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
