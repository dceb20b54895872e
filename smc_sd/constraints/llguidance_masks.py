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

The grammar is compiled once per (grammar text, tokenizer) and shared by every constraint of
equal text (`smc_sd.constraints.compiled_grammars`); each constraint walks its own copy. Matcher
states live in the constraint's `MatcherPool`, shared by genealogy: a prefix's state is its
parent's matcher walked on in place, or a rolled-back copy where lines fork
(`smc_sd.constraints.matcher_pool`). States and mask rows belong to the constraint and are freed
with it: a program lowers its constraints afresh for every run.

A mask is computed as llguidance's int32 bit words (one `unsafe_compute_mask_ptr` per distinct
prefix into a buffer kept between calls, or one parallel call over every row where the machine
has `PARALLEL_MIN_CPUS` cores or more: handing rows to llguidance's thread pool costs more than
it saves on fewer, measured on 2 shared cores: 187 µs for 4 JSON-schema rows in one parallel
call, 44 µs in four plain calls). The words then key a table of the bool rows already unpacked:
along a JSON answer 66-88% of the positions repeat a mask seen earlier in the same answer
(inside a string, after a key, ...), so most calls unpack nothing and return a cached row. On a
CPU every numpy or torch call right after a model pass costs tens of microseconds (the pass has
evicted the caches), so a mask call makes as few of them as it can.
"""

from __future__ import annotations

import json
import os
import weakref

import llguidance
import llguidance.hf
import numpy as np
import torch

from smc_sd.constraints.compiled_grammars import root_matcher
from smc_sd.constraints.token_constraints import TokenConstraint, stack_rows
from smc_sd.constraints.matcher_pool import MatcherPool

#: distinct masks kept (as bools, 6 KiB of words and 48 KiB of bools each at V = 49,152)
MAX_ROWS = 256
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
    # [B, V] 0/1 bytes, valid bools (unpackbits pads with zeros past 32 W)
    return torch.from_numpy(np.unpackbits(data, axis=1, count=vocab_size, bitorder="little")).view(torch.bool)


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
        # llguidance writes W words per row, W = ceil(tokenizer size / 32)
        self._width = (self._tokenizer.vocab_size + 31) // 32
        # [W] int32: the allowed-token row as bit words over the tokenizer's ids
        bits = np.zeros(32 * self._width, dtype=bool)
        bits[: min(self.vocab_size, 32 * self._width)] = allowed.numpy()[: 32 * self._width]
        self._allowed_words = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
        # the shared compiled root is never advanced: the pool walks a copy
        self._states = MatcherPool(root_matcher(without_forcing(grammar), self._tokenizer, description).deep_copy())
        # llguidance's bit words (b"" for a dead prefix) -> (mask [1, V] bool, allows no token)
        self._rows: dict[bytes, tuple[torch.Tensor, bool]] = {}
        # [rows, W] int32 that llguidance writes into, as bytes, and its address
        self._buffer, self._address = memoryview(b""), 0

    def _words(self, keys) -> list[bytes]:
        """llguidance's bit words of the mask after each prefix, as bytes (b"" for a dead one)."""
        size = 4 * self._width
        if len(keys) * size > len(self._buffer):
            self._buffer = memoryview(np.zeros((len(keys), self._width), dtype=np.int32)).cast("B")
            self._address = np.frombuffer(self._buffer, dtype=np.uint8).ctypes.data
        parallel = len(keys) > 1 and _PARALLEL
        # a state is read before the next prefix is asked for (that may walk its line on)
        live = []
        for i, key in enumerate(keys):
            state = self._states.state(key)
            if state is None:
                continue
            if parallel:
                # llguidance's threads read every state at once: copies
                live.append((state.deep_copy(), i))
            else:
                state.unsafe_compute_mask_ptr(self._address + i * size, size)
                live.append((state, i))
        if parallel and live:
            executor().unsafe_compute_mask_ptr(live, self._address, size, len(keys))
        words = [b""] * len(keys)
        for _, i in live:
            words[i] = bytes(self._buffer[i * size : (i + 1) * size])
        return words

    def _cache_rows(self, words: list[bytes]) -> None:
        """Unpack the bit words not seen before, in one batch, into `_rows`."""
        new = [w for w in words if w not in self._rows]
        if not new:
            return
        new = list(dict.fromkeys(new))
        if len(self._rows) + len(new) > MAX_ROWS:
            # full: start again with this call's masks
            self._rows.clear()
            new = list(dict.fromkeys(words))
        # [M, W] int32; special tokens and ids past the model's rows are never allowed
        zero = bytes(4 * self._width)
        bits = np.frombuffer(b"".join(w or zero for w in new), dtype=np.int32).reshape(len(new), self._width) & self._allowed_words
        masks = unpack_bitmask(torch.from_numpy(bits), self.vocab_size).split(1)
        for w, mask, allowed in zip(new, masks, bits.any(1).tolist()):
            self._rows[w] = (mask, not allowed)

    def mask_rows(self, prefixes: list[list[int]]) -> tuple[list[torch.Tensor], list[bool]]:
        """Masks after each prefix, one [1, V] row each, and whether each allows no token.

        Equal masks are one tensor, kept between calls (`MAX_ROWS` of them): most positions of
        a grammar repeat a mask seen before, so the unpacking runs for new masks only.
        """
        self._states.tick()
        keys = [tuple(p) for p in prefixes]
        # one fill per distinct prefix: copies of a resampled particle share their state
        distinct = list(dict.fromkeys(keys)) if len(keys) > 1 else keys
        words = self._words(distinct)
        self._cache_rows(words)
        rows = [self._rows[w] for w in words]
        if len(distinct) < len(keys):
            row_of = dict(zip(distinct, rows))
            rows = [row_of[key] for key in keys]
        return [mask for mask, _ in rows], [dead for _, dead in rows]

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        return stack_rows(self.mask_rows(prefixes)[0])

    def forced_tokens(self, prefix: list[int]) -> list[int]:
        """The tokenizer's tokenization of the bytes every completion of the prefix starts with
        (llguidance's forced bytes; [] for a dead prefix). Its last token may merge with later
        text in the canonical tokenization; as a draft that costs a rejection at most. Other
        tokenizations of those bytes stay allowed by `mask`."""
        state = self._states.state(tuple(prefix))
        if state is None:
            return []
        forced = state.compute_ff_bytes()
        return list(self._tokenizer.tokenize_bytes(forced)) if forced else []
