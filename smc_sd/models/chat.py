"""Prompts as token ids: text in a tokenizer's chat template (or as is), or ids as given."""

from __future__ import annotations

import operator
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


def prompt_token_ids(lm, prompt, raw: bool = False) -> list[int]:
    """A prompt as the token ids a run starts from.

    Text is one user message in the model's chat template (`chat_prompt`), or with `raw` the
    text's own tokens (no special tokens added); token ids are used as given.

    Args:
        lm: the target `LanguageModel` (its `tokenizer` encodes text).
        prompt: text, or a sequence of token ids (ints).
        raw: encode text as is, without the chat template.

    Raises:
        ValueError: a prompt that is neither text nor token ids, text for a model without a
            tokenizer, or text without `raw` for a tokenizer without a chat template.
    """
    if isinstance(prompt, str):
        tokenizer = getattr(lm, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("this model has no tokenizer to encode a text prompt; pass the prompt as token ids (a list of ints)")
        if raw:
            return [int(token) for token in tokenizer.encode(prompt, add_special_tokens=False)]
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template; pass raw=True to use the text as is, or token ids")
        return chat_prompt(tokenizer, prompt)
    try:
        return [operator.index(token) for token in prompt]
    except TypeError:
        raise ValueError(f"a prompt is text or a list of token ids (ints), got {type(prompt).__name__} {str(prompt)[:60]!r}") from None
