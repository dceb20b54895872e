"""The KV-cache manager: block tables of rows over one model's pool and trie.

Each row (particle) holds a path: a block table listing the blocks that hold its KV, position p
living in block `blocks[b, p // block_size]` at offset `p % block_size`, i.e. at flat slot

    slot(b, p) = blocks[b, p // block_size] · block_size + p % block_size.

The manager never sees KV values: it hands out slots to write and to read, and a list of block
copies the store must make first (copy on write). So the same bookkeeping can run without a
model (a dry run) and measure exact block counts.

Rows may differ in length (several requests in one batch): row b holds `lengths[b]` tokens and
ceil(lengths[b] / block_size) blocks; the tensors are as wide as the longest row and PAD (-1)
past a row's own entries. Rows of one length have no PAD, as before.

- open: one row for the prompt, written once; `select` then forks it to N rows.
- open_shared / join: a row for another prompt that shares the indexed blocks of its longest
  full-block prefix instead of writing them again, then joined to an existing table's rows.
- select(rows): row i takes row rows[i]'s table; shares and releases adjust counts (pointer copies).
- append: a row writing into a shared, partially filled last block first copies it to a block of
  its own (copy on write); new blocks are allocated as rows grow.
- commit: blocks that became full are indexed in the trie; a row whose new full block equals an
  indexed one (same parent, same tokens) points at that one and frees its own.
- truncate / truncate_rows / release: blocks past the kept length return their references.

Prefix cache. A full indexed block whose last reference `select` or `release` returns stays in the
trie with its KV, cached (`BlockPool.release`'s `keep`), so a later prompt holding the same
tokens shares it instead of computing it again (`open_shared`, and `commit`'s merge): a system
prompt, a document asked about twice, the turns of a conversation. The pool grows for cached
blocks up to `cache_blocks`; past that size, an allocation that finds too few free blocks evicts
the least recently cached ones (dropping them from the trie) before the pool grows, so the cache
never takes more than that memory. Blocks of one release are cached deepest first, so a block is
evicted before its parent: every indexed block's parent is live or cached. A truncation's blocks
(rejected drafts) are freed, not cached.

A block that a truncation leaves partial stays indexed: nothing has written it, so its KV is
still its key's, the truncated row reads only its first positions (whose KV is the row's own),
and other rows may hold it full. The row stops pointing at it at its next append, the only
moment its contents would part from the key's: it copies a shared block on write, or, as the
block's only holder, drops it and its cached descendants from the index and writes in place.
When the row fills the block again, commit merges it into the indexed block with the same key, if
there is one.

Invariants of a `BlockTables` (checked by `check_invariants` with the pool's and trie's own,
between operations, i.e. after each append's commit):
- `blocks` is [B, ceil(max length / block_size)] and `tokens` is [B, max length]; row b lists
  its ceil(lengths[b] / block_size) blocks and its lengths[b] tokens first, PAD after them;
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

#: the entry of `blocks` and `tokens` past a row's own
PAD = -1


@dataclass
class BlockTables:
    """The paths of B rows.

    Attributes:
        blocks: [B, M] int64 block ids, M = ceil(max length / block_size), PAD past a row's own.
        tokens: [B, S] int64 token ids, S = the longest row's length, PAD past a row's own.
        lengths: [B] int64 tokens held by each row (None at construction: the width of tokens).
        peak_live_blocks: the pool's largest live count seen after this table's operations.
        naive_peak_tokens: the largest sum of the rows' lengths seen: positions a cache holding
            one full copy per row would need.
    """

    blocks: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor | None = None
    peak_live_blocks: int = 0
    naive_peak_tokens: int = 0
    closed: bool = field(default=False)

    def __post_init__(self):
        if self.lengths is None:
            self.lengths = torch.full((self.tokens.shape[0],), self.tokens.shape[1], dtype=torch.int64)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        """The rows' common length.

        Raises:
            ValueError: when rows differ in length (read `lengths`).
        """
        if self.batch_size and bool((self.lengths != self.tokens.shape[1]).any()):
            raise ValueError("these rows differ in length; read lengths")
        return self.tokens.shape[1]

    @property
    def ragged(self) -> bool:
        """Whether some row is shorter than the longest."""
        return bool((self.lengths != self.tokens.shape[1]).any())

    def token_lists(self) -> list[list[int]]:
        """Every row's own token ids."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths.tolist())]


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
        cache_blocks: the pool size up to which it grows rather than evict cached blocks (0:
            cached blocks make room whenever free ones run out).
    """

    def __init__(self, block_size: int, bytes_per_block: int, capacity: int = 64, cache_blocks: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if cache_blocks < 0:
            raise ValueError(f"cache_blocks must be at least 0, got {cache_blocks}")
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.cache_blocks = cache_blocks
        self.pool = BlockPool(capacity)
        self.trie = TokenTrie()

    def open(self, prompt: list[int]) -> tuple[BlockTables, AppendPlan]:
        """One row holding nothing yet, and the plan to write the prompt's KV into it."""
        table = BlockTables(torch.empty(1, 0, dtype=torch.int64), torch.empty(1, 0, dtype=torch.int64))
        return table, self.append(table, torch.tensor([prompt], dtype=torch.int64))

    def open_shared(self, prompt: list[int]) -> tuple[BlockTables, AppendPlan]:
        """One row for `prompt` that shares the blocks already holding its prefix.

        The row lists the indexed blocks of the prompt's longest prefix of full blocks that
        leaves its last token out (the caller needs the logits after it, so at least that
        position is computed); they are shared, not written again. The plan writes the rest:
        its slots are [1, L], the prompt's last L positions.
        """
        bs, parent, shared = self.block_size, ROOT, []
        for j in range((len(prompt) - 1) // bs):
            twin = self.trie.lookup(parent, tuple(prompt[j * bs : (j + 1) * bs]))
            if twin is None:
                break
            shared.append(twin)
            parent = twin
        blocks = torch.tensor([shared], dtype=torch.int64).view(1, -1)
        self.pool.share(blocks)
        table = BlockTables(blocks, torch.tensor([prompt[: len(shared) * bs]], dtype=torch.int64).view(1, -1))
        return table, self.append(table, torch.tensor([prompt[len(shared) * bs :]], dtype=torch.int64))

    def join(self, table: BlockTables, other: BlockTables) -> None:
        """Append the rows of `other` after those of `table`; its references move over and
        `other` is closed."""
        self._check_open(table)
        self._check_open(other)
        width = max(table.blocks.shape[1], other.blocks.shape[1])
        length = max(table.tokens.shape[1], other.tokens.shape[1])
        table.blocks = torch.cat([_pad_columns(table.blocks, width), _pad_columns(other.blocks, width)])
        table.tokens = torch.cat([_pad_columns(table.tokens, length), _pad_columns(other.tokens, length)])
        table.lengths = torch.cat([table.lengths, other.lengths])
        table.peak_live_blocks = max(table.peak_live_blocks, other.peak_live_blocks)
        other.blocks, other.closed = other.blocks[:, :0], True
        self._record_peak(table)

    def append(self, table: BlockTables, tokens: torch.Tensor, counts: torch.Tensor | None = None) -> AppendPlan:
        """Make room for `tokens` [B, L] int64 at the end of every row and record them; row b
        gets its first counts[b] tokens (all L by default; 0 leaves it as it is) at positions
        lengths[b] .. lengths[b] + counts[b] - 1.

        Returns:
            The plan: block copies (copy on write of shared partial last blocks), then the slots
            where the new positions' KV must be written (-1 in a column past counts[b]: nothing
            is written there). Call `commit` once they are written.
        """
        self._check_open(table)
        bs, old = self.block_size, table.lengths.clone()
        tokens = tokens.to(torch.int64).cpu()
        counts = torch.full_like(old, tokens.shape[1]) if counts is None else counts.to(torch.int64).cpu()
        copies = self._own_last_blocks(table, ((old % bs != 0) & (counts > 0)).nonzero().flatten())
        new_lengths = old + counts
        have, need = _blocks_for(old, bs), _blocks_for(new_lengths, bs)
        table.blocks = _pad_columns(table.blocks, int(need.max()))
        table.tokens = _pad_columns(table.tokens, int(new_lengths.max()))
        count = need - have
        if int(count.sum()):
            fresh = self._allocate(int(count.sum()))
            offsets = torch.arange(int(count.max()))
            # [B, max count] bool: each row's new columns; row-major, so each row takes its new
            # blocks in order
            taken = offsets[None, :] < count[:, None]
            rows = torch.arange(table.batch_size)[:, None].expand_as(taken)[taken]
            table.blocks[rows, (have[:, None] + offsets[None, :])[taken]] = fresh
        # [B, L]: the columns each row keeps, and every column's position in its row
        real = torch.arange(tokens.shape[1])[None, :] < counts[:, None]
        positions = old[:, None] + torch.arange(tokens.shape[1])[None, :]
        table.tokens[real.nonzero(as_tuple=True)[0], positions[real]] = tokens[real]
        table.lengths = new_lengths
        self._record_peak(table)
        # [B, L]: the new positions' slots, -1 past each row's count
        slots = torch.full_like(positions, -1)
        if bool(real.any()):
            slots[real] = self._slots_at(table, positions.masked_fill(~real, 0))[real]
        return AppendPlan(copies, slots)

    def _own_last_blocks(self, table: BlockTables, rows: torch.Tensor) -> torch.Tensor:
        """Make the partial last block of each listed row its own before the row writes into it
        (copy on write), for all rows at once.

        Taken row by row in order, a row finds its block's count c lowered by the holders before
        it that copied; so among the r-th holder (r = 0, 1, ...) of a block in this call, the one
        with c - r = 1 writes in place (the last holder, when no one else holds the block) and
        every other takes a fresh copy and gives one reference back (the source keeps a count of
        at least 1 until the store has copied it).

        Args:
            rows: [R] int64 rows whose next token lands in a partial last block.

        Returns:
            [C, 2] int64 (source, fresh) block copies for the store.
        """
        if rows.numel() == 0:
            return torch.empty(0, 2, dtype=torch.int64)
        last = table.lengths[rows] // self.block_size
        blocks = table.blocks[rows, last]
        # [R]: each row's rank among the rows holding its block (rows in ascending order)
        ordered, order = torch.sort(blocks, stable=True)
        first = torch.searchsorted(ordered, ordered)
        rank = torch.empty_like(rows)
        rank[order] = torch.arange(rows.numel()) - first
        in_place = self.pool.counts(blocks) - rank == 1
        # about to change: their trie keys would no longer describe them, nor their cached
        # descendants' (no row holds those: a row holding one would hold this block too)
        self._unindex(blocks[in_place].tolist())
        sources = blocks[~in_place]
        if sources.numel() == 0:
            return torch.empty(0, 2, dtype=torch.int64)
        fresh = self._allocate(sources.numel())
        self.pool.release(sources)
        table.blocks[rows[~in_place], last[~in_place]] = fresh
        return torch.stack([sources, fresh], 1)

    def commit(self, table: BlockTables, start) -> None:
        """Index the blocks that became full since length `start`, sharing equal ones.

        Args:
            start: the rows' length before the append, an int or [B] int64 (one per row).

        Call after the appended KV is written (the shared block's KV equals the row's own).
        """
        bs, batch = self.block_size, table.batch_size
        first = torch.as_tensor(start, dtype=torch.int64).expand(batch) // bs
        columns = torch.arange(table.blocks.shape[1])
        # [B, W]: the blocks that became full; their (column, row) pairs, column after column
        fresh = (columns[None, :] >= first[:, None]) & (columns[None, :] < (table.lengths // bs)[:, None])
        at_column, at_row = fresh.T.nonzero(as_tuple=True)
        # read once: each fresh block, its parent and its tokens
        blocks = table.blocks[at_row, at_column].tolist()
        parents = torch.where(at_column > 0, table.blocks[at_row, (at_column - 1).clamp(min=0)], ROOT).tolist()
        keys = table.tokens[at_row[:, None], at_column[:, None] * bs + torch.arange(bs)].tolist()
        # blocks replaced by an equal indexed twin: (row, column) -> twin
        twins: dict[tuple[int, int], int] = {}
        dropped = []
        for b, j, block, parent, key in zip(at_row.tolist(), at_column.tolist(), blocks, parents, keys):
            if block in self.trie:
                continue
            parent = twins.get((b, j - 1), parent)
            twin = self.trie.lookup(parent, tuple(key))
            if twin is None:
                self.trie.insert(block, parent, tuple(key))
                continue
            twins[(b, j)] = twin
            dropped.append(block)
        if twins:
            # share first: a twin must not touch 0 in between
            self.pool.share(torch.tensor(list(twins.values())))
            self._release(torch.tensor(dropped))
            rows, cols = zip(*twins)
            table.blocks[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(list(twins.values()))
        self._record_peak(table)

    def slots(self, table: BlockTables, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """[B, stop - start] int64 flat slots of positions start .. stop-1 of every row (stop:
        the longest row's length). A position past a row's length reads some valid slot, which
        the caller must mask."""
        stop = table.tokens.shape[1] if stop is None else stop
        return self._slots_at(table, torch.arange(start, stop).expand(table.batch_size, -1))

    def select(self, table: BlockTables, rows: torch.Tensor) -> None:
        """Row i becomes a copy of old row rows[i] ([B'] int64): pointers copied, counts adjusted."""
        self._check_open(table)
        rows = rows.to(torch.int64).cpu()
        # [B', M]
        chosen = table.blocks[rows]
        # share first: a block kept by some row must not touch 0 in between
        self.pool.share(chosen[chosen != PAD])
        self._release(table.blocks[table.blocks != PAD])
        table.blocks, table.tokens, table.lengths = chosen, table.tokens[rows], table.lengths[rows]
        self._trim(table)
        self._record_peak(table)

    def truncate(self, table: BlockTables, length: int) -> None:
        """Keep the first `length` positions of every row; later blocks return their references."""
        self.truncate_rows(table, torch.full((table.batch_size,), length, dtype=torch.int64))

    def truncate_rows(self, table: BlockTables, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] positions of row b ([B] int64, at most its length; 0 empties
        the row); later blocks return their references."""
        self._check_open(table)
        lengths = lengths.to(torch.int64).cpu()
        kept = _blocks_for(lengths, self.block_size)
        # [B, M]: columns past each row's kept blocks
        cut = torch.arange(table.blocks.shape[1])[None, :] >= kept[:, None]
        # a last kept block left partial stays indexed until a row writes into it (`append`)
        self._release(table.blocks[cut & (table.blocks != PAD)], cache=False)
        table.blocks = table.blocks.masked_fill(cut, PAD)
        table.tokens = table.tokens.masked_fill(torch.arange(table.tokens.shape[1])[None, :] >= lengths[:, None], PAD)
        table.lengths = lengths.clone()
        self._trim(table)

    def release(self, table: BlockTables) -> None:
        """Return every reference the table holds. Safe to call twice."""
        if table.closed:
            return
        self._release(table.blocks[table.blocks != PAD])
        table.blocks = table.blocks[:, :0]
        table.closed = True

    def drop_cache(self) -> None:
        """Evict every cached block: later prompts share only what live rows hold."""
        self.trie.remove(self.pool.evict(self.pool.cached))

    def _allocate(self, n: int) -> torch.Tensor:
        """n blocks with count 1: free ones, then (once the pool holds `cache_blocks`) evicted
        cached ones, then new ones."""
        if self.pool.capacity >= self.cache_blocks:
            self.trie.remove(self.pool.evict(n - self.pool.free))
        return self.pool.allocate(n)

    def _release(self, blocks: torch.Tensor, cache: bool = True) -> None:
        """Return one reference per listed block. With `cache`, indexed blocks reaching 0 are
        cached, deepest first (evicted before their parents), the rest freed; without it every
        block reaching 0 is freed and leaves the trie with its cached descendants."""
        if cache:
            self.trie.remove(self.pool.release(blocks, keep=self._cacheable).tolist())
            return
        self._unindex(self.pool.release(blocks).tolist())

    def _unindex(self, blocks: list[int]) -> None:
        """Drop blocks from the trie with their cached descendants, which return to the free list
        (their keys name a parent whose KV is about to change or go)."""
        below = {child for block in blocks if block in self.trie for child in self.trie.descendants(block)}
        self.trie.remove([*blocks, *self.pool.uncache([block for block in below if self.pool.is_cached(block)])])

    def _cacheable(self, idle: list[int]) -> list[int]:
        """The indexed blocks among `idle`, in eviction order (deepest first)."""
        return sorted((block for block in idle if block in self.trie), key=self.trie.depth, reverse=True)

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

    def rows_memory(self, table: BlockTables, rows: torch.Tensor, owners: torch.Tensor, count: int) -> list[dict]:
        """The bytes each owner's rows hold: their distinct blocks (`live_bytes`) and their
        positions as full copies (`naive_bytes`), for all owners in one pass.

        Args:
            rows: [R] int64 rows of `table`; owners: [R] int64 in [0, count), whose each is.

        Returns:
            one dict per owner.
        """
        blocks = table.blocks[rows]
        held = blocks != PAD
        # distinct (owner, block) pairs, as owner · P + block
        capacity = self.pool.capacity
        pairs = torch.unique(owners[:, None].expand_as(blocks)[held] * capacity + blocks[held])
        distinct = torch.bincount(pairs // capacity, minlength=count).tolist()
        positions = torch.zeros(count, dtype=torch.int64).index_add_(0, owners, table.lengths[rows]).tolist()
        return [{"live_bytes": d * self.bytes_per_block, "naive_bytes": p * self.bytes_per_block // self.block_size} for d, p in zip(distinct, positions)]

    def check_invariants(self, *tables: BlockTables) -> None:
        """Raise AssertionError if an invariant of the pool, the trie or the given open tables fails."""
        self.pool.check_invariants()
        self.trie.check_invariants(self.pool)
        listings = torch.zeros(self.pool.capacity, dtype=torch.int64)
        for table in tables:
            if table.closed:
                continue
            blocks, bs = table.blocks, self.block_size
            longest = int(table.lengths.max()) if table.batch_size else 0
            assert table.tokens.shape == (table.batch_size, longest), "tokens are not as wide as the longest row"
            assert blocks.shape == (table.batch_size, math.ceil(longest / bs)), "blocks are not as wide as the longest row"
            widths = _blocks_for(table.lengths, bs)
            assert bool(((blocks != PAD) == (torch.arange(blocks.shape[1])[None, :] < widths[:, None])).all()), "a row's blocks are not its first entries"
            assert bool(((table.tokens != PAD) == (torch.arange(longest)[None, :] < table.lengths[:, None])).all()), "a row's tokens are not its first entries"
            listed = blocks[blocks != PAD]
            listings.index_add_(0, listed, torch.ones(listed.numel(), dtype=torch.int64))
            for b, width in enumerate(widths.tolist()):
                for j in range(width):
                    block = int(blocks[b, j])
                    if block not in self.trie:
                        continue
                    if j > 0:
                        assert self.trie.parent(block) == int(blocks[b, j - 1]), f"row {b} column {j}: trie parent differs"
                    held = tuple(table.tokens[b, j * bs : min((j + 1) * bs, int(table.lengths[b]))].tolist())
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
            for b, (row, tokens) in enumerate(zip(table.blocks.tolist(), table.token_lists())):
                for j, block in enumerate(row[: math.ceil(len(tokens) / bs)]):
                    where, prefix = f"table {t} row {b} column {j}", tuple(tokens[: (j + 1) * bs])
                    if len(prefix) == (j + 1) * bs:
                        first = block_of.setdefault(prefix, block)
                        assert first == block, f"{where}: one full prefix in two blocks, {first} and {block}"
                        assert block in self.trie, f"{where}: full block {block} is not in the trie"
                    column, longest = path_of.setdefault(block, (j, prefix))
                    short, long = sorted((prefix, longest), key=len)
                    assert column == j and long[: len(short)] == short, f"{where}: block {block} holds two prefixes"
                    path_of[block] = (j, long)

    def _slots_at(self, table: BlockTables, positions: torch.Tensor) -> torch.Tensor:
        """[B, L] int64 flat slots of the positions [B, L] of every row; a position in no block
        of its row reads block 0 (valid, masked by the caller)."""
        bs = self.block_size
        if positions.numel() == 0:
            return positions.clone()
        blocks = table.blocks.gather(1, positions // bs).clamp(min=0)
        return blocks * bs + positions % bs

    def _trim(self, table: BlockTables) -> None:
        """Drop the columns past the longest row."""
        longest = int(table.lengths.max()) if table.batch_size else 0
        table.tokens = table.tokens[:, :longest]
        table.blocks = table.blocks[:, : math.ceil(longest / self.block_size)]

    def _record_peak(self, table: BlockTables) -> None:
        table.peak_live_blocks = max(table.peak_live_blocks, self.pool.live)
        table.naive_peak_tokens = max(table.naive_peak_tokens, int(table.lengths.sum()))

    @staticmethod
    def _check_open(table: BlockTables) -> None:
        if table.closed:
            raise ValueError("these block tables were released")


def _blocks_for(lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B] int64 blocks that hold rows of these lengths: ceil(lengths / block_size)."""
    return (lengths + block_size - 1) // block_size


def _pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] int64: `values` [B, w <= width] with PAD columns added on the right."""
    if values.shape[1] >= width:
        return values
    return torch.cat([values, values.new_full((values.shape[0], width - values.shape[1]), PAD)], 1)
