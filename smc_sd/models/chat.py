"""Prompts in a tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Mapping


def chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of one user message in the tokenizer's chat template, ready for the reply.

    transformers 5 returns a BatchEncoding from `apply_chat_template(tokenize=True)`; older
    versions return the ids themselves. Both become a plain list of ints.
    """
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]
