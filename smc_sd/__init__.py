"""smc-sd: speculative decoding as sequential Monte Carlo, written as small decoding programs.

The names below load with their modules at first use (`from smc_sd import Program` imports
torch then), so that `smc-sd --help` and other commands that run no program start at once.
"""

import importlib

from smc_sd.host_memory import prefer_huge_pages

# before torch's first CPU allocation, which reads the setting (smc_sd.host_memory)
prefer_huge_pages()

# exported name -> the module that defines it. A tutorial or user program needs nothing else:
# - a program and its parts: Program, Target, Proposal, FreeDraft, Schedule (`smc_sd.program`);
# - your own factors of the target: TokenConstraint (a 0/1 potential asked for next-token masks),
#   PredicateConstraint (one from two predicates on token tuples, for toy vocabularies),
#   BlockPotential and FunctionPotential (a positive score on whole prefixes, kept in the
#   weights), token_bytes (the byte string of every token id, to write either over bytes);
# - many requests in one batch: BatchEngine (one target pass per cycle over every running
#   request's particles), Request (a prompt, a program, a schedule and a seed), Handle;
# - what a run returns: Result (particles, weights, log_ml, ess, cycles, ...), CycleStats (one
#   cycle's ESS, resampling, log Z), and the errors a run raises.
_EXPORTS = {
    "AllParticlesDiedError": "smc_sd.engine",
    "BatchEngine": "smc_sd.engine.batch",
    "BlockPotential": "smc_sd.constraints.scores",
    "CycleStats": "smc_sd.engine",
    "FreeDraft": "smc_sd.program",
    "FunctionPotential": "smc_sd.constraints.scores",
    "Handle": "smc_sd.engine.requests",
    "IncompleteResultWarning": "smc_sd.engine.result",
    "PredicateConstraint": "smc_sd.constraints.token_constraints",
    "Program": "smc_sd.program",
    "Proposal": "smc_sd.program",
    "Request": "smc_sd.engine.requests",
    "Result": "smc_sd.engine",
    "Schedule": "smc_sd.program",
    "Target": "smc_sd.program",
    "TokenConstraint": "smc_sd.constraints.token_constraints",
    "UnsatisfiableConstraintError": "smc_sd.constraints.token_constraints",
    "token_bytes": "smc_sd.constraints.byte_vocabulary",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'smc_sd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
