"""Tiny random Llamas built in code, and the least tokenizer a backend needs, for backend tests."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from smc_sd.backends.hf import HFLanguageModel

EOS = 0
PROMPT = [3, 1, 4, 1, 5]


def tiny_llama(vocab: int = 64, seed: int = 0, layers: int = 2, init: float = 0.5) -> LlamaForCausalLM:
    """A random Llama, frozen; a wide initialisation makes its next-token distributions peaked."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=init,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def tokenizer(vocab: int):
    """The least a backend needs of a tokenizer: EOS, the vocabulary map and decode."""
    return types.SimpleNamespace(
        eos_token_id=EOS,
        get_vocab=lambda: {f"t{i}": i for i in range(vocab)},
        decode=lambda ids, **_: " ".join(map(str, ids)),
    )


def lm(model, **options) -> HFLanguageModel:
    """The hf backend over `model` (options: kv_cache, compile, ...)."""
    return HFLanguageModel(model, tokenizer(model.config.vocab_size), **options)


def continuation_rows() -> torch.Tensor:
    """[2, 6] int64: two different continuations of PROMPT."""
    return torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    """A module's tiny random target (import this fixture into a test module to use it)."""
    return tiny_llama()


@pytest.fixture(scope="module")
def continuation() -> torch.Tensor:
    return continuation_rows()
