"""Token masks of a boolean genlm-control potential over bytes: the generic path, batched.

A boolean byte potential phi (log phi in {0, -inf}) has a prefix test that is closed under
prefixes: genlm-control's contract makes prefix(s) = 0 iff s is a prefix of a string of the
language. The mask of a generated prefix x_1..x_t with bytes d = bytes(x_1) + ... + bytes(x_t) is
therefore, token by token,

    mask[v]   = [prefix(d + bytes(v)) = 0]    (every token v with non-empty bytes; others 0)
    mask[EOS] = [complete(d) = 0]
    mask      = 0 everywhere when prefix(d) = -inf,

the set a walk of the vocabulary's byte trie with `logw_next` finds (a byte is live iff the
prefix it extends to is), asked as one `batch_prefix` over every new row and every token: one
call per mask call, not one per trie node. A potential that defines `batch_prefix` (or
`batch_complete`) answers the whole batch at once; for one that defines only `prefix`, each
context's coroutine is run to its end directly (no event-loop task per context), falling back to
the loop when it awaits something.

Masks are cached by content: per (potential, LM) while both live, a bounded table from the bytes
d to the mask row (a row asked again, in this run or a later one, costs a lookup), and per
constraint a bounded table from token prefixes to their bytes (a row's bytes are its parent's
plus one token's, not re-joined).

Cost: V contexts per new prefix (49,152 on the default model), each a `prefix` call on
len(d) + |bytes(v)| bytes; the constraint's own work is one bytes concatenation per context.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict

import numpy as np
import torch

from smc_sd.constraints.byte_vocabulary import vocabulary_trie

#: rows kept per (potential, LM) (49,152 bools each on the default model: about 25 MB)
MASK_ROWS = 512
#: token prefixes whose bytes a constraint keeps
PREFIX_BYTES = 4096
#: contexts per batch_prefix call at most (bounds the memory of one call)
CONTEXTS_PER_CALL = 1 << 18

# per byte potential, per LM: its mask rows by byte prefix (`mask_table`)
_BYTE_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class BoundedTable(OrderedDict):
    """A dict that forgets its least recently used entries beyond `size`."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_recent(self, key):
        """The value of `key` (marked as recently used), or None."""
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def mask_table(potential, lm) -> BoundedTable:
    """The mask rows of a byte potential's prefixes over `lm`'s tokens, shared by every lowering
    of the pair while both live; a potential that cannot be a weak key (it defines `__eq__`
    without `__hash__`, as a dataclass does) gets a table of its own lowering."""
    try:
        per_lm = _BYTE_MASKS.setdefault(potential, weakref.WeakKeyDictionary())
        return per_lm.setdefault(lm, BoundedTable(MASK_ROWS))
    except TypeError:
        return BoundedTable(MASK_ROWS)


def overrides(potential, method: str) -> bool:
    """Whether the potential's class defines its own `method` (genlm-control's default batched
    methods gather one task per context)."""
    from genlm.control.potential import Potential

    return getattr(type(potential), method) is not getattr(Potential, method)


class PotentialCalls:
    """A boolean byte potential's `prefix` and `complete` over lists of contexts, one batched call
    each where the potential defines one (module docstring)."""

    def __init__(self, potential):
        self.potential = potential
        self._loop = asyncio.new_event_loop()

    def live(self, method: str, contexts: list[bytes]) -> np.ndarray:
        """[C] bool: log phi > -inf for each context under `method` ("prefix" or "complete")."""
        if overrides(self.potential, f"batch_{method}"):
            logw = self._loop.run_until_complete(getattr(self.potential, f"batch_{method}")(contexts))
            return np.asarray(logw, dtype=np.float64) > float("-inf")
        one, logw = getattr(self.potential, method), []
        for context in contexts:
            # a coroutine that awaits nothing ends at its first send, its value in StopIteration
            coroutine = one(context)
            try:
                coroutine.send(None)
            except StopIteration as finished:
                logw.append(finished.value)
                continue
            # it awaited something: run it again on the loop (a potential is a function of its context)
            coroutine.close()
            logw.append(self._loop.run_until_complete(one(context)))
        return np.array(logw, dtype=np.float64) > float("-inf")


class SpelledVocabulary:
    """The tokens of an LM that have bytes: ids [T] int64 and their bytes, and every token's
    bytes (None for special tokens) for joining prefixes."""

    def __init__(self, lm):
        self.bytes_of = vocabulary_trie(lm)[0]
        spelled = [(t, b) for t, b in enumerate(self.bytes_of) if b]
        self.ids = torch.tensor([t for t, _ in spelled], dtype=torch.long)
        self.spellings = [b for _, b in spelled]


def batched_masks(calls: PotentialCalls, vocabulary: SpelledVocabulary, datas: list[bytes], vocab_size: int, eos: int) -> list[torch.Tensor]:
    """The [V] bool mask rows of byte prefixes `datas` (module docstring), in as few batched
    calls as the bound on contexts per call allows."""
    rows = [torch.zeros(vocab_size, dtype=torch.bool) for _ in datas]
    heads = calls.live("prefix", datas)
    live = [i for i in range(len(datas)) if heads[i]]
    if not live:
        return rows
    ends = calls.live("complete", [datas[i] for i in live])
    per_call = max(1, CONTEXTS_PER_CALL // len(vocabulary.spellings))
    for start in range(0, len(live), per_call):
        chunk = live[start : start + per_call]
        contexts = [datas[i] + s for i in chunk for s in vocabulary.spellings]
        # [len(chunk), T] bool: each row's tokens, in the order of vocabulary.ids
        allowed = torch.from_numpy(calls.live("prefix", contexts)).view(len(chunk), -1)
        for k, i in enumerate(chunk):
            rows[i][vocabulary.ids] = allowed[k]
    for i, end in zip(live, ends):
        rows[i][eos] = bool(end)
    return rows
