"""A model wrapper that runs the paged cache's bookkeeping without KV bytes: exact block counts.

`DryRunLM(inner, bytes_per_block, block_size)` answers every call with `inner`'s logits and
mirrors each row operation into a `KVCacheManager` of its own: open, extend (append and commit),
select, truncate and close do to the block tables exactly what `PagedHFSequences` does, but no
KV is computed or stored. Since the manager never reads KV values, its block counts and peaks are
those a paged model would reach on the same token streams. Used to measure memory quickly with a
cheap inner model and another model's KV size (`bytes_per_block`).
"""

from __future__ import annotations

import torch

from smc_sd.backends.base import LanguageModel, Sequences, Vocabulary
from smc_sd.cache.manager import KVCacheManager


class DryRunLM(LanguageModel):
    """`inner`'s logits, with block bookkeeping sized by `bytes_per_block`.

    Args:
        inner: the model answering the forwards.
        bytes_per_block: KV bytes one block of the modelled cache holds.
        block_size: positions per block.
    """

    def __init__(self, inner: LanguageModel, bytes_per_block: int, block_size: int):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.manager = KVCacheManager(block_size, bytes_per_block)

    @property
    def vocabulary(self) -> Vocabulary:
        return self.inner.vocabulary

    @property
    def max_length(self) -> int:
        return self.inner.max_length

    def decode(self, token_ids: list[int]) -> str:
        return self.inner.decode(token_ids)

    def open(self, prompt: list[int], batch_size: int) -> tuple[DryRunSequences, torch.Tensor]:
        rows, logits = self.inner.open(prompt, batch_size)
        table, _ = self.manager.open(prompt)
        self.manager.commit(table, 0)
        self.manager.select(table, torch.zeros(batch_size, dtype=torch.int64))
        return DryRunSequences(rows, self.manager, table), logits


class DryRunSequences(Sequences):
    """The inner rows, and block tables that follow them."""

    def __init__(self, inner: Sequences, manager: KVCacheManager, table):
        self._inner, self._manager, self._table = inner, manager, table

    @property
    def batch_size(self) -> int:
        return self._inner.batch_size

    @property
    def length(self) -> int:
        return self._inner.length

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self._inner.extend(tokens)
        start = self._table.length
        self._manager.append(self._table, tokens)
        self._manager.commit(self._table, start)
        return logits

    def select(self, rows: torch.Tensor) -> None:
        self._inner.select(rows)
        self._manager.select(self._table, rows)

    def truncate(self, length: int) -> None:
        self._inner.truncate(length)
        self._manager.truncate(self._table, length)

    def close(self) -> None:
        self._inner.close()
        self._manager.release(self._table)

    def memory(self) -> dict:
        return self._manager.memory(self._table)
