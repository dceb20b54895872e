"""A growable pool of KV block ids and their reference counts: the one place refcounts change.

The refcount contract (every transition is one method):

- `allocate(n)`: n free blocks leave the pool with count 1;
- `share(blocks)`: every listed block gains 1 (a fork or a resampling copied its pointer);
- `release(blocks)`: every listed block loses 1; a block reaching 0 returns to the free list;
- `is_writable(block)`: a block may be written only while its count is exactly 1.

A block listed k times in `share` or `release` changes by k: the updates use `index_add_`, which
accumulates repeated indices (fancy-index `+=` would count them once).

Invariants (`check_invariants`):
- every count is >= 0;
- the free list holds exactly the blocks whose count is 0, each once;
- live + free == capacity; peak_live >= live.

The pool holds ids only; the KV bytes live in a store indexed by the same ids, which grows when
`capacity` does. Dimension letter: P, pool blocks (the capacity).
"""

from __future__ import annotations

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
        self.peak_live = 0

    @property
    def capacity(self) -> int:
        """P, the number of block ids (live and free)."""
        return self._counts.numel()

    @property
    def live(self) -> int:
        """Blocks with a count of at least 1."""
        return self.capacity - len(self._free)

    @property
    def shared(self) -> int:
        """Blocks with a count of at least 2 (held by more than one path)."""
        return int((self._counts > 1).sum())

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
        """Add 1 to the count of every listed block (repeats add once per listing).

        Raises:
            ValueError: if a listed block is free (a pointer to it would dangle).
        """
        blocks = blocks.reshape(-1)
        if blocks.numel() and bool((self._counts[blocks] == 0).any()):
            raise ValueError("cannot share a free block")
        self._counts.index_add_(0, blocks, torch.ones_like(blocks))

    def release(self, blocks: torch.Tensor) -> torch.Tensor:
        """Subtract 1 from the count of every listed block; blocks reaching 0 become free.

        Returns:
            [f] int64 ids of the blocks freed by this call.

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
        freed = touched[after[touched] == 0]
        self._free.extend(freed.tolist())
        return freed

    def is_writable(self, block: int) -> bool:
        """Whether `block` is held by exactly one path, so writing it changes no one else."""
        return self.count(block) == 1

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        self._counts = torch.cat([self._counts, torch.zeros(capacity - old, dtype=torch.int64)])
        self._free[:0] = range(capacity - 1, old - 1, -1)

    def check_invariants(self) -> None:
        """Raise AssertionError if a listed invariant fails."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert bool((self._counts >= 0).all()), "a negative count"
        zero = set((self._counts == 0).nonzero().flatten().tolist())
        assert free == zero, f"free list {sorted(free)} != zero-count blocks {sorted(zero)}"
        assert self.peak_live >= self.live, "peak below the live count"
