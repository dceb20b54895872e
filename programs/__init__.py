"""The standard decoding programs, each written in the DSL a user would use.

Installed as `smc_sd.programs`. `get(name)` returns a program module; every module defines
`program(...) -> Program` and `DEFAULT_PARTICLES`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

MODULES = {
    "ar": "autoregressive",
    "sd": "speculative",
    "smc-sd": "smc_speculative",
    "mask-at-verify": "mask_at_verify",
}


def get(name: str) -> ModuleType:
    """The program module registered under `name` ("ar", "sd", "smc-sd", ...)."""
    if name not in MODULES:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(MODULES)}")
    return importlib.import_module(f"{__name__}.{MODULES[name]}")
