"""Random numbers keyed by what they are for: a counter-based generator.

Every uniform the batched step draws is a pure function of its key, (request seed, counter) with
the counter packing (cycle, particle, position, stream): u = H(key) for one fixed hash H. A request therefore draws
the same numbers alone or among any others, in any order and on any device, and one call draws
them for every row of every running request at once (no generator object per request, no
order of calls to keep).

H folds the key's four 32-bit halves, one after another, into a 32-bit state with a bijective
integer mixer (xor-shift and multiply rounds, a bijection of the 32-bit integers with full
avalanche); one more round from that state gives a second 32-bit word, and the two give the 53
bits of a float64 in [0, 1). The seed's two halves come first, so their fold is a request's key,
computed once in Python (`seed_key`); each draw folds the counter's two halves from there.
Every product is formed from 16-bit halves, so no int64 operation overflows and the values are
the same on every backend and device.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
#: the fold's starting state, and the word that separates the second hash from the first
START, SECOND = 0x243F6A88, 0x85A308D3
#: the mixer's multipliers
MULTIPLIERS = (0x7FEB352D, 0x846CA68B)

#: stream words: what a uniform is for, so that two uses at one (seed, cycle, particle,
#: position) draw independent numbers
BONUS = 1
RESAMPLE = 2
DRAFT = 3
ACCEPT = 4

#: bits of each field of a counter, most significant first: cycle, particle, position, stream
COUNTER_BITS = (23, 20, 12, 8)


def seed_key(seed: int) -> int:
    """A request's key: the state of H after folding its seed (taken mod 2^63), in [0, 2^32)."""
    word, state = seed % (1 << 63), START
    for half in (word & MASK32, (word >> 32) & MASK32):
        state = _mix32(state ^ half)
    return state


def _mul32(x, c: int):
    """(x * c) mod 2^32 for x in [0, 2^32) (an int64 tensor or an int), from c's 16-bit halves
    (no overflow)."""
    high, low = c >> 16, c & 0xFFFF
    return ((((x * high) & 0xFFFF) << 16) + x * low) & MASK32


def _mix32(x):
    """A bijection of [0, 2^32) with full avalanche: x ^= x >> 16; x *= c1; x ^= x >> 15;
    x *= c2; x ^= x >> 16 (all mod 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, MULTIPLIERS[1])
    return x ^ (x >> 16)


def counter(cycle, particle, position, stream: int) -> torch.Tensor:
    """The counter word of a draw: (cycle, particle, position, stream) packed into 63 bits.

    Args:
        cycle: int or int64 tensor in [0, 2^23): the request's cycle.
        particle: in [0, 2^20): the particle's index within its request.
        position: in [0, 2^12): the position within the particle's block.
        stream: in [0, 2^8): what the number is for (BONUS, RESAMPLE, ...).
    """
    _, p, q, r = COUNTER_BITS
    word = torch.as_tensor(cycle, dtype=torch.int64) << (p + q + r)
    return word | (torch.as_tensor(particle, dtype=torch.int64) << (q + r)) | (torch.as_tensor(position, dtype=torch.int64) << r) | stream


def keyed_uniform(key: torch.Tensor | int, count: torch.Tensor) -> torch.Tensor:
    """Uniforms on [0, 1), one per element of the broadcast (key, count).

    Args:
        key: int64 tensor or int in [0, 2^32): the request's key (`seed_key` of its seed).
        count: int64 tensor of `counter` words.

    Returns:
        float64 tensor of the broadcast shape: u = (a · 2^26 + b) / 2^53 with a and b the top
        27 and 26 bits of the two 32-bit hashes of (seed, count).
    """
    state, count = torch.broadcast_tensors(torch.as_tensor(key, dtype=torch.int64), count.to(torch.int64))
    for half in (count & MASK32, (count >> 32) & MASK32):
        state = _mix32(state ^ half)
    second = _mix32(state ^ SECOND)
    return ((state >> 5) * (1 << 26) + (second >> 6)).double() / float(1 << 53)


def keyed_uniforms(key: torch.Tensor, cycle, particle, position, stream: int) -> torch.Tensor:
    """keyed_uniform(key, counter(cycle, particle, position, stream)): a draw's uniforms in one
    call, which the engine's compiled step runs as one fused loop (`smc_sd.engine.kernels`)."""
    return keyed_uniform(key, counter(cycle, particle, position, stream))
