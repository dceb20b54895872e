"""The token-trie KV cache's bookkeeping, without a model: refcount contract, trie sharing, and
thousands of random fork / extend / truncate / release operations against a reference model.

The reference model of a row is its token list. A fake store writes, at every slot, the whole
prefix that ends at that position: KV depends on the prefix, so reading a row's slots must give
back exactly the prefixes of its reference tokens, whatever was shared, copied on write or merged.
"""

import random

import pytest
import torch

from smc_sd.cache.manager import KVCacheManager
from smc_sd.cache.pool import BlockPool
from smc_sd.cache.trie import ROOT


class PrefixStore:
    """A stand-in KV store: slot -> the token prefix whose last position it holds."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def apply(self, manager: KVCacheManager, table, plan, start: int) -> None:
        """Do what the real store does for an append plan, then commit it."""
        for source, target in plan.copies.tolist():
            for offset in range(self.block_size):
                value = self.slots.get(source * self.block_size + offset)
                if value is not None:
                    self.slots[target * self.block_size + offset] = value
        rows = table.tokens.tolist()
        for b, row_slots in enumerate(plan.slots.tolist()):
            for j, slot in enumerate(row_slots):
                self.slots[slot] = tuple(rows[b][: start + j + 1])
        manager.commit(table, start)

    def read(self, manager: KVCacheManager, table) -> list[list[tuple[int, ...]]]:
        return [[self.slots[s] for s in row] for row in manager.slots(table).tolist()]


def prefixes(row: list[int]) -> list[tuple[int, ...]]:
    return [tuple(row[: p + 1]) for p in range(len(row))]


# --- the pool's refcount contract -------------------------------------------------------------


def test_pool_contract_allocate_share_release():
    pool = BlockPool(capacity=2)
    a = pool.allocate(2)
    assert [pool.count(int(x)) for x in a] == [1, 1] and all(pool.is_writable(int(x)) for x in a)
    # repeated ids count once per listing: index_add_, not fancy-index +=
    pool.share(torch.tensor([int(a[0]), int(a[0]), int(a[0])]))
    assert pool.count(int(a[0])) == 4 and not pool.is_writable(int(a[0]))
    assert pool.shared == 1
    freed = pool.release(torch.tensor([int(a[0])] * 3 + [int(a[1])]))
    assert freed.tolist() == [int(a[1])] and pool.count(int(a[0])) == 1
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.release(torch.tensor([int(a[1])]))
    with pytest.raises(ValueError):
        pool.share(torch.tensor([int(a[1])]))
    assert pool.release(a[:1]).tolist() == [int(a[0])]
    assert pool.live == 0 and pool.peak_live == 2
    pool.check_invariants()


def test_pool_grows_when_needed():
    pool = BlockPool(capacity=1)
    blocks = pool.allocate(5)
    assert len(set(blocks.tolist())) == 5 and pool.capacity >= 5 and pool.live == 5
    pool.check_invariants()
    pool.release(blocks)
    assert pool.live == 0
    pool.check_invariants()


# --- the manager on hand-picked cases ---------------------------------------------------------


def test_prompt_is_shared_and_partial_block_copied_on_write():
    manager, store = KVCacheManager(block_size=3, bytes_per_block=30), PrefixStore(3)
    table, plan = manager.open([5, 6, 7, 8])
    store.apply(manager, table, plan, 0)
    manager.select(table, torch.zeros(4, dtype=torch.int64))
    # two blocks, each listed by 4 rows: nothing was copied
    assert manager.pool.live == 2 and manager.pool.shared == 2
    tokens = torch.tensor([[1], [2], [1], [3]])
    plan = manager.append(table, tokens)
    # the shared partial block: three rows copy it, the last writes it in place
    assert plan.copies.shape == (3, 2)
    store.apply(manager, table, plan, 4)
    rows = [[5, 6, 7, 8] + t for t in tokens.tolist()]
    assert store.read(manager, table) == [prefixes(r) for r in rows]
    manager.check_invariants(table)
    stats = manager.memory(table)
    assert stats["naive_peak_bytes"] == 4 * 5 * 10 and stats["live_bytes"] == 5 * 30
    manager.release(table)
    assert manager.pool.live == 0 and len(manager.trie) == 0


def test_equal_full_blocks_merge_through_the_trie():
    manager, store = KVCacheManager(block_size=2, bytes_per_block=2), PrefixStore(2)
    table, plan = manager.open([4, 4])
    store.apply(manager, table, plan, 0)
    manager.select(table, torch.zeros(3, dtype=torch.int64))
    plan = manager.append(table, torch.tensor([[1, 2], [1, 2], [2, 1]]))
    store.apply(manager, table, plan, 2)
    # rows 0 and 1 wrote equal blocks after the same parent: one of them is merged away
    assert table.blocks[0, 1] == table.blocks[1, 1] != table.blocks[2, 1]
    assert manager.pool.live == 3
    assert (ROOT, int(table.blocks[0, 0]), (4, 4)) in manager.trie.edges()
    graph = manager.trie.to_networkx()
    assert graph.out_degree(int(table.blocks[0, 0])) == 2 and graph.number_of_nodes() == 4
    manager.check_invariants(table)
    manager.release(table)
    manager.release(table)
    assert manager.pool.live == 0 and len(manager.trie) == 0


def test_truncation_into_a_full_block_drops_it_from_the_trie():
    manager, store = KVCacheManager(block_size=3, bytes_per_block=3), PrefixStore(3)
    table, plan = manager.open([1, 2, 3, 4, 5, 6])
    store.apply(manager, table, plan, 0)
    full = int(table.blocks[0, 1])
    assert manager.trie.tokens(full) == (4, 5, 6)
    manager.truncate(table, 5)
    # the block holds positions 3 and 4 only for this row: its key (4, 5, 6) no longer describes it
    assert full not in manager.trie and len(manager.trie) == 1
    manager.check_invariants(table)
    # growing back to a full block indexes it again, under the new tokens
    plan = manager.append(table, torch.tensor([[9]]))
    store.apply(manager, table, plan, 5)
    assert manager.trie.tokens(int(table.blocks[0, 1])) == (4, 5, 9)
    assert store.read(manager, table) == [prefixes([1, 2, 3, 4, 5, 9])]
    manager.check_invariants(table)


def test_invariants_catch_a_block_indexed_under_other_tokens():
    manager, store = KVCacheManager(block_size=2, bytes_per_block=2), PrefixStore(2)
    table, plan = manager.open([1, 2, 3, 4])
    store.apply(manager, table, plan, 0)
    # a row whose tokens no longer match its indexed block's key
    table.tokens[0, 3] = 7
    with pytest.raises(AssertionError, match="other tokens or partial"):
        manager.check_invariants(table)


# --- random operations against the reference model --------------------------------------------


def check_against_reference(manager, store, tables, reference):
    manager.check_invariants(*tables)
    listings = torch.zeros(manager.pool.capacity, dtype=torch.int64)
    for table, rows in zip(tables, reference):
        assert table.tokens.tolist() == rows
        assert store.read(manager, table) == [prefixes(r) for r in rows]
        flat = table.blocks.reshape(-1)
        listings.index_add_(0, flat, torch.ones_like(flat))
    # the tables are the pool's only users: every count equals its listings exactly
    assert [manager.pool.count(b) for b in range(manager.pool.capacity)] == listings.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_reference(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4])
    manager, store = KVCacheManager(block_size, bytes_per_block=block_size, capacity=2), PrefixStore(block_size)
    tables, reference = [], []
    # a two-letter vocabulary makes equal blocks (trie merges) common
    vocab = 2
    for step in range(1000):
        op = rng.random()
        if not tables or (op < 0.05 and len(tables) < 3):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
            table, plan = manager.open(prompt)
            store.apply(manager, table, plan, 0)
            batch = rng.randint(1, 5)
            manager.select(table, torch.zeros(batch, dtype=torch.int64))
            tables.append(table)
            reference.append([list(prompt) for _ in range(batch)])
        elif op < 0.1:
            i = rng.randrange(len(tables))
            manager.release(tables.pop(i))
            reference.pop(i)
        else:
            i = rng.randrange(len(tables))
            table, rows = tables[i], reference[i]
            if op < 0.55:
                length = rng.randint(1, 5)
                new = [[rng.randrange(vocab) for _ in range(length)] for _ in rows]
                start = table.length
                plan = manager.append(table, torch.tensor(new))
                store.apply(manager, table, plan, start)
                reference[i] = [r + n for r, n in zip(rows, new)]
            elif op < 0.85:
                ancestors = [rng.randrange(len(rows)) for _ in range(rng.randint(1, 6))]
                manager.select(table, torch.tensor(ancestors))
                reference[i] = [list(rows[a]) for a in ancestors]
            else:
                length = rng.randint(1, table.length)
                manager.truncate(table, length)
                reference[i] = [r[:length] for r in rows]
        if step % 20 == 0:
            check_against_reference(manager, store, tables, reference)
    check_against_reference(manager, store, tables, reference)
    for table in tables:
        manager.release(table)
    manager.check_invariants()
    assert manager.pool.live == 0 and len(manager.trie) == 0
    assert manager.pool.peak_live > 0


# --- the real engine over the bookkeeping (toy models, no KV bytes) ---------------------------


def test_engine_returns_every_block_after_a_run_and_after_one_that_raises():
    from smc_sd import Schedule
    from smc_sd.backends.dry_run import DryRunLM
    from smc_sd.backends.toy import ToyLM
    from smc_sd.programs import get

    toy = ToyLM.random(vocab_size=3, seed=0, eos=False)
    target, draft = DryRunLM(toy, 30, 3), DryRunLM(ToyLM.perturbed(toy, 1.0), 30, 3)
    program = get("smc-sd").program(target, draft, draft_len=2)
    result = program.run([0, 1, 0, 1], Schedule(6, max_tokens=12), seed=0)
    # the prompt is shared by all 6 rows of each model
    assert 0 < result.kv["peak_bytes"] < result.kv["naive_peak_bytes"]
    assert result.to_json()["kv_naive_bytes"] == result.kv["naive_peak_bytes"]

    def interrupt(stats, rows):
        if len(rows[0]) > 4:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        program.run([0, 1, 0, 1], Schedule(6, max_tokens=12), seed=1, on_cycle=interrupt)
    for lm in (target, draft):
        lm.manager.check_invariants()
        assert lm.manager.pool.live == 0 and len(lm.manager.trie) == 0
