"""The SMC loop: particle state, weights, resampling, log Z_hat, results and diagnostics.

Dimension letters used in every shape comment of the library:

- N: particles
- K: draft block length (tokens proposed per particle per cycle)
- V: vocabulary size (rows of the logits)
- S: tokens generated so far per particle
- B, L: rows and new tokens of one backend call
- M: particle slots of the batched engine (`smc_sd.engine.slots`), G: its running requests
"""

from smc_sd.engine.resampling import RESAMPLERS, effective_sample_size, resample
from smc_sd.engine.result import AllParticlesDiedError, CycleStats, Result

__all__ = [
    "RESAMPLERS",
    "AllParticlesDiedError",
    "CycleStats",
    "Result",
    "effective_sample_size",
    "resample",
]
