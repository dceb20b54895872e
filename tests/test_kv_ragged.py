"""The KV-cache manager over rows of different lengths (requests joining one batch): thousands of
random join / extend / select / truncate_rows / release operations against a reference model of
token lists, with the same checks as the equal-length random test (`tests/test_kv_cache.py`): every
row reads back exactly its own prefixes, counts equal listings, and one block per full prefix."""

import random

import pytest
import torch

from smc_sd.cache.manager import PAD, KVCacheManager
from tests.test_kv_cache import prefixes


class RaggedPrefixStore:
    """A stand-in KV store: slot -> the token prefix whose last position it holds."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def apply(self, manager: KVCacheManager, table, plan, starts: list[int]) -> None:
        """Do what the real store does for an append plan (row b appended at starts[b]), then commit."""
        for source, target in plan.copies.tolist():
            for offset in range(self.block_size):
                value = self.slots.get(source * self.block_size + offset)
                if value is not None:
                    self.slots[target * self.block_size + offset] = value
        rows = table.token_lists()
        for b, row_slots in enumerate(plan.slots.tolist()):
            for j, slot in enumerate(row_slots):
                self.slots[slot] = tuple(rows[b][: starts[b] + j + 1])
        manager.commit(table, torch.tensor(starts))

    def read(self, manager: KVCacheManager, table) -> list[list[tuple[int, ...]]]:
        return [[self.slots[s] for s in row[:n]] for row, n in zip(manager.slots(table).tolist(), table.lengths.tolist())]


def check(manager, store, tables, reference):
    manager.check_invariants(*tables)
    listings = torch.zeros(manager.pool.capacity, dtype=torch.int64)
    for table, rows in zip(tables, reference):
        assert table.token_lists() == rows and table.lengths.tolist() == [len(r) for r in rows]
        assert store.read(manager, table) == [prefixes(r) for r in rows]
        listed = table.blocks[table.blocks != PAD]
        listings.index_add_(0, listed, torch.ones_like(listed))
    # the tables are the pool's only users: every count equals its listings exactly
    assert [manager.pool.count(b) for b in range(manager.pool.capacity)] == listings.tolist()
    # all rows of the only table hold the pool's live blocks, each once; full copies at least that
    if len(tables) == 1 and tables[0].batch_size:
        rows = torch.arange(tables[0].batch_size)
        held, = manager.rows_memory(tables[0], rows, torch.zeros_like(rows), 1)
        assert held["live_bytes"] == manager.pool.live * manager.bytes_per_block <= held["naive_bytes"] + manager.bytes_per_block * tables[0].batch_size


def join(manager, store, table, prompt: list[int], count: int) -> None:
    """What `PagedHFSequences.join` does to the tables: a shared-prefix row, forked, joined."""
    other, plan = manager.open_shared(prompt)
    store.apply(manager, other, plan, [len(prompt) - plan.slots.shape[1]])
    manager.select(other, torch.zeros(count, dtype=torch.int64))
    manager.join(table, other)


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_random_ragged_operations_match_reference(block_size):
    rng = random.Random(10 + block_size)
    manager, store = KVCacheManager(block_size, bytes_per_block=block_size, capacity=2), RaggedPrefixStore(block_size)
    tables, reference = [], []
    vocab = 2
    for step in range(1500):
        op = rng.random()
        if not tables or (op < 0.04 and len(tables) < 3):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
            table, plan = manager.open(prompt)
            store.apply(manager, table, plan, [0])
            tables.append(table)
            reference.append([list(prompt)])
            continue
        i = rng.randrange(len(tables))
        table, rows = tables[i], reference[i]
        if op < 0.07:
            manager.release(tables.pop(i))
            reference.pop(i)
        elif op < 0.25:
            # a request joins: often sharing a prefix with a row already held (a system prompt)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            if rng.random() < 0.6:
                shared = rng.choice(rng.choice(reference))
                prompt = shared[: rng.randint(0, len(shared))] + prompt[: rng.randint(1, 3)]
            count = rng.randint(1, 3)
            join(manager, store, table, prompt, count)
            reference[i] = rows + [list(prompt) for _ in range(count)]
        elif op < 0.6:
            steps = rng.randint(1, 4)
            new = [[rng.randrange(vocab) for _ in range(steps)] for _ in rows]
            starts = [len(r) for r in rows]
            # half the time each row keeps its own count of the tokens (blocks of its own length)
            counts = [rng.randint(1, steps) for _ in rows] if rng.random() < 0.5 else [steps] * len(rows)
            plan = manager.append(table, torch.tensor(new), torch.tensor(counts))
            store.apply(manager, table, plan, starts)
            reference[i] = [r + n[:c] for r, n, c in zip(rows, new, counts)]
        elif op < 0.8:
            ancestors = [rng.randrange(len(rows)) for _ in range(rng.randint(1, 6))]
            manager.select(table, torch.tensor(ancestors))
            reference[i] = [list(rows[a]) for a in ancestors]
        else:
            # every row rolls back to its own length (variable acceptance), an empty row included
            lengths = [rng.randint(0 if rng.random() < 0.1 else max(0, len(r) - 2 * block_size), len(r)) for r in rows]
            manager.truncate_rows(table, torch.tensor(lengths))
            reference[i] = [r[:n] for r, n in zip(rows, lengths)]
        if step % 5 == 4:
            check(manager, store, tables, reference)
    check(manager, store, tables, reference)
    for table in tables:
        manager.release(table)
    manager.check_invariants()
    assert manager.pool.live == 0 and len(manager.trie) == manager.pool.cached


def test_a_joined_prompt_shares_the_blocks_of_its_prefix_and_writes_only_the_rest():
    manager, store = KVCacheManager(block_size=2, bytes_per_block=1), RaggedPrefixStore(2)
    system = [1, 2, 3, 4, 5, 6]
    table, plan = manager.open(system + [7])
    store.apply(manager, table, plan, [0])
    live = manager.pool.live
    other, plan = manager.open_shared(system + [0, 0])
    # the three full blocks of the system prompt are shared; only positions 6 and 7 are written
    assert plan.slots.shape == (1, 2) and other.blocks[0, :3].tolist() == table.blocks[0, :3].tolist()
    store.apply(manager, other, plan, [6])
    manager.join(table, other)
    assert manager.pool.live == live + 1 and other.closed
    assert store.read(manager, table) == [prefixes(system + [7]), prefixes(system + [0, 0])]
    # a prompt that is all full blocks still computes its last block (its last logits are needed)
    third, plan = manager.open_shared(system)
    assert plan.slots.shape == (1, 2)
    store.apply(manager, third, plan, [4])
    assert third.blocks.tolist() == [table.blocks[0, :3].tolist()]
    manager.join(table, third)
    manager.check_invariants(table)
    manager.release(table)
    assert manager.pool.live == 0 and len(manager.trie) == manager.pool.cached
