"""A transformers backend: one causal LM with a per-row KV cache, on CPU or CUDA.

`HFSequences` holds B rows of equal length in one batched `DynamicCache` (keys and values
[B, heads, length, head_dim] per layer). Rows never differ in length, so no padding and no
attention mask are needed: every forward passes explicit positions length .. length+L-1 and the
model's causal mask covers the rest.

Invariants of `HFSequences`:
- every cache layer holds exactly `batch_size` rows and `length` positions;
- `length >= 1` (the prompt is never cropped away);
- after `close()` the cache is gone and every other method raises ValueError.

Logits come back as ordinary float32 tensors on the model's device (forwards run under
`torch.inference_mode()`, whose outputs refuse in-place edits, so they are copied out of it).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from smc_sd.backends.base import ContextOverflowError, LanguageModel, Sequences, Vocabulary


class HFLanguageModel(LanguageModel):
    """A transformers causal LM (Llama-family decoder) and its tokenizer.

    Args:
        model: a transformers `*ForCausalLM`; put in eval mode here.
        tokenizer: its tokenizer; `eos_token_id` and `get_vocab()` are used.
    """

    def __init__(self, model, tokenizer):
        self.model = model.eval()
        self.tokenizer = tokenizer
        # transformers 5.24 calls the forward's KV-cache argument `cache` (`past_key_values` still
        # works there but warns); earlier releases take `past_key_values`.
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._vocabulary = Vocabulary(
            size=model.config.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
            fingerprint=vocabulary_fingerprint(tokenizer),
        )

    @classmethod
    def from_pretrained(
        cls,
        path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        drop_layers: Sequence[int] = (),
    ) -> HFLanguageModel:
        """Load a local model directory (nothing is downloaded).

        Args:
            path: a directory holding a transformers causal LM and its tokenizer.
            device: where the model runs.
            dtype: the weights' dtype; logits are returned in float32 regardless.
            drop_layers: decoder layer indices to remove, making a cheaper self-speculative draft.
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if drop_layers:
            drop_decoder_layers(model, drop_layers)
        return cls(model.to(device), tokenizer)

    @classmethod
    def default(cls, device: str | torch.device = "cpu") -> HFLanguageModel:
        """The embedded default model, SmolLM2-135M-Instruct in fp32."""
        from smc_sd.models.smollm2 import default_model_dir

        return cls.from_pretrained(default_model_dir(), device=device)

    @classmethod
    def default_draft(cls, device: str | torch.device = "cpu") -> HFLanguageModel:
        """The default model without its least useful decoder layer(s): a self-speculative draft."""
        from smc_sd.models.smollm2 import DRAFT_DROPPED_LAYERS, default_model_dir

        return cls.from_pretrained(
            default_model_dir(), device=device, drop_layers=DRAFT_DROPPED_LAYERS
        )

    @property
    def vocabulary(self) -> Vocabulary:
        return self._vocabulary

    @property
    def max_length(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.model.device

    def open(self, prompt: list[int], batch_size: int) -> tuple[HFSequences, torch.Tensor]:
        """Run the prompt once at batch 1, then copy its cache into `batch_size` rows.

        Args:
            prompt: the prompt token ids, at least one.
            batch_size: B >= 1.

        Returns:
            The rows and the next-token logits after the prompt, [V] float32.

        Raises:
            ValueError: on an empty prompt or B < 1.
            ContextOverflowError: if the prompt is longer than `max_length`.
        """
        if len(prompt) == 0:
            raise ValueError("the prompt must hold at least one token")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if len(prompt) > self.max_length:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens; the model attends over {self.max_length}"
            )
        # Without a config every layer gets a plain DynamicLayer: it holds all positions, so `crop`
        # works at any length (a sliding-window layer cannot crop back past its window).
        cache = DynamicCache()
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        # [1, 1, V]: only the last position's logits are needed
        logits = self._forward(tokens, 0, cache, last_only=True)
        with torch.inference_mode():
            cache.batch_repeat_interleave(batch_size)
        rows = HFSequences(self, cache, length=len(prompt), batch_size=batch_size)
        return rows, logits[0, -1]

    def _forward(
        self, tokens: torch.Tensor, start: int, cache: DynamicCache, last_only: bool = False
    ) -> torch.Tensor:
        """One cached forward: append `tokens` at positions start .. start+L-1 of every row.

        Args:
            tokens: [B, L] int64 on the model's device.
            start: the cache's current length.
            cache: the rows' cache; grows by L positions.
            last_only: compute logits for the last position only.

        Returns:
            [B, L, V] float32 logits ([B, 1, V] with `last_only`).
        """
        # [1, L]: the same positions for every row, broadcast over B
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        with torch.inference_mode():
            out = self.model(
                input_ids=tokens,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                **{self._cache_kwarg: cache},
            )
        return out.logits.to(torch.float32, copy=True)


class HFSequences(Sequences):
    """B equal-length rows in one batched transformers `DynamicCache`."""

    def __init__(self, lm: HFLanguageModel, cache: DynamicCache, length: int, batch_size: int):
        self._lm = lm
        self._cache = cache
        self._length = length
        self._batch_size = batch_size

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def length(self) -> int:
        return self._length

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, L] int64 to every row; return logits [B, L, V] float32.

        Raises:
            ValueError: if tokens are not integer ids of shape [B, L] with L >= 1.
            ContextOverflowError: if a row would exceed `max_length` positions.
        """
        cache = self._open_cache()
        if tokens.ndim != 2 or tokens.shape[0] != self._batch_size or tokens.shape[1] < 1:
            raise ValueError(
                f"tokens must have shape [{self._batch_size}, L] with L >= 1, "
                f"got {tuple(tokens.shape)}"
            )
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
        if self._length + tokens.shape[1] > self._lm.max_length:
            raise ContextOverflowError(
                f"extending {self._length} positions by {tokens.shape[1]} exceeds the model's "
                f"{self._lm.max_length}"
            )
        tokens = tokens.to(device=self._lm.device, dtype=torch.long)
        logits = self._lm._forward(tokens, self._length, cache)
        self._length += tokens.shape[1]
        return logits

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i]; rows is [B'] int64, B' >= 1.

        The range check reads rows' min and max: one host sync when rows live on a GPU.
        """
        cache = self._open_cache()
        if rows.ndim != 1 or rows.numel() == 0:
            raise ValueError(f"rows must be a non-empty 1-D index tensor, got {tuple(rows.shape)}")
        if int(rows.min()) < 0 or int(rows.max()) >= self._batch_size:
            raise ValueError(f"rows must index 0 .. {self._batch_size - 1}, got {rows.tolist()}")
        with torch.inference_mode():
            cache.batch_select_indices(rows.to(device=self._lm.device, dtype=torch.long))
        self._batch_size = rows.numel()

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of every row, 1 <= length <= self.length."""
        cache = self._open_cache()
        if not 1 <= length <= self._length:
            raise ValueError(f"truncate length must be in 1 .. {self._length}, got {length}")
        with torch.inference_mode():
            # a negative argument is the number of positions to remove
            cache.crop(length - self._length)
        self._length = length

    def close(self) -> None:
        self._cache = None

    def _open_cache(self) -> DynamicCache:
        if self._cache is None:
            raise ValueError("these sequences were closed")
        return self._cache


def drop_decoder_layers(model, layers: Sequence[int]) -> None:
    """Remove decoder layers in place, keeping the KV cache's layer numbering contiguous.

    Each kept attention module's `layer_idx` (its slot in the cache) is renumbered 0 .. n-1 and
    `config.num_hidden_layers` (the decoder's loop bound) becomes n.

    Args:
        model: a transformers `*ForCausalLM` whose decoder keeps its blocks in `.layers`.
        layers: indices into the current decoder layers.

    Raises:
        ValueError: on an index out of range or when no layer would remain.
    """
    decoder = model.get_decoder()
    count = len(decoder.layers)
    dropped = set(layers)
    if not dropped <= set(range(count)):
        raise ValueError(f"layer indices must lie in 0 .. {count - 1}, got {sorted(dropped)}")
    kept = [layer for index, layer in enumerate(decoder.layers) if index not in dropped]
    if not kept:
        raise ValueError("cannot drop every decoder layer")
    decoder.layers = torch.nn.ModuleList(kept)
    for index, layer in enumerate(kept):
        layer.self_attn.layer_idx = index
    decoder.config.num_hidden_layers = len(kept)
    if getattr(decoder.config, "layer_types", None) is not None:
        decoder.config.layer_types = [
            kind for index, kind in enumerate(decoder.config.layer_types) if index not in dropped
        ]


def vocabulary_fingerprint(tokenizer) -> str:
    """sha256 (hex) of the tokenizer's sorted (token string, id) pairs."""
    pairs = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


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
