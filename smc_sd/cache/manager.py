"""The KV-cache manager: block tables of equal-length rows over one model's pool and trie.

Each row (particle) holds a path: a block table listing the blocks that hold its KV, position p
living in block `blocks[b, p // block_size]` at offset `p % block_size`, i.e. at flat slot

    slot(b, p) = blocks[b, p // block_size] · block_size + p % block_size.

The manager never sees KV values: it hands out slots to write and to read, and a list of block
copies the store must make first (copy on write). So the same bookkeeping can run without a
model (a dry run) and measure exact block counts.

- open: one row for the prompt, written once; `select` then forks it to N rows.
- select(rows): row i takes row rows[i]'s table; shares and releases adjust counts (pointer copies).
- append: a row writing into a shared, partially filled last block first copies it to a block of
  its own (copy on write); new blocks are allocated as rows grow.
- commit: blocks that became full are indexed in the trie; a row whose new full block equals an
  indexed one (same parent, same tokens) points at that one and frees its own.
- truncate / release: blocks past the kept length return their references.

A block that a truncation leaves partial stays indexed: nothing has written it, so its KV is
still its key's, the truncated row reads only its first positions (whose KV is the row's own),
and other rows may hold it full. The row stops pointing at it at its next append, the only
moment its contents would part from the key's: it copies a shared block on write, or, as the
block's only holder, drops it from the index and writes in place. When the row fills the block
again, commit merges it into the indexed block with the same key, if there is one.

Invariants of a `BlockTables` (checked by `check_invariants` with the pool's and trie's own,
between operations, i.e. after each append's commit):
- `blocks` is [B, ceil(length / block_size)] and `tokens` is [B, length];
- every listed block is live; for every block the number of listings across all open tables is
  at most its count (equal when this is the only user of the pool);
- an indexed block listed at column j > 0 has the block at column j - 1 as its trie parent;
- a row listing an indexed block at column j holds there the first tokens of its key (all of
  them when the block is full in that row);
- one block per full prefix, across the tables given: a block listed at column j of a row of
  length >= (j + 1)·block_size is indexed; the rows whose first (j + 1)·block_size tokens are
  equal list one block at column j; and a block is listed at one column only, under prefixes of
  one another (the rows holding it partially hold a prefix of what the others hold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from smc_sd.cache.pool import BlockPool
from smc_sd.cache.trie import ROOT, TokenTrie


@dataclass
class BlockTables:
    """The paths of B equal-length rows.

    Attributes:
        blocks: [B, M] int64 block ids, M = ceil(length / block_size).
        tokens: [B, S] int64 token ids, S = length.
        peak_live_blocks: the pool's largest live count seen after this table's operations.
        naive_peak_tokens: the largest B · length seen: positions a cache holding one full copy
            per row would need.
    """

    blocks: torch.Tensor
    tokens: torch.Tensor
    peak_live_blocks: int = 0
    naive_peak_tokens: int = 0
    closed: bool = field(default=False)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class AppendPlan:
    """What the KV store must do for one append.

    Attributes:
        copies: [C, 2] int64 (source block, destination block) pairs, to copy before writing.
        slots: [B, L] int64 flat slots where the appended positions' KV goes.
    """

    copies: torch.Tensor
    slots: torch.Tensor


class KVCacheManager:
    """Block tables, reference counts and the token trie of one model.

    Args:
        block_size: positions per block.
        bytes_per_block: KV bytes one block holds (all layers, keys and values), for statistics.
        capacity: the pool's initial number of blocks.
    """

    def __init__(self, block_size: int, bytes_per_block: int, capacity: int = 64):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.pool = BlockPool(capacity)
        self.trie = TokenTrie()

    def open(self, prompt: list[int]) -> tuple[BlockTables, AppendPlan]:
        """One row holding nothing yet, and the plan to write the prompt's KV into it."""
        table = BlockTables(torch.empty(1, 0, dtype=torch.int64), torch.empty(1, 0, dtype=torch.int64))
        return table, self.append(table, torch.tensor([prompt], dtype=torch.int64))

    def append(self, table: BlockTables, tokens: torch.Tensor) -> AppendPlan:
        """Make room for `tokens` [B, L] int64 at the end of every row and record them.

        Returns:
            The plan: block copies (copy on write of shared partial last blocks), then the slots
            where the new positions' KV must be written. Call `commit` once they are written.
        """
        self._check_open(table)
        bs, old = self.block_size, table.length
        tokens = tokens.to(torch.int64).cpu()
        copies = []
        if old % bs:
            last = old // bs
            for b in range(table.batch_size):
                block = int(table.blocks[b, last])
                if self.pool.is_writable(block):
                    # about to change: its trie key would no longer describe it
                    self.trie.remove([block])
                else:
                    fresh = self.pool.allocate(1)
                    copies.append((block, int(fresh)))
                    # count stays >= 1: the source survives until the store has copied it
                    self.pool.release(torch.tensor([block]))
                    table.blocks[b, last] = fresh
        new = math.ceil((old + tokens.shape[1]) / bs) - table.blocks.shape[1]
        if new:
            fresh = self.pool.allocate(table.batch_size * new)
            # [B, new]: each row's new blocks, in order
            table.blocks = torch.cat([table.blocks, fresh.view(table.batch_size, new)], 1)
        table.tokens = torch.cat([table.tokens, tokens], 1)
        self._record_peak(table)
        return AppendPlan(
            torch.tensor(copies, dtype=torch.int64).view(-1, 2),
            self.slots(table, old, table.length),
        )

    def commit(self, table: BlockTables, start: int) -> None:
        """Index the blocks that became full since length `start`, sharing equal ones.

        Call after the appended KV is written (the shared block's KV equals the row's own).
        """
        bs = self.block_size
        for j in range(start // bs, table.length // bs):
            for b in range(table.batch_size):
                block = int(table.blocks[b, j])
                if block in self.trie:
                    continue
                parent = int(table.blocks[b, j - 1]) if j else ROOT
                key = tuple(table.tokens[b, j * bs : (j + 1) * bs].tolist())
                twin = self.trie.lookup(parent, key)
                if twin is None:
                    self.trie.insert(block, parent, key)
                    continue
                self.pool.share(torch.tensor([twin]))
                self.trie.remove(self.pool.release(torch.tensor([block])))
                table.blocks[b, j] = twin
        self._record_peak(table)

    def slots(self, table: BlockTables, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """[B, stop - start] int64 flat slots of positions start .. stop-1 of every row."""
        stop = table.length if stop is None else stop
        positions = torch.arange(start, stop)
        # [B, stop - start]: block of each position, times block size, plus offset
        return table.blocks[:, positions // self.block_size] * self.block_size + positions % self.block_size

    def select(self, table: BlockTables, rows: torch.Tensor) -> None:
        """Row i becomes a copy of old row rows[i] ([B'] int64): pointers copied, counts adjusted."""
        self._check_open(table)
        rows = rows.to(torch.int64).cpu()
        # [B', M]
        chosen = table.blocks[rows]
        # share first: a block kept by some row must not touch 0 in between
        self.pool.share(chosen)
        self.trie.remove(self.pool.release(table.blocks))
        table.blocks, table.tokens = chosen, table.tokens[rows]
        self._record_peak(table)

    def truncate(self, table: BlockTables, length: int) -> None:
        """Keep the first `length` positions of every row; later blocks return their references."""
        self._check_open(table)
        kept = math.ceil(length / self.block_size)
        # a last kept block left partial stays indexed until a row writes into it (`append`)
        self.trie.remove(self.pool.release(table.blocks[:, kept:]))
        table.blocks, table.tokens = table.blocks[:, :kept].clone(), table.tokens[:, :length].clone()

    def release(self, table: BlockTables) -> None:
        """Return every reference the table holds. Safe to call twice."""
        if table.closed:
            return
        self.trie.remove(self.pool.release(table.blocks))
        table.blocks = table.blocks[:, :0]
        table.closed = True

    def memory(self, table: BlockTables) -> dict:
        """Statistics of the pool as seen by this table, in blocks and bytes."""
        return {
            "block_size": self.block_size,
            "live_blocks": self.pool.live,
            "shared_blocks": self.pool.shared,
            "pool_blocks": self.pool.capacity,
            "live_bytes": self.pool.live * self.bytes_per_block,
            "peak_bytes": table.peak_live_blocks * self.bytes_per_block,
            "naive_peak_bytes": table.naive_peak_tokens * self.bytes_per_block // self.block_size,
        }

    def check_invariants(self, *tables: BlockTables) -> None:
        """Raise AssertionError if an invariant of the pool, the trie or the given open tables fails."""
        self.pool.check_invariants()
        self.trie.check_invariants(self.pool)
        listings = torch.zeros(self.pool.capacity, dtype=torch.int64)
        for table in tables:
            if table.closed:
                continue
            blocks = table.blocks
            assert blocks.shape == (table.batch_size, math.ceil(table.length / self.block_size))
            listings.index_add_(0, blocks.reshape(-1), torch.ones(blocks.numel(), dtype=torch.int64))
            bs = self.block_size
            for b, j in ((b, j) for b in range(blocks.shape[0]) for j in range(blocks.shape[1])):
                block = int(blocks[b, j])
                if block not in self.trie:
                    continue
                if j > 0:
                    assert self.trie.parent(block) == int(blocks[b, j - 1]), f"row {b} column {j}: trie parent differs"
                held = tuple(table.tokens[b, j * bs : (j + 1) * bs].tolist())
                assert self.trie.tokens(block)[: len(held)] == held, f"row {b} column {j}: indexed under other tokens"
        for block in listings.nonzero().flatten().tolist():
            assert self.pool.count(block) >= int(listings[block]), f"block {block} listed beyond its count"
        self._check_one_block_per_prefix(tables)

    def _check_one_block_per_prefix(self, tables: tuple[BlockTables, ...]) -> None:
        """Assert the module's last invariant: full prefixes and their blocks are one to one."""
        bs = self.block_size
        # full prefix -> the block holding its last block_size positions
        block_of: dict[tuple[int, ...], int] = {}
        # block -> (its column, the longest prefix through it listed so far)
        path_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        for t, table in enumerate(tables):
            if table.closed:
                continue
            for b, (row, tokens) in enumerate(zip(table.blocks.tolist(), table.tokens.tolist())):
                for j, block in enumerate(row):
                    where, prefix = f"table {t} row {b} column {j}", tuple(tokens[: (j + 1) * bs])
                    if len(prefix) == (j + 1) * bs:
                        first = block_of.setdefault(prefix, block)
                        assert first == block, f"{where}: one full prefix in two blocks, {first} and {block}"
                        assert block in self.trie, f"{where}: full block {block} is not in the trie"
                    column, longest = path_of.setdefault(block, (j, prefix))
                    short, long = sorted((prefix, longest), key=len)
                    assert column == j and long[: len(short)] == short, f"{where}: block {block} holds two prefixes"
                    path_of[block] = (j, long)

    def _record_peak(self, table: BlockTables) -> None:
        table.peak_live_blocks = max(table.peak_live_blocks, self.pool.live)
        table.naive_peak_tokens = max(table.naive_peak_tokens, table.batch_size * table.length)

    @staticmethod
    def _check_open(table: BlockTables) -> None:
        if table.closed:
            raise ValueError("these block tables were released")
