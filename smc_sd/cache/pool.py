"""A growable pool of KV block ids and their reference counts: the one place refcounts change.

The refcount contract (every transition is one method):

- `allocate(n)`: n free blocks leave the pool with count 1;
- `share(blocks)`: every listed block gains 1 (a fork or a resampling copied its pointer); a
  cached block listed comes back with its count;
- `release(blocks, keep)`: every listed block loses 1; a block reaching 0 returns to the free
  list, or, where `keep` names it, becomes cached: its KV is kept for a later prompt that holds
  the same tokens, and it counts as neither live nor free;
- `evict(n)`, `uncache(blocks)`: the n least recently cached blocks, or the listed ones, return
  to the free list (their owner drops them from its index); `allocate` never takes a cached
  block;
- `is_writable(block)`: a block may be written only while its count is exactly 1.

A block listed k times in `share` or `release` changes by k: the updates use `index_add_`, which
accumulates repeated indices (fancy-index `+=` would count them once).

Invariants (`check_invariants`):
- every count is >= 0;
- the free list and the cache hold exactly the blocks whose count is 0, each once, in one of them;
- live + cached + free == capacity; peak_live >= live.

The pool holds ids only; the KV bytes live in a store indexed by the same ids, which grows when
`capacity` does. Dimension letter: P, pool blocks (the capacity).
"""

from __future__ import annotations

import itertools

import torch


class BlockPool:
    """Reference-counted block ids 0 .. P-1.

    Args:
        capacity: initial P >= 1; doubled whenever an allocation finds too few free blocks.
    """

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        # [P] int64 reference counts
        self._counts = torch.zeros(capacity, dtype=torch.int64)
        # popped from the end, so low ids are handed out first
        self._free = list(range(capacity - 1, -1, -1))
        # count-0 blocks whose KV is kept, least recently cached first (a dict keeps that order)
        self._cached: dict[int, None] = {}
        self.peak_live = 0

    @property
    def capacity(self) -> int:
        """P, the number of block ids (live and free)."""
        return self._counts.numel()

    @property
    def live(self) -> int:
        """Blocks with a count of at least 1."""
        return self.capacity - len(self._free) - len(self._cached)

    @property
    def free(self) -> int:
        """Blocks on the free list (neither live nor cached)."""
        return len(self._free)

    @property
    def cached(self) -> int:
        """Blocks with a count of 0 whose KV is kept (`release`'s `keep`)."""
        return len(self._cached)

    def is_cached(self, block: int) -> bool:
        """Whether `block` is cached (count 0, KV kept)."""
        return block in self._cached

    @property
    def shared(self) -> int:
        """Blocks with a count of at least 2 (held by more than one path)."""
        return int((self._counts > 1).sum())

    def counts(self, blocks: torch.Tensor) -> torch.Tensor:
        """The reference counts of the listed blocks ([n] int64)."""
        return self._counts[blocks]

    def count(self, block: int) -> int:
        """The reference count of one block."""
        return int(self._counts[block])

    def allocate(self, n: int) -> torch.Tensor:
        """Take n free blocks, each with count 1, growing the pool if needed.

        Returns:
            [n] int64 block ids.
        """
        if len(self._free) < n:
            self._grow(max(2 * self.capacity, self.live + n))
        taken = [self._free.pop() for _ in range(n)]
        blocks = torch.tensor(taken, dtype=torch.int64)
        self._counts[blocks] = 1
        self.peak_live = max(self.peak_live, self.live)
        return blocks

    def share(self, blocks: torch.Tensor) -> None:
        """Add 1 to the count of every listed block (repeats add once per listing); a cached
        block listed leaves the cache.

        Raises:
            ValueError: if a listed block is free (a pointer to it would dangle).
        """
        blocks = blocks.reshape(-1)
        if blocks.numel():
            idle = blocks[self._counts[blocks] == 0].tolist()
            if any(block not in self._cached for block in idle):
                raise ValueError("cannot share a free block")
            for block in idle:
                self._cached.pop(block, None)
        self._counts.index_add_(0, blocks, torch.ones_like(blocks))
        self.peak_live = max(self.peak_live, self.live)

    def release(self, blocks: torch.Tensor, keep=None) -> torch.Tensor:
        """Subtract 1 from the count of every listed block; blocks reaching 0 become free, or
        cached where `keep` says so.

        Args:
            keep: a function from the ids reaching 0 to those to cache, in the order they may
                be evicted (first evicted first); None caches none.

        Returns:
            [f] int64 ids of the blocks this call put on the free list.

        Raises:
            ValueError: if a count would fall below 0 (the counts are left unchanged).
        """
        blocks = blocks.reshape(-1)
        if blocks.numel() == 0:
            return blocks
        after = self._counts.clone().index_add_(0, blocks, torch.full_like(blocks, -1))
        if bool((after < 0).any()):
            raise ValueError("released a block more often than it was held")
        self._counts = after
        touched = torch.unique(blocks)
        idle = touched[after[touched] == 0].tolist()
        kept = keep(idle) if keep is not None and idle else []
        self._cached.update(dict.fromkeys(kept))
        freed = [block for block in idle if block not in self._cached]
        self._free.extend(freed)
        return torch.tensor(freed, dtype=torch.int64)

    def evict(self, n: int) -> list[int]:
        """Return up to n of the least recently cached blocks to the free list; their ids."""
        return self.uncache(list(itertools.islice(self._cached, max(n, 0))))

    def uncache(self, blocks: list[int]) -> list[int]:
        """Return the listed cached blocks to the free list; their ids.

        Raises:
            ValueError: if a listed block is not cached.
        """
        if any(block not in self._cached for block in blocks):
            raise ValueError("cannot uncache a block that is not cached")
        for block in blocks:
            del self._cached[block]
        self._free.extend(blocks)
        return blocks

    def is_writable(self, block: int) -> bool:
        """Whether `block` is held by exactly one path, so writing it changes no one else."""
        return self.count(block) == 1

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        self._counts = torch.cat([self._counts, torch.zeros(capacity - old, dtype=torch.int64)])
        self._free[:0] = range(capacity - 1, old - 1, -1)

    def check_invariants(self) -> None:
        """Raise AssertionError if a listed invariant fails."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        assert bool((self._counts >= 0).all()), "a negative count"
        zero = set((self._counts == 0).nonzero().flatten().tolist())
        assert free | cached == zero, f"free list {sorted(free)} and cache {sorted(cached)} != zero-count blocks {sorted(zero)}"
        assert self.peak_live >= self.live, "peak below the live count"
