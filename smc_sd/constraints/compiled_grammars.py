"""Compiled llguidance grammars, kept by content in a bounded least-recently-used table.

Compiling a grammar for a tokenizer (`llguidance.LLMatcher(tokenizer, grammar)`) costs about
8 ms for a small JSON schema over a 49,152-token vocabulary; a copy of the compiled matcher
(`deep_copy`) costs about 0.5 µs. So the matcher of a grammar before any token, its *root*, is
compiled once per (grammar text, tokenizer) and every user of the grammar walks a copy: two
constraints of equal text (the same schema sent by two requests, built as two objects) share a
root, and a root is never advanced.

The key is the grammar's text as llguidance reads it, which carries the source (schema, Lark
grammar or regex) and every compile option (the JSON layout, `lenient`, `no_forcing`), and the
`llguidance.LLTokenizer` it is compiled for (made once per language model, kept alive by the
entries that name it). Nothing else a caller made is held: a constraint, its matcher states and
its mask rows belong to the caller and are freed with it.

Bound: `MAX_GRAMMARS` roots, the least recently used leaving first. A root is about 17 KB after
compiling (200 roots of small schemas over SmolLM2's tokenizer took 3.4 MB) and grows with the
lexer states its copies build. 128 roots hold the working set of a deployment that sends a few
dozen schemas (a schema used through its genlm-control potential has two roots, the byte-level
one of `GrammarPotential` and the target's; the server's has one), and they fill within the
first 128 distinct grammars, so a stream of distinct schemas costs a fixed few MB.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

import llguidance

from smc_sd.constraints.languages import one_line

#: compiled grammar roots kept (module docstring)
MAX_GRAMMARS = 128


class LRUCache:
    """A thread-safe table of at most `maxsize` values, the least recently used evicted first.

    Args:
        maxsize: entries kept, >= 1.

    Attributes:
        misses: values made so far (a key asked for again after leaving is made again).
    """

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.misses = 0
        self._values: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], object]) -> object:
        """The value of `key`, made by `make()` when absent (outside the lock: two threads may
        both make it, one value is kept). An exception from `make` propagates and keeps nothing."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = make()
        with self._lock:
            self.misses += 1
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.maxsize:
                self._values.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


#: (grammar text, llguidance tokenizer) -> the grammar's root matcher
ROOTS = LRUCache(MAX_GRAMMARS)


def root_matcher(grammar: str, tokenizer: llguidance.LLTokenizer, description: str) -> llguidance.LLMatcher:
    """The compiled matcher of `grammar` over `tokenizer` before any token, shared: never advance
    it, walk a `deep_copy`.

    Args:
        grammar: an llguidance grammar (text `LLMatcher` accepts), options included.
        tokenizer: the tokenizer it is compiled for.
        description: what the grammar is, for the error message ("JSON schema").

    Raises:
        ValueError: "invalid <description>: <llguidance's error in one line>" (nothing is kept).
    """

    def compile_root() -> llguidance.LLMatcher:
        root = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if root.is_error():
            raise ValueError(f"invalid {description}: {one_line(root.get_error())}")
        return root

    return ROOTS.get((grammar, tokenizer), compile_root)
