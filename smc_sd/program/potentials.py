"""genlm-control potentials as token constraints of one language model.

A boolean genlm-control `Potential` over bytes (`BoolFSA.from_regex`, `BoolCFG.from_lark`,
`JsonSchema`, user subclasses) is coerced to the LM's tokens by concatenating token bytes, as
genlm-control's `coerce(llm, f=b"".join)` does:

    phi_tokens(x_1..x_t) = phi_bytes(bytes(x_1) + ... + bytes(x_t)).

The next-token mask of a prefix is found by walking a byte trie of the whole vocabulary once and
pruning every subtree whose byte prefix is already dead, so a call costs the number of live trie
nodes, not V prefix checks:
- `FSAConstraint` (BoolFSA): the walk runs on sets of automaton states, so it depends only on the
  state a prefix reaches; masks are cached per state and a particle's state advances token by
  token. After warm-up a mask is a table look-up.
- `BytePotentialConstraint` (any other byte potential): the walk asks `potential.prefix` at each
  trie node; masks are cached per byte prefix.
A potential over the LM's own token ids is asked for `batch_logw_next` directly.

Measured on SmolLM2's 49152 tokens (2 shared CPU cores): an automaton state's first walk takes
0.01-0.7 s (0.5 s inside a JSON string, where 47,926 tokens stay live), after which a batch of
28 prefixes costs 0.24 ms. genlm-control's `Coerced.batch_logw_next` on the same `BoolFSA` visits
every token for every context: about 0.13 s per context and 1.0 s for a batch of 8, every time.

Special tokens other than EOS never appear in masks (their text is dropped on decoding).
"""

from __future__ import annotations

import asyncio
import weakref
from functools import lru_cache

import torch

from smc_sd.program.constraints import TokenConstraint


# per LM: its byte vocabulary and trie; its lowered constraints {id(potential): (potential, lowered)}
_TRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOWERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary_trie(lm) -> tuple[list[bytes | None], dict]:
    """`token_bytes(lm)` and its `byte_trie`, built once per LM (about 1.5 s for 49152 tokens)."""
    if lm not in _TRIES:
        vocabulary = token_bytes(lm)
        _TRIES[lm] = (vocabulary, byte_trie(vocabulary))
    return _TRIES[lm]


def token_bytes(lm) -> list[bytes | None]:
    """The byte string of every token id of `lm` (None for special tokens and padding rows).

    Args:
        lm: a `LanguageModel`; with a transformers tokenizer its byte-level vocabulary is read
            by genlm-backend, otherwise `lm.decode([t])` is UTF-8 encoded (toy models).
    """
    size, eos = lm.vocabulary.size, lm.vocabulary.eos_token_id
    if lm.tokenizer is None:
        return [None if t == eos else lm.decode([t]).encode() for t in range(size)]
    from genlm.backend.tokenization import decode_vocab

    byte_vocab, _ = decode_vocab(lm.tokenizer)
    special = set(lm.tokenizer.all_special_ids)
    out: list[bytes | None] = [None] * size
    for token in byte_vocab:
        if token.token_id < size and token.token_id not in special:
            out[token.token_id] = bytes(token)
    return out


def byte_trie(vocabulary: list[bytes | None]) -> dict:
    """A trie of token byte strings: node = {byte: child}, with the ids ending at a node under None."""
    root: dict = {}
    for token_id, data in enumerate(vocabulary):
        if data:
            node = root
            for byte in data:
                node = node.setdefault(byte, {})
            node.setdefault(None, []).append(token_id)
    return root


def walk_trie(trie: dict, start, step) -> dict[int, object]:
    """Every token whose bytes keep a byte-level state alive.

    Args:
        trie: from `byte_trie`.
        start: the state before the token.
        step: step(state, byte) -> the next state, or None when the byte prefix is dead.

    Returns:
        {token id: the state after its bytes} for the live tokens.
    """
    live: dict[int, object] = {}
    stack = [(trie, start)]
    while stack:
        node, state = stack.pop()
        for key, child in node.items():
            if key is None:
                live.update(dict.fromkeys(child, state))
                continue
            nxt = step(state, key)
            if nxt is not None:
                stack.append((child, nxt))
    return live


class FSAConstraint(TokenConstraint):
    """A genlm-control `BoolFSA` over bytes, as exact token masks of one LM.

    Args:
        fsa: a boolean `BoolFSA` (e.g. `BoolFSA.from_regex(pattern)`).
        lm: the language model whose tokens are masked.
    """

    def __init__(self, fsa, lm):
        self.vocab_size, self.eos = lm.vocabulary.size, lm.vocabulary.eos_token_id
        self._trie = vocabulary_trie(lm)[1]
        automaton = fsa.wfsa.epsremove
        self._arcs = automaton.arcs
        self._coaccessible = {i for i in automaton.states if automaton.backward[i].score}
        self._finals = {i for i, w in automaton.F if w.score}
        self._start = frozenset(i for i in fsa._start_chart if i in self._coaccessible)
        # state -> ([V] bool mask, {token: next state}); prefix tuple -> state
        self._table: dict[frozenset, tuple[torch.Tensor, dict]] = {}
        self._states: dict[tuple[int, ...], frozenset] = {(): self._start}
        self._step = lru_cache(maxsize=None)(self._byte_step)

    def _byte_step(self, states: frozenset, byte: int) -> frozenset | None:
        nxt = frozenset(j for i in states for j, w in self._arcs(i, byte) if w.score and j in self._coaccessible)
        return nxt or None

    def _row(self, states: frozenset) -> tuple[torch.Tensor, dict]:
        if states not in self._table:
            nxt = walk_trie(self._trie, states, self._step) if states else {}
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[list(nxt)] = True
            mask[self.eos] = bool(states & self._finals)
            self._table[states] = (mask, nxt)
        return self._table[states]

    def _state(self, prefix: tuple[int, ...]) -> frozenset:
        known = len(prefix)
        while prefix[:known] not in self._states:
            known -= 1
        state = self._states[prefix[:known]]
        for t in range(known, len(prefix)):
            state = self._row(state)[1].get(prefix[t], frozenset())
            self._states[prefix[: t + 1]] = state
        return state

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        # [B, V] bool
        return torch.stack([self._row(self._state(tuple(p)))[0] for p in prefixes])


class BytePotentialConstraint(TokenConstraint):
    """Any boolean genlm-control potential over bytes, as token masks of one LM.

    Args:
        potential: a `Potential` whose vocabulary is bytes (ints 0..255); `prefix` must be 0 on
            every prefix of a string of the language and -inf otherwise, `complete` likewise on
            the strings themselves.
        lm: the language model whose tokens are masked.
    """

    def __init__(self, potential, lm):
        self.potential = potential
        self.vocab_size, self.eos = lm.vocabulary.size, lm.vocabulary.eos_token_id
        self._vocabulary, self._trie = vocabulary_trie(lm)
        self._loop = asyncio.new_event_loop()
        self._masks: dict[bytes, torch.Tensor] = {}

    def _alive(self, data: bytes) -> bool:
        return self._loop.run_until_complete(self.potential.prefix(data)) > float("-inf")

    def _mask_of(self, data: bytes) -> torch.Tensor:
        if data not in self._masks:
            live = walk_trie(self._trie, data, lambda d, b: d + bytes([b]) if self._alive(d + bytes([b])) else None)
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[list(live)] = True
            mask[self.eos] = self._loop.run_until_complete(self.potential.complete(data)) > float("-inf")
            self._masks[data] = mask
        return self._masks[data]

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        # [B, V] bool
        return torch.stack([self._mask_of(b"".join(self._vocabulary[t] for t in p)) for p in prefixes])


class TokenPotentialConstraint(TokenConstraint):
    """A boolean genlm-control potential whose vocabulary is the LM's token ids 0..V-1 (EOS
    excluded); masks come from one `batch_logw_next` call per batch."""

    def __init__(self, potential, lm):
        self.potential = potential
        self.vocab_size, self.eos = lm.vocabulary.size, lm.vocabulary.eos_token_id
        self._loop = asyncio.new_event_loop()

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        weights = self._loop.run_until_complete(self.potential.batch_logw_next(prefixes)).weights
        # [B, len(vocab) + 1]: the potential's tokens, then its EOS
        logw = torch.as_tensor(weights, dtype=torch.float64)
        out = torch.zeros(len(prefixes), self.vocab_size, dtype=torch.bool)
        out[:, torch.as_tensor(self.potential.vocab, dtype=torch.long)] = logw[:, :-1] > float("-inf")
        out[:, self.eos] = logw[:, -1] > float("-inf")
        return out


def is_byte_potential(potential) -> bool:
    """Whether a genlm-control potential's vocabulary is bytes (ints below 256)."""
    return all(isinstance(v, int) and 0 <= v < 256 for v in potential.vocab)


def as_token_constraint(constraint, lm) -> TokenConstraint:
    """Lower one of a program's constraints to token masks of `lm`.

    Args:
        constraint: a `TokenConstraint` (kept), a genlm-control `BoolFSA` (exact automaton
            index), another boolean genlm-control `Potential` over bytes (trie walk), or one over
            the LM's token ids.
        lm: the target LM.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(constraint, TokenConstraint):
        return constraint
    # a lowered constraint keeps its mask tables across runs: one per (potential, LM)
    lowered = _LOWERED.setdefault(lm, {})
    if id(constraint) not in lowered:
        lowered[id(constraint)] = (constraint, _lower(constraint, lm))
    return lowered[id(constraint)][1]


def _lower(constraint, lm) -> TokenConstraint:
    from genlm.control.potential import Potential
    from genlm.control.potential.built_in.wfsa import BoolFSA

    if isinstance(constraint, BoolFSA):
        return FSAConstraint(constraint, lm)
    if isinstance(constraint, Potential):
        if is_byte_potential(constraint):
            return BytePotentialConstraint(constraint, lm)
        return TokenPotentialConstraint(constraint, lm)
    raise TypeError(f"a constraint must be a TokenConstraint or a genlm-control Potential, got {type(constraint).__name__}")
