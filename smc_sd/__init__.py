"""smc-sd: speculative decoding as sequential Monte Carlo, written as small decoding programs.

The names below load with their modules at first use (`from smc_sd import Program` imports
torch then), so that `smc-sd --help` and other commands that run no program start at once.
"""

import importlib

# exported name -> the module that defines it
_EXPORTS = {
    "AllParticlesDiedError": "smc_sd.engine",
    "Result": "smc_sd.engine",
    "FreeDraft": "smc_sd.program",
    "Program": "smc_sd.program",
    "Proposal": "smc_sd.program",
    "Schedule": "smc_sd.program",
    "Target": "smc_sd.program",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'smc_sd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
