"""smc-sd: speculative decoding as sequential Monte Carlo, written as small decoding programs."""

from smc_sd.engine import AllParticlesDiedError, Result
from smc_sd.program import FreeDraft, Program, Proposal, Schedule, Target

__all__ = ["AllParticlesDiedError", "FreeDraft", "Program", "Proposal", "Result", "Schedule", "Target"]
__version__ = "0.1.0"
