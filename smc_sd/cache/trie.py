"""The token trie: full KV blocks indexed by (parent block, the block's token ids).

A block's KV depends only on its tokens and on every token before it, that is on its own tokens
and its parent block (the block before it on the path, itself determined the same way). So two
paths whose full blocks have equal keys hold equal KV, and the second can point at the first's
block instead of keeping its own: equal prefixes share blocks even when they arose separately.

Only full blocks are indexed (a partial block still changes). A block leaves the index when it is
freed or evicted from the pool's cache, or when its only holder is about to write into it (after
a truncation made it partial; its cached descendants leave with it); until then a row that a
truncation left holding its first positions reads it like any other.

Invariants (`check_invariants`):
- `node[block] = (parent, tokens)` exactly when `child[(parent, tokens)] = block`;
- `children[block]` is the set of indexed blocks whose parent is `block` (absent when empty);
- every indexed block is live or cached in the pool, and so is its parent (ROOT stands for "no
  parent").
"""

from __future__ import annotations

from smc_sd.cache.pool import BlockPool

ROOT = -1


class TokenTrie:
    """Maps (parent block, token ids) to the block holding their KV."""

    def __init__(self):
        self._child: dict[tuple[int, tuple[int, ...]], int] = {}
        self._node: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._children: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._node)

    def __contains__(self, block: int) -> bool:
        return block in self._node

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> int | None:
        """The indexed block after `parent` holding `tokens`, or None."""
        return self._child.get((parent, tokens))

    def insert(self, block: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Index a full block; its key must be new and the block not yet indexed."""
        key = (parent, tokens)
        if key in self._child or block in self._node:
            raise ValueError(f"block {block} or its key is already indexed")
        self._child[key] = block
        self._node[block] = key
        self._children.setdefault(parent, set()).add(block)

    def remove(self, blocks: list[int]) -> None:
        """Drop the listed blocks from the index (those not indexed are ignored)."""
        for block in blocks:
            key = self._node.pop(block, None)
            if key is not None:
                del self._child[key]
                siblings = self._children[key[0]]
                siblings.discard(block)
                if not siblings:
                    del self._children[key[0]]

    def parent(self, block: int) -> int:
        """The parent of an indexed block (ROOT for a first block)."""
        return self._node[block][0]

    def descendants(self, block: int) -> list[int]:
        """The indexed blocks below `block` on any path, children before their own children."""
        found, frontier = [], [block]
        while frontier:
            frontier = [child for parent in frontier for child in self._children.get(parent, ())]
            found += frontier
        return found

    def depth(self, block: int) -> int:
        """How many indexed blocks lie above an indexed block on its path (0 for a first block)."""
        depth, parent = 0, self.parent(block)
        while parent != ROOT:
            depth, parent = depth + 1, self.parent(parent)
        return depth

    def tokens(self, block: int) -> tuple[int, ...]:
        """The token ids an indexed block is keyed by."""
        return self._node[block][1]

    def edges(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(parent, block, tokens) for every indexed block, parents ROOT or block ids."""
        return [(parent, block, tokens) for block, (parent, tokens) in self._node.items()]

    def to_networkx(self):
        """The trie as a networkx DiGraph for inspection: an edge parent -> block per indexed
        block, carrying its `tokens`; node ROOT (-1) is the empty prefix."""
        import networkx

        graph = networkx.DiGraph()
        graph.add_node(ROOT)
        for parent, block, tokens in self.edges():
            graph.add_edge(parent, block, tokens=tokens)
        return graph

    def check_invariants(self, pool: BlockPool) -> None:
        """Raise AssertionError if a listed invariant fails."""
        assert len(self._child) == len(self._node), "child and node maps differ in size"
        children: dict[int, set[int]] = {}
        for block, key in self._node.items():
            assert self._child.get(key) == block, f"block {block}'s key maps elsewhere"
            parent = key[0]
            children.setdefault(parent, set()).add(block)
            for held in (block, parent) if parent != ROOT else (block,):
                assert pool.count(held) > 0 or pool.is_cached(held), f"indexed block {held} is free"
        assert children == self._children, "the children sets differ from the index"
