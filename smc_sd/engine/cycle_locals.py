"""What a running engine cycle lends the functions it calls, per thread.

The engine's cycle reaches functions many calls deep (a draft's draw, a block's scores) that
take tensors, not the engine. Two things of the engine's reach them here instead of through
every signature: its scratch blocks (`smc_sd.engine.scratch`) and its kernels, eager or
compiled (`smc_sd.engine.kernels`). `lending` makes them the thread's for a block (the engine's
`step` and `admit`); `lent` reads one, None outside a cycle, where those functions fall back to
fresh memory and eager kernels. Lending nests: an inner block restores the outer one's values.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_LOCAL = threading.local()


@contextmanager
def lending(**values):
    """Make these values the thread's (read by `lent`) for the block's duration."""
    previous = {name: getattr(_LOCAL, name, None) for name in values}
    for name, value in values.items():
        setattr(_LOCAL, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(_LOCAL, name, value)


def lent(name: str):
    """The value lent under this name in this thread, or None."""
    return getattr(_LOCAL, name, None)
