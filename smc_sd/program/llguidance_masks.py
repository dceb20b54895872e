"""Exact next-token masks of an llguidance grammar over one LM's tokens.

For a generated prefix x (token ids, EOS excluded) the mask is the `TokenConstraint` contract:

    mask[v]   = 1  iff  bytes(x) + bytes(v) can still be completed inside the language   (v != EOS)
    mask[EOS] = 1  iff  bytes(x) is a complete string of the language,

computed by llguidance from its parser state after x. Special tokens other than EOS, and logit
rows past the tokenizer's length, are never allowed.

Every grammar is compiled with llguidance's `no_forcing` option (`without_forcing`). By default,
where the grammar forces the next bytes, llguidance tokenizes them canonically and masks to the
first of those tokens alone: after `{"` under a schema whose only key is `name_of_the_person`,
SmolLM2's mask holds `name` but not `n`, `na` or `nam`, which spell the same bytes in more tokens.
Such a mask cuts token sequences the target gives mass to. Without forcing, llguidance walks the
token trie from the parser state (forced bytes included), so the mask is the set above: every
token whose bytes keep the string completable, whatever tokenization it starts.

Matcher states live in a pool keyed by prefix tuple and shared by genealogy: the state of a new
prefix is a `deep_copy` of the state of its longest pooled prefix, advanced by `consume_tokens`
over the tokens in between (usually one). Resampling and forking therefore need nothing from the
engine: copies of a particle ask for the same prefix, and a rolled-back prefix (exact SD's
rejection) finds its state still pooled. Every `WINDOW` calls the states not asked for in the
last `WINDOW` calls are dropped; a prefix whose ancestors were all dropped is rebuilt from the
empty prefix, which costs time only.

The masks of a batch come from one `fill_next_token_bitmask_par` call (one row per distinct
prefix) where the machine has `PARALLEL_MIN_CPUS` cores or more; below that, one
`fill_next_token_bitmask` per row, since handing rows to llguidance's thread pool costs more than
it saves (measured on 2 shared cores: 187 µs for 4 JSON-schema rows in one parallel call, 44 µs
in four plain calls). The int32 bit words are unpacked to bool with numpy, without a loop over
tokens.
"""

from __future__ import annotations

import json
import os
import weakref

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

from smc_sd.program.constraints import TokenConstraint

#: calls after which a matcher state nobody asked for leaves the pool
WINDOW = 32
#: cores from which a batch's masks go to llguidance's thread pool in one call
PARALLEL_MIN_CPUS = 4
# read once: os.cpu_count() costs tens of microseconds per call
_PARALLEL = (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS

# per LM: (its llguidance tokenizer, [V] bool tokens a mask may ever allow)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EXECUTOR: list = []


def executor() -> llguidance.LLExecutor:
    """The process's llguidance executor (llguidance's default thread count), made once."""
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor())
    return _EXECUTOR[0]


def lm_tokenizer(lm) -> tuple[llguidance.LLTokenizer, torch.Tensor]:
    """The llguidance tokenizer of an LM and its [V] bool allowed-token row, made once per LM.

    A transformers tokenizer goes through `llguidance.hf.from_tokenizer` (about 0.5 s for
    49,152 tokens); a model without one (toy LMs) is described by the UTF-8 bytes of
    `lm.decode([t])` with EOS as its only special token.
    """
    if lm not in _TOKENIZERS:
        size, eos = lm.vocabulary.size, lm.vocabulary.eos_token_id
        allowed = torch.zeros(size, dtype=torch.bool)
        if lm.tokenizer is None:
            tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ToyVocabulary(lm)))
            allowed[:] = True
        else:
            tokenizer = llguidance.hf.from_tokenizer(lm.tokenizer)
            allowed[: min(size, len(lm.tokenizer))] = True
            special = [t for t in lm.tokenizer.all_special_ids if t < size]
            special += [t for t, added in lm.tokenizer.added_tokens_decoder.items() if added.special and t < size]
            allowed[special] = False
        allowed[eos] = True
        _TOKENIZERS[lm] = (tokenizer, allowed)
    return _TOKENIZERS[lm]


class _ToyVocabulary:
    """A model's tokens as byte strings, in the shape `llguidance.TokenizerWrapper` reads."""

    def __init__(self, lm):
        self.eos_token_id, self.bos_token_id = lm.vocabulary.eos_token_id, None
        self.special_token_ids = [self.eos_token_id]
        self.tokens = [b"<eos>" if t == self.eos_token_id else lm.decode([t]).encode() for t in range(lm.vocabulary.size)]
        self._ids = {data: t for t, data in enumerate(self.tokens) if t != self.eos_token_id}
        self._longest = max(len(data) for data in self._ids)

    def __call__(self, text: bytes | str) -> list[int]:
        """Greedy longest-match tokenization (llguidance's `compute_ff_tokens` and
        `tokenize_bytes` ask for it; masks do not); a byte no token starts with is skipped."""
        text = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(text):
            n = next((n for n in range(min(self._longest, len(text) - i), 0, -1) if text[i : i + n] in self._ids), 0)
            if n:
                out.append(self._ids[text[i : i + n]])
            i += max(n, 1)
        return out


#: the grammar option that keeps llguidance from masking forced bytes to one tokenization
NO_FORCING = '%llguidance {"no_forcing": true}\n'


def without_forcing(grammar: str) -> str:
    """An llguidance grammar with the `no_forcing` option set (module docstring).

    The option is one for the whole grammar (llguidance's lexer takes it from any of a grammar's
    parts), so it is set on the first part: Lark text gets the `%llguidance` line; a JSON
    schema becomes the Lark rule `start: %json <schema>`, the same JSON grammar (its compile
    options travel in the schema's "x-guidance").

    Args:
        grammar: Lark text, or llguidance's JSON form {"grammars": [{"lark_grammar" | "json_schema": ...}, ...]}.

    Raises:
        ValueError: for a JSON form whose first part is neither.
    """
    if not grammar.lstrip().startswith("{"):
        return NO_FORCING + grammar
    top = json.loads(grammar)
    first = top["grammars"][0]
    if first.get("lark_grammar") is not None:
        first["lark_grammar"] = NO_FORCING + first["lark_grammar"]
    elif first.get("json_schema") is not None:
        first["lark_grammar"] = NO_FORCING + "start: %json " + json.dumps(first.pop("json_schema"))
    else:
        raise ValueError(f"an llguidance grammar's first part must be Lark or a JSON schema, got keys {sorted(first)}")
    return json.dumps(top)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bit masks to bool masks.

    Args:
        bitmask: [B, W] int32, token 32 w + i allowed iff bit i of word w is set.
        vocab_size: V; columns past 32 W are False.

    Returns:
        [B, V] bool.
    """
    # [B, 4 W] uint8 in little-endian order, so bit j of byte c is token 8 c + j
    data = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    # [B, 32 W] bool (unpackbits writes 0/1 bytes, valid bools)
    bits = torch.from_numpy(np.unpackbits(data, axis=1, bitorder="little")).view(torch.bool)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    out = torch.zeros(bitmask.shape[0], vocab_size, dtype=torch.bool)
    out[:, : bits.shape[1]] = bits
    return out


class GrammarConstraint(TokenConstraint):
    """An llguidance grammar as exact token masks of one LM (module docstring).

    Args:
        grammar: an llguidance grammar (from `LLMatcher.grammar_from_*`).
        lm: the model whose tokens are masked.
        description: what the grammar is, for error messages.
        exact_check: None when the grammar is exactly its source's language; else bytes -> bool,
            the exact test of complete strings (the compiler makes it phi at completion).

    Raises:
        ValueError: when llguidance refuses the grammar for this tokenizer.
    """

    def __init__(self, grammar: str, lm, description: str = "grammar", exact_check=None):
        self.vocab_size, self.exact_check = lm.vocabulary.size, exact_check
        self._tokenizer, allowed = lm_tokenizer(lm)
        # [W] int32: the allowed-token row as bit words over the tokenizer's ids
        width = llguidance.torch.get_bitmask_shape(1, self._tokenizer.vocab_size)[1]
        bits = np.zeros(32 * width, dtype=bool)
        bits[: min(self.vocab_size, 32 * width)] = allowed.numpy()[: 32 * width]
        self._allowed_words = torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").astype(np.int32))
        root = llguidance.LLMatcher(self._tokenizer, without_forcing(grammar), log_level=0)
        if root.is_error():
            raise ValueError(f"invalid {description}: {root.get_error().splitlines()[0]}")
        # prefix -> [matcher state after it, the call that last asked for it]
        self._pool: dict[tuple[int, ...], list] = {(): [root, 0]}
        self.calls = 0

    def _state(self, prefix: tuple[int, ...]) -> llguidance.LLMatcher:
        entry = self._pool.get(prefix)
        if entry is None:
            known = next(n for n in range(len(prefix) - 1, -1, -1) if prefix[:n] in self._pool)
            self._pool[prefix[:known]][1] = self.calls
            matcher = self._pool[prefix[:known]][0].deep_copy()
            # a token the grammar refuses leaves the matcher in its error state: a dead prefix
            matcher.consume_tokens(list(prefix[known:]))
            entry = self._pool[prefix] = [matcher, self.calls]
        entry[1] = self.calls
        return entry[0]

    def _prune(self) -> None:
        # every WINDOW calls, so a state lives between WINDOW and 2 WINDOW calls unasked
        if self.calls % WINDOW:
            return
        stale = [p for p, (_, last) in self._pool.items() if p and last < self.calls - WINDOW]
        for prefix in stale:
            del self._pool[prefix]

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        self.calls += 1
        keys = [tuple(p) for p in prefixes]
        # one row per distinct prefix: copies of a resampled particle share their state
        rows = {key: i for i, key in enumerate(dict.fromkeys(keys))}
        states = [self._state(key) for key in rows]
        # [U, W] int32, all zero (nothing allowed) for dead prefixes
        bitmask = torch.zeros(llguidance.torch.get_bitmask_shape(len(states), self._tokenizer.vocab_size), dtype=torch.int32)
        live = [(state, i) for i, state in enumerate(states) if not state.is_error()]
        if len(live) > 1 and _PARALLEL:
            llguidance.torch.fill_next_token_bitmask_par(executor(), live, bitmask)
        else:
            for state, i in live:
                llguidance.torch.fill_next_token_bitmask(state, bitmask, i)
        self._prune()
        # special tokens and ids past the model's rows are never allowed: cleared in the bit words
        bitmask &= self._allowed_words
        # [U, V] bool, then [B, V] bool in the order asked
        masks = unpack_bitmask(bitmask, self.vocab_size)
        return masks if len(rows) == len(keys) else masks[[rows[key] for key in keys]]

    def forced_tokens(self, prefix: list[int]) -> list[int]:
        """The tokenizer's tokenization of the bytes every completion of the prefix starts with
        (llguidance's forced bytes; [] for a dead prefix). Its last token may merge with later
        text in the canonical tokenization; as a draft that costs a rejection at most. Other
        tokenizations of those bytes stay allowed by `mask`."""
        state = self._state(tuple(prefix))
        if state.is_error():
            return []
        forced = state.compute_ff_bytes()
        return list(self._tokenizer.tokenize_bytes(forced)) if forced else []
