"""What one target pass costs on a backend: c(n), in units of a one-position pass.

A pass over rows of widths w_1..w_R computes n = w_1 + ... + w_R new positions. On a processor
whose pass is bound by reading the weights (one row, few positions), n positions cost little more
than one; where the pass is bound by arithmetic they cost up to n times one. The drafters choose
block lengths from c (`smc_sd.engine.free_drafts.best_block_length`), so c decides where
speculating pays: it never changes a method's law, only how many tokens a pass proposes.

c is a piecewise-linear interpolation of measured points (n, c(n)) with c(0) = 0 and c(1) = 1,
continued past the last point at its last slope. The tables are measurements of the default
model (`benchmarks/forward_cost.py`, FACTS.md), one per kind of pass:

- float32 on a CPU: an AMD EPYC (AVX2, no AVX-512), the costlier of the two processors this
  project runs on: 1x5 positions 1.8 one-position passes, 4x5 3.2, 16x5 6.1. It is the default
  for every CPU pass in float32 (on an Intel Sapphire Rapids the same passes cost 1.6, 2.4, 5.1:
  the table errs on the side of proposing less).
- bfloat16 on a CPU that multiplies it natively (AMX): 1x5 1.10, 4x5 1.42, 8x5 1.87, 16x5 2.36.
- a CUDA GPU (an 8B-shaped model on an H200, eager): 8x9 positions 1.46 one-position passes.

A constant table keeps block lengths a function of the run's past alone, so a seed gives the
same sample in every run on every machine with the same table; a measured-per-process curve
would not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PassCost:
    """c(n) by linear interpolation of `points` (module docstring).

    Attributes:
        name: what the table measures (reported with the block lengths it chose).
        points: (n, c(n)) pairs, n strictly increasing from 1 with c(1) = 1, c non-decreasing.

    Raises:
        ValueError: for points that do not start at (1, 1.0) or do not increase.
    """

    name: str
    points: tuple[tuple[int, float], ...]

    def __post_init__(self):
        if not self.points or self.points[0] != (1, 1.0):
            raise ValueError(f"pass cost {self.name!r}: points must start at (1, 1.0), got {self.points[:1]}")
        for (n0, c0), (n1, c1) in zip(self.points, self.points[1:]):
            if not (n1 > n0 and c1 >= c0):
                raise ValueError(f"pass cost {self.name!r}: points must increase in n and not decrease in cost, got {(n0, c0)} then {(n1, c1)}")

    def __call__(self, n: int) -> float:
        """c(n) for n >= 0 positions: 0 for no pass, 1 for one position."""
        if n <= 0:
            return 0.0
        if n <= 1:
            return float(n)
        for (n0, c0), (n1, c1) in zip(self.points, self.points[1:]):
            if n <= n1:
                return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        if len(self.points) == 1:
            return 1.0
        (n0, c0), (n1, c1) = self.points[-2:]
        return c1 + (c1 - c0) * (n - n1) / (n1 - n0)

    def to_json(self) -> dict:
        """The table, as `--json` and the server report it."""
        return {"name": self.name, "points": [list(p) for p in self.points]}


CPU_FLOAT32 = PassCost("cpu float32 (AMD EPYC, AVX2)", ((1, 1.0), (5, 1.8), (20, 3.2), (80, 6.1)))
CPU_BFLOAT16_NATIVE = PassCost("cpu bfloat16 (AMX)", ((1, 1.0), (5, 1.10), (20, 1.42), (40, 1.87), (80, 2.36)))
CUDA = PassCost("cuda (H200, 8B-shaped, eager)", ((1, 1.0), (72, 1.46), (576, 1.6)))


def pass_cost_for(device_type: str, dtype_name: str) -> PassCost:
    """The table for a pass on `device_type` ("cpu", "cuda") in `dtype_name` ("float32", ...).

    bfloat16 on a CPU is chosen (`--dtype auto`) only where the processor multiplies it natively;
    every other CPU pass takes the float32 table, which is the costlier one.
    """
    if device_type == "cuda":
        return CUDA
    if device_type == "cpu" and dtype_name == "bfloat16":
        return CPU_BFLOAT16_NATIVE
    return CPU_FLOAT32
