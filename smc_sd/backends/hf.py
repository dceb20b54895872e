"""A transformers backend: one causal LM on CPU or CUDA, its rows' KV in a shared block pool.

By default (`kv_cache="paged"`) rows are `PagedHFSequences` (`smc_sd.backends.paged_hf`): block
tables over one pool per model, the prompt computed once, resampling copying block ids only.
With `kv_cache="static"` rows are `StaticHFSequences` (`smc_sd.backends.static_hf`): fixed-shape
KV buffers [B, heads, S, head_dim] per layer, a forward step with fixed shapes that `compile=True`
runs through `torch.compile`, resampling a row gather on the device.
With `kv_cache="copy"` every row owns a full copy of its KV: `HFSequences` holds B rows of equal
length in one batched `DynamicCache` (keys and values [B, heads, length, head_dim] per layer).
Rows never differ in length, so no padding and no attention mask are needed: every forward passes
explicit positions length .. length+L-1 and the model's causal mask covers the rest.

Invariants of `HFSequences`:
- every cache layer holds exactly `batch_size` rows and `length` positions;
- `length >= 1` (the prompt is never cropped away);
- after `close()` the cache is gone and every other method raises ValueError.

Weights, activations and KV are in the model's dtype (float32 or bfloat16, `smc_sd.backends.precision`).
Logits come back as float32 tensors on the model's device, cast after the LM head. Forwards run
under `torch.inference_mode()` and hand over the model's own logits, not a copy: they read like
any tensor, and an in-place edit of them outside inference mode raises (clone them first).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from smc_sd.backends.base import (
    LanguageModel,
    Sequences,
    Vocabulary,
    check_extend,
    check_open,
    check_rows,
    check_truncate,
)
from smc_sd.backends.onednn_linear import use_onednn_linears
from smc_sd.backends.packed_rows import RowSpans, packed_attention
from smc_sd.backends.paged_hf import DEFAULT_BLOCK_SIZE, PREFIX_CACHE_BYTES, PagedHFSequences, PagedKV
from smc_sd.backends.pass_cost import PassCost, pass_cost_for
from smc_sd.backends.precision import as_dtype
from smc_sd.backends.static_hf import StaticHFSequences, StaticRuntime
from smc_sd.models.chat import chat_prompt  # noqa: F401  (re-exported: prompts are built from here)

KV_CACHES = ("paged", "copy", "static")


class HFLanguageModel(LanguageModel):
    """A transformers causal LM (Llama-family decoder) and its tokenizer.

    Args:
        model: a transformers `*ForCausalLM`; put in eval mode here. On the CPU its linear
            layers run through oneDNN from here on (`smc_sd.backends.onednn_linear`).
        tokenizer: its tokenizer; `eos_token_id` and `get_vocab()` are used.
        kv_cache: "paged" (rows share KV blocks through a token trie), "copy" (every row owns a
            full copy of its KV; kept for comparison) or "static" (fixed-shape buffers per row).
        block_size: positions per KV block of the paged cache.
        compile: static cache only: run its fixed-shape step through `torch.compile`.
        static_length: static cache only: positions per row to allocate at open (None: the
            prompt's length plus `static_hf.DEFAULT_HEADROOM`, rounded up).
        prefix_cache_bytes: paged cache only: the KV bytes its pool may grow to for blocks kept
            after their rows left, for later prompts that start with the same tokens (the
            prefix cache, `smc_sd.cache.manager`; 0: kept only while the pool has room).
    """

    def __init__(
        self,
        model,
        tokenizer,
        kv_cache: str = "paged",
        block_size: int = DEFAULT_BLOCK_SIZE,
        compile: bool = False,
        static_length: int | None = None,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
    ):
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
        self.compile, self.static_length = compile, static_length
        # the static path's runtimes (compiled or not), made at the first static open
        self._static: dict[bool, StaticRuntime] = {}
        self.model = model.eval()
        if next(model.parameters()).device.type == "cpu":
            use_onednn_linears(model)
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.block_size = block_size
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be at least 0, got {prefix_cache_bytes}")
        self.prefix_cache_bytes = prefix_cache_bytes
        # the paged cache's pool and store, made at the first paged open
        self._paged: PagedKV | None = None
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
        dtype: torch.dtype | str = torch.float32,
        drop_layers: Sequence[int] = (),
        **options,
    ) -> HFLanguageModel:
        """Load a local model directory (nothing is downloaded).

        Args:
            path: a directory holding a transformers causal LM and its tokenizer.
            device: where the model runs.
            dtype: the dtype of the weights, activations and KV: a torch dtype or a name of
                `precision.DTYPES` ("auto": bfloat16 where the device multiplies bf16 natively);
                logits are returned in float32 regardless.
            drop_layers: decoder layer indices to remove, making a cheaper self-speculative draft.
            options: `kv_cache` and `block_size`, passed to the constructor.
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        dtype = as_dtype(dtype, device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if drop_layers:
            drop_decoder_layers(model, drop_layers)
        return cls(model.to(device), tokenizer, **options)

    @classmethod
    def default(cls, device: str | torch.device = "cpu", **options) -> HFLanguageModel:
        """The embedded default model, SmolLM2-135M-Instruct (float32 unless `options` give a `dtype`)."""
        from smc_sd.models.smollm2 import default_model_dir

        return cls.from_pretrained(default_model_dir(), device=device, **options)

    @classmethod
    def default_draft(cls, device: str | torch.device = "cpu", **options) -> HFLanguageModel:
        """The default draft: `self_draft`.

        The distilled draft (`smc_sd.drafts.distilled_draft`) costs a quarter of a target token but
        agrees with the target too little (held-out acceptance 0.44) for SMC-SD at small N to
        follow the target (docs/draft.md), so it is opt-in until a better one is
        trained. `smc_sd.drafts` resolves every `--draft` name.
        """
        return cls.self_draft(device, **options)

    @classmethod
    def self_draft(cls, device: str | torch.device = "cpu", **options) -> HFLanguageModel:
        """A self-speculative draft: the default model without decoder layer(s) SELF_DRAFT_DROPPED_LAYERS."""
        from smc_sd.models.smollm2 import SELF_DRAFT_DROPPED_LAYERS, default_model_dir

        return cls.from_pretrained(default_model_dir(), device=device, drop_layers=SELF_DRAFT_DROPPED_LAYERS, **options)

    @property
    def vocabulary(self) -> Vocabulary:
        return self._vocabulary

    @property
    def max_length(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def pass_cost(self) -> PassCost:
        return pass_cost_for(self.model.device.type, str(self.model.dtype).removeprefix("torch."))

    @property
    def device(self) -> torch.device:
        return self.model.device

    def drop_prefix_cache(self) -> None:
        """Evict every cached block of the paged cache (`KVCacheManager.drop_cache`)."""
        if self._paged is not None:
            self._paged.manager.drop_cache()

    def open(self, prompt: list[int], batch_size: int) -> tuple[Sequences, torch.Tensor]:
        """Run the prompt once at batch 1, then share (paged) or copy its KV into `batch_size` rows.

        Args:
            prompt: the prompt token ids, at least one.
            batch_size: B >= 1.

        Returns:
            The rows and the next-token logits after the prompt, [V] float32.

        Raises:
            ValueError: on an empty prompt or B < 1.
            ContextOverflowError: if the prompt is longer than `max_length`.
        """
        check_open(prompt, batch_size, self.max_length)
        if self.compile and self.kv_cache != "static":
            raise ValueError(f"compile=True needs kv_cache='static', got kv_cache={self.kv_cache!r}")
        if self.kv_cache == "static":
            if type(self)._logits is not HFLanguageModel._logits or type(self)._forward is not HFLanguageModel._forward:
                raise ValueError(f"kv_cache='static' runs the model's own head; {type(self).__name__} changes its logits")
            if self.compile not in self._static:
                self._static[self.compile] = StaticRuntime(self.model, self._cache_kwarg, self.compile)
            return StaticHFSequences.open(self._static[self.compile], prompt, batch_size, self.max_length, self.static_length)
        if self.kv_cache == "paged":
            if self._paged is None:
                self._paged = PagedKV(self.model.config, self.model.dtype, self.device, self.block_size, self.prefix_cache_bytes)
            return PagedHFSequences.open(self, self._paged, prompt, batch_size)
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
        self, tokens: torch.Tensor, start: int, cache, last_only: bool = False
    ) -> torch.Tensor:
        """One cached forward: append `tokens` at positions start .. start+L-1 of every row.

        Rows of different lengths (a [B] `start`) need a cache whose every layer returns row b's
        keys at positions 0 .. T - 1 in that order, T = max(start) + L, whatever lies past the
        row's own start[b] + L; the additive mask lets the query at position p see keys j <= p.

        Args:
            tokens: [B, L] int64 on the model's device.
            start: the cache's current length: an int, or [B] int64, each row's own.
            cache: the rows' transformers Cache; grows by L positions.
            last_only: compute logits for the last position only.

        Returns:
            [B, L, V] float32 logits ([B, 1, V] with `last_only`).
        """
        steps = torch.arange(tokens.shape[1], device=tokens.device)
        masking = {}
        if isinstance(start, torch.Tensor):
            # [B, L]: every row's own positions
            positions = start.to(tokens.device)[:, None] + steps[None, :]
            keys = torch.arange(int(start.max()) + tokens.shape[1], device=tokens.device)
            dtype = self.model.dtype
            # [B, 1, L, T]: 0 where key j <= the query's position, the dtype's minimum elsewhere
            hidden = keys[None, None, None, :] > positions[:, None, :, None]
            masking["attention_mask"] = torch.zeros(hidden.shape, dtype=dtype, device=tokens.device).masked_fill(hidden, torch.finfo(dtype).min)
        else:
            # [1, L]: the same positions for every row, broadcast over B
            positions = (start + steps)[None]
        return self._logits(cache, input_ids=tokens, position_ids=positions, logits_to_keep=1 if last_only else 0, **masking)

    def _forward_packed(self, tokens: torch.Tensor, positions: torch.Tensor, spans: RowSpans, cache, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One cached forward over rows packed end to end (`smc_sd.backends.packed_rows`).

        Args:
            tokens: [T] int64 on the model's device: every row's new tokens, row after row.
            positions: [T] int64: each token's position in its own row.
            spans: how the rows are attended, in groups.
            cache: a Cache whose every layer returns the rows' keys and values group by group:
                a tuple of [S_g, H, K_g, D] each, padded within the group (`RowSpans.split`).
            keep: [J] int64 packed indices whose logits are wanted (None: all T).

        Returns:
            [T, V] float32 logits ([J, V] with `keep`).
        """
        with packed_attention(self.model):
            logits = self._logits(cache, input_ids=tokens[None], position_ids=positions[None], logits_to_keep=0 if keep is None else keep, row_spans=spans)
        return logits[0]

    def _logits(self, cache, **inputs) -> torch.Tensor:
        """The model's logits for these inputs, appending to `cache`: [B, L, V] float32 (an
        inference tensor)."""
        with torch.inference_mode():
            out = self.model(use_cache=True, **inputs, **{self._cache_kwarg: cache})
        return out.logits.float()


class HFSequences(Sequences):
    """B equal-length rows in one batched transformers `DynamicCache`, each a full copy."""

    def __init__(self, lm: HFLanguageModel, cache: DynamicCache, length: int, batch_size: int):
        self._lm = lm
        self._cache = cache
        self._length = length
        self._batch_size = batch_size
        # KV bytes of one position: keys and values of every layer, [B, H, S, D] each
        keys = cache.layers[0].keys
        self._bytes_per_position = 2 * len(cache.layers) * keys.shape[1] * keys.shape[3] * keys.element_size()
        self._peak_bytes = 0
        self._record_peak()

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
        check_extend(tokens, self._batch_size, self._length, self._lm.max_length)
        tokens = tokens.to(device=self._lm.device, dtype=torch.long)
        logits = self._lm._forward(tokens, self._length, cache)
        self._length += tokens.shape[1]
        self._record_peak()
        return logits

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i]; rows is [B'] int64, B' >= 1 (KV bytes copied)."""
        cache = self._open_cache()
        check_rows(rows, self._batch_size)
        with torch.inference_mode():
            cache.batch_select_indices(rows.to(device=self._lm.device, dtype=torch.long))
        self._batch_size = rows.numel()
        self._record_peak()

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of every row, 1 <= length <= self.length."""
        cache = self._open_cache()
        check_truncate(length, self._length)
        with torch.inference_mode():
            # a negative argument is the number of positions to remove
            cache.crop(length - self._length)
        self._length = length

    def close(self) -> None:
        self._cache = None

    def memory(self) -> dict:
        """Bytes of the per-row copies: B · length positions, each holding every layer's KV."""
        live = 0 if self._cache is None else self._batch_size * self._length * self._bytes_per_position
        return {"live_bytes": live, "peak_bytes": self._peak_bytes, "naive_peak_bytes": self._peak_bytes}

    def rows_memory(self, rows: torch.Tensor, owners: torch.Tensor, count: int) -> list[dict]:
        """Each row is a full copy: an owner's rows · length positions."""
        per_row = self._length * self._bytes_per_position
        held = [n * per_row for n in torch.bincount(owners, minlength=count).tolist()]
        return [{"live_bytes": h, "naive_bytes": h} for h in held]

    def _record_peak(self) -> None:
        self._peak_bytes = max(self._peak_bytes, self._batch_size * self._length * self._bytes_per_position)

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


