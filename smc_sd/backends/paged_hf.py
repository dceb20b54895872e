"""Rows of a transformers model whose KV lives in the model's shared block pool.

`PagedHFSequences` keeps only block tables (`smc_sd.cache.manager`); the KV bytes sit in one
`KVStore` per model. A forward appending L tokens to B rows of length S:

1. the manager makes room (copy on write of shared partial blocks, new blocks) and returns the
   slots [B, L] of the new positions; the store grows and copies blocks if asked;
2. every attention layer writes its new keys and values at those slots, then reads back all
   S + L positions of every row, gathered through the block tables into [B, H, S + L, D];
3. the blocks that became full enter the token trie, where equal blocks merge.

Rows may differ in length (`join` adds rows of another prompt, `truncate_rows` rolls rows back to
their own lengths): row b of length S_b appends at positions S_b .. S_b + L - 1, every layer
gathers positions 0 .. max_b S_b + L - 1 of every row, and an attention mask hides, for each
query, the keys past its own position (a shorter row's tail). An opened or joined prompt shares
the blocks of its prefix that the trie already holds (a system prompt common to several requests
is stored and computed once), those of rows that have left included (the prefix cache, up to
PREFIX_CACHE_BYTES), and computes only the rest.

Rows share prefixes by pointer: the prompt is computed once and its blocks are shared by all N
rows; `select` (resampling, forking) copies block ids and adjusts counts, never KV bytes.

Features (for a draft that reads them, `smc_sd.backends.feature_draft`): when the model's
`feature_layers` attribute names decoder layers, every forward also records those layers'
outputs, and the rows keep F [B, length, m·D] float32 for every position they hold, reordered by
`select` and cut by `truncate` with the KV. Without it (the default) nothing is recorded.

Invariants of `PagedHFSequences` (checked with `check_invariants`): its block tables obey the
manager's invariants; `features`, when kept, is [B, length, m·D]; after `close()` every
reference is returned and other methods raise.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from smc_sd.backends.base import Sequences, check_counts, check_extend, check_join, check_rows, check_truncate, check_truncate_rows
from smc_sd.backends.packed_rows import RowSpans
from smc_sd.cache.manager import KVCacheManager
from smc_sd.cache.store import KVStore
from smc_sd.models.feature_draft import capture_layer_outputs

DEFAULT_BLOCK_SIZE = 16
#: the KV bytes the pool may grow to for blocks kept after their rows left (the prefix cache,
#: `smc_sd.cache.manager`); vLLM's CPU backend here keeps a 1 GiB KV cache too
PREFIX_CACHE_BYTES = 1 << 30


class PagedLayer(CacheLayerMixin):
    """One attention layer's view of the store during one forward.

    Args:
        store: the model's KV store.
        layer: this layer's index in the store.
        past: S, positions already cached per row.
        write_rows: [B, H, L] int64 store rows (`KVStore.head_rows`) of the appended positions.
        read_rows: [B, H, S + L] int64 store rows of every position, or one such tensor per row
            group of a packed forward ([S_g, H, K_g], `RowSpans.split`).
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, store: KVStore, layer: int, past: int, write_rows, read_rows):
        super().__init__()
        self.store, self.layer, self.past = store, layer, past
        self.write_rows, self.read_rows = write_rows, read_rows
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: the store already exists."""

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new KV [B, H, L, D]; return every position's KV [B, H, S + L, D] (a packed
        forward: a tuple of keys and one of values, a tensor per row group)."""
        self.store.write(self.layer, self.write_rows, key_states, value_states)
        if isinstance(self.read_rows, torch.Tensor):
            return self.store.read(self.layer, self.read_rows)
        groups = [self.store.read(self.layer, rows) for rows in self.read_rows]
        return tuple(keys for keys, _ in groups), tuple(values for _, values in groups)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length, 0

    def get_seq_length(self) -> int:
        return self.past

    def get_max_length(self) -> int:
        return -1


def paged_cache(store: KVStore, past: int, write_slots, read_slots) -> Cache:
    """A transformers Cache whose every layer reads and writes the store through the slots.

    Args:
        past: S, positions already cached per row.
        write_slots: [B, L] int64 slots of the appended positions, on the store's device.
        read_slots: [B, S + L] int64 slots of every position (a packed forward writes one row
            [1, T] and reads its rows group by group: a tuple of [S_g, K_g], `RowSpans.split`).
    """
    # computed once for all layers: every layer's tensors share one layout
    write_rows = store.head_rows(write_slots)
    if isinstance(read_slots, torch.Tensor):
        read_rows = store.head_rows(read_slots)
    else:
        read_rows = tuple(store.head_rows(slots) for slots in read_slots)
    return Cache(
        layers=[PagedLayer(store, layer, past, write_rows, read_rows) for layer in range(len(store.keys))]
    )


class PagedKV:
    """The block manager and KV store of one model, created at its first paged open.

    Args:
        config: the model's transformers config (layers, key-value heads, head size).
        dtype, device: of the KV.
        block_size: positions per block.
        cache_bytes: the KV bytes the pool may grow to for cached blocks (`KVCacheManager`'s
            `cache_blocks`, in bytes).
    """

    def __init__(self, config, dtype, device, block_size: int = DEFAULT_BLOCK_SIZE, cache_bytes: int = PREFIX_CACHE_BYTES):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.store = KVStore(config.num_hidden_layers, heads, head_dim, block_size, dtype, device)
        self.manager = KVCacheManager(block_size, self.store.bytes_per_block, cache_blocks=cache_bytes // self.store.bytes_per_block)


class PagedHFSequences(Sequences):
    """B rows of an `HFLanguageModel`, held as block tables over its `PagedKV`."""

    def __init__(self, lm, kv: PagedKV, table):
        self._lm, self._kv, self._table = lm, kv, table
        # the decoder layers whose outputs are kept (set on the model by a feature draft)
        self._feature_layers = getattr(lm, "feature_layers", None)
        # [B, length, m·D] float32 features of every position, when kept
        self._features = None

    @classmethod
    def open(cls, lm, kv: PagedKV, prompt: list[int], batch_size: int) -> tuple[PagedHFSequences, torch.Tensor]:
        """Compute the prompt once into one row, then fork it to `batch_size` rows. The prefix
        the trie holds (the prefix cache) is shared, not computed again, unless the rows keep
        features (they need every position's).

        Returns:
            The rows and the next-token logits after the prompt, [V] float32.
        """
        keeps_features = bool(getattr(lm, "feature_layers", None))
        table, plan = kv.manager.open(prompt) if keeps_features else kv.manager.open_shared(prompt)
        rows = cls(lm, kv, table)
        try:
            logits = rows._forward(torch.tensor([prompt[len(prompt) - plan.slots.shape[1] :]]), plan, last_only=True)
            kv.manager.select(table, torch.zeros(batch_size, dtype=torch.int64))
        except BaseException:
            rows.close()
            raise
        if rows._features is not None:
            rows._features = rows._features.expand(batch_size, -1, -1)
        if rows._feature_layers:
            # the rows a feature draft opened next pairs with (`smc_sd.backends.feature_draft`)
            lm.latest_rows = rows
        return rows, logits[0, -1]

    @property
    def batch_size(self) -> int:
        return self._table.batch_size

    @property
    def length(self) -> int:
        return self._table.length

    @property
    def lengths(self) -> torch.Tensor:
        return self._table.lengths.clone()

    @property
    def tokens(self) -> torch.Tensor:
        """[B, length] int64 (CPU) token ids of every row (PAD, -1, past a shorter row's own)."""
        return self._table.tokens

    @property
    def features(self) -> torch.Tensor:
        """[B, length, m·D] float32 outputs of the model's `feature_layers` at every position.

        Raises:
            ValueError: if the model keeps no features.
        """
        if self._features is None:
            raise ValueError("these rows keep no features: set the model's feature_layers before open")
        return self._features

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, L] int64 to every row; return logits [B, L, V] float32."""
        self._check_open()
        check_extend(tokens, self.batch_size, int(self._table.lengths.max()), self._lm.max_length)
        plan = self._kv.manager.append(self._table, tokens)
        return self._forward(tokens, plan)

    def extend_rows(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append to row b its first counts[b] tokens; one packed forward computes only those
        (`smc_sd.backends.packed_rows`). Returns their logits packed row after row, [T, V]
        float32 (`Sequences.extend_rows`)."""
        self._check_open()
        counts = check_counts(counts, tokens)
        check_extend(tokens, self.batch_size, int((self._table.lengths + counts).max()) - tokens.shape[1], self._lm.max_length)
        if bool((counts == tokens.shape[1]).all()):
            return self.extend(tokens).flatten(0, 1)
        if not bool(counts.any()):
            return torch.empty(0, self._lm.vocabulary.size, device=self._lm.device)
        self._refuse_features("extend_rows")
        plan = self._kv.manager.append(self._table, tokens, counts)
        # [B, L]: the columns each row keeps
        real = torch.arange(tokens.shape[1])[None, :] < counts[:, None]
        return self._packed_forward(tokens[real], counts, plan.copies, plan.slots[real])

    def join(self, prompt: list[int], count: int) -> torch.Tensor:
        """Add `count` rows holding `prompt`; its prefix already in the trie is shared, not
        recomputed. Returns the logits after the prompt, [V] float32."""
        self._check_open()
        check_join(prompt, count, self._lm.max_length)
        self._refuse_features("join")
        rows, logits = PagedHFSequences.open(self._lm, self._kv, prompt, count)
        self._kv.manager.join(self._table, rows._table)
        return logits

    def join_many(self, prompts: list[list[int]], counts: list[int]) -> list[torch.Tensor]:
        """Join several prompts with ONE forward over their parts past the trie's shared
        prefixes (`_prefill`). Returns the logits after each prompt, [V] float32 each."""
        self._check_open()
        if not prompts:
            return []
        for prompt, count in zip(prompts, counts):
            check_join(prompt, count, self._lm.max_length)
        self._refuse_features("join_many")
        manager = self._kv.manager
        opened = [manager.open_shared(prompt) for prompt in prompts]
        table = opened[0][0]
        for other, _ in opened[1:]:
            manager.join(table, other)
        rows = PagedHFSequences(self._lm, self._kv, table)
        try:
            logits = rows._prefill([prompt[len(prompt) - plan.slots.shape[1] :] for prompt, (_, plan) in zip(prompts, opened)], [plan for _, plan in opened])
            manager.select(table, torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(counts)))
        except BaseException:
            rows.close()
            raise
        manager.join(self._table, table)
        return list(logits)

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] positions of row b."""
        self._check_open()
        lengths = check_truncate_rows(lengths, self._table.lengths)
        if bool((lengths != lengths[0]).any()):
            self._refuse_features("truncate_rows")
        self._kv.manager.truncate_rows(self._table, lengths)
        if self._features is not None:
            self._features = self._features[:, : int(lengths[0])]

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i]: block ids are copied, KV bytes are not."""
        self._check_open()
        check_rows(rows, self.batch_size)
        self._kv.manager.select(self._table, rows)
        if self._features is not None:
            self._features = self._features[rows.to(self._features.device)]

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of every row."""
        self._check_open()
        check_truncate(length, self.length)
        self._kv.manager.truncate(self._table, length)
        if self._features is not None:
            self._features = self._features[:, :length]

    def close(self) -> None:
        self._kv.manager.release(self._table)

    def memory(self) -> dict:
        """The pool's statistics as seen by these rows (`KVCacheManager.memory`)."""
        return self._kv.manager.memory(self._table)

    def rows_memory(self, rows: torch.Tensor, owners: torch.Tensor, count: int) -> list[dict]:
        """The bytes of the blocks each owner's rows hold, each counted once per owner
        (`KVCacheManager.rows_memory`)."""
        return self._kv.manager.rows_memory(self._table, rows, owners, count)

    def check_invariants(self) -> None:
        self._kv.manager.check_invariants(self._table)

    def _forward(self, tokens: torch.Tensor, plan, last_only: bool = False) -> torch.Tensor:
        """Run the forward of an appended block through the pool.

        Args:
            tokens: [B, L] int64, already recorded in the table by the plan.
            plan: the manager's AppendPlan for them.

        Returns:
            [B, L, V] float32 logits ([B, 1, V] with `last_only`).
        """
        manager, store, device = self._kv.manager, self._kv.store, self._lm.device
        # [B]: each row's length before these tokens; one int when the rows have one length
        starts = self._table.lengths - tokens.shape[1]
        start = int(starts[0]) if bool((starts == starts[0]).all()) else starts
        store.ensure_capacity(manager.pool.capacity)
        store.copy_blocks(plan.copies)
        cache = paged_cache(
            store, int(starts.max()), plan.slots.to(device), manager.slots(self._table).to(device)
        )
        if not self._feature_layers:
            logits = self._lm._forward(tokens.to(device=device, dtype=torch.long), start, cache, last_only)
        else:
            with capture_layer_outputs(self._lm.model, self._feature_layers) as captured:
                logits = self._lm._forward(tokens.to(device=device, dtype=torch.long), start, cache, last_only)
            # [B, L, m·D] appended to the kept [B, start, m·D]
            self._features = captured[0] if self._features is None else torch.cat([self._features, captured[0]], 1)
        manager.commit(self._table, starts)
        return logits

    def _prefill(self, new_tokens: list[list[int]], plans) -> torch.Tensor:
        """One packed forward writing every row's last L_j prompt positions (`plans[j]`, as
        `open_shared` made them), only the logits after each prompt computed.

        Returns:
            [J, V] float32 logits after each row's prompt.
        """
        counts = torch.tensor([len(t) for t in new_tokens])
        tokens = torch.tensor([t for row in new_tokens for t in row], dtype=torch.int64)
        copies = torch.cat([plan.copies for plan in plans])
        slots = torch.cat([plan.slots[0] for plan in plans])
        return self._packed_forward(tokens, counts, copies, slots, keep=counts.cumsum(0) - 1)

    def _packed_forward(self, tokens: torch.Tensor, counts: torch.Tensor, copies: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The forward of rows whose last counts[b] positions were just recorded (by `append` or
        `open_shared`), their tokens packed end to end.

        Args:
            tokens: [T] int64, T = sum(counts): every row's new tokens, row after row.
            counts: [B] int64 new positions per row (0: the row reads nothing).
            copies: [C, 2] block copies the store makes first.
            slots: [T] int64 slots where the new positions' KV goes.
            keep: [J] int64 packed indices whose logits are wanted (None: all T).

        Returns:
            [T, V] float32 logits ([J, V] with `keep`).
        """
        manager, store, device = self._kv.manager, self._kv.store, self._lm.device
        starts = self._table.lengths - counts
        # [T]: each new token's position in its row
        positions = torch.repeat_interleave(starts - counts.cumsum(0) + counts, counts) + torch.arange(int(counts.sum()))
        # the rows that read tokens, and their slots ([R, max length]) group by group
        reading = counts > 0
        lengths = self._table.lengths[reading]
        spans = RowSpans.of(counts[reading], lengths, device)
        read = spans.split(manager.slots(self._table, 0, int(lengths.max()))[reading].to(device))
        store.ensure_capacity(manager.pool.capacity)
        store.copy_blocks(copies)
        cache = paged_cache(store, int(starts.max()), slots[None].to(device), read)
        logits = self._lm._forward_packed(tokens.to(device), positions.to(device), spans, cache, None if keep is None else keep.to(device))
        manager.commit(self._table, starts)
        return logits

    def _refuse_features(self, operation: str) -> None:
        if self._feature_layers:
            raise NotImplementedError(f"PagedHFSequences that keep features hold rows of one length only: {operation} needs rows of several lengths")

    def _check_open(self) -> None:
        if self._table.closed:
            raise ValueError("these sequences were closed")
