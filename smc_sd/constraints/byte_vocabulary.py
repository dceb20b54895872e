"""The byte string of every token of a language model, and the trie of those byte strings.

Both the token masks of a byte potential (`smc_sd.constraints.potentials`) and the block-end scores
of one (`smc_sd.constraints.scores`) read a token sequence x_1..x_t as the bytes
bytes(x_1) + ... + bytes(x_t); this module computes bytes(v) for every token id v once per LM.
"""

from __future__ import annotations

import weakref

# per LM: its byte vocabulary and trie
_TRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
