"""The token-trie KV cache's bookkeeping, without a model: refcount contract, trie sharing, and
thousands of random fork / extend / truncate / release operations against a reference model.

The reference model of a row is its token list. A fake store writes, at every slot, the whole
prefix that ends at that position: KV depends on the prefix, so reading a row's slots must give
back exactly the prefixes of its reference tokens, whatever was shared, copied on write or merged.
And the trie's contract is checked against the reference: over all tables sharing a manager, the
rows' distinct full prefixes and the blocks holding them are one to one.
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


def test_pool_caches_kept_blocks_until_evicted_or_shared():
    pool = BlockPool(capacity=4)
    a = pool.allocate(4).tolist()
    # the two kept blocks are cached in the order keep gives, the others freed
    freed = pool.release(torch.tensor(a), keep=lambda idle: [a[2], a[0]])
    assert sorted(freed.tolist()) == sorted([a[1], a[3]])
    assert (pool.live, pool.cached, pool.free) == (0, 2, 2) and pool.is_cached(a[2])
    pool.check_invariants()
    # allocation takes free blocks only, growing past the cache rather than into it
    taken = pool.allocate(3).tolist()
    assert not {a[0], a[2]} & set(taken) and pool.capacity > 4 and pool.cached == 2
    # sharing a cached block brings it back with count 1; a free one still cannot be shared
    pool.share(torch.tensor([a[0]]))
    assert pool.count(a[0]) == 1 and not pool.is_cached(a[0]) and pool.live == 4
    with pytest.raises(ValueError):
        pool.share(torch.tensor([pool._free[-1]]))
    # eviction returns the least recently cached first
    pool.release(torch.tensor([a[0]]), keep=lambda idle: idle)
    assert pool.evict(1) == [a[2]] and pool.evict(5) == [a[0]] and pool.cached == 0
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
    assert manager.pool.live == 0 and len(manager.trie) == manager.pool.cached


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
    assert manager.pool.live == 0 and len(manager.trie) == manager.pool.cached


def test_truncated_block_stays_indexed_until_its_only_holder_writes():
    manager, store = KVCacheManager(block_size=3, bytes_per_block=3), PrefixStore(3)
    table, plan = manager.open([1, 2, 3, 4, 5, 6])
    store.apply(manager, table, plan, 0)
    full = int(table.blocks[0, 1])
    assert manager.trie.tokens(full) == (4, 5, 6)
    manager.truncate(table, 5)
    # nothing wrote the block: its KV is still its key's, and the row reads its first two positions
    assert manager.trie.tokens(full) == (4, 5, 6) and len(manager.trie) == 2
    manager.check_invariants(table)
    # the row, its only holder, writes in place: the block leaves the index, then comes back
    # under the new tokens once full
    plan = manager.append(table, torch.tensor([[9]]))
    assert plan.copies.numel() == 0 and int(table.blocks[0, 1]) == full
    store.apply(manager, table, plan, 5)
    assert manager.trie.tokens(full) == (4, 5, 9) and len(manager.trie) == 2
    assert store.read(manager, table) == [prefixes([1, 2, 3, 4, 5, 9])]
    manager.check_invariants(table)


def test_block_truncated_and_refilled_is_shared_again():
    # two tables share the full prompt block; one truncates into it and fills it back
    manager, store = KVCacheManager(block_size=2, bytes_per_block=8, capacity=1), PrefixStore(2)
    tables = []
    for _ in range(2):
        table, plan = manager.open([0, 1])
        store.apply(manager, table, plan, 0)
        tables.append(table)
    t0, t1 = tables
    assert t0.blocks.tolist() == t1.blocks.tolist() == [[0]]
    manager.truncate(t0, 1)
    # t1 holds block 0 full: it stays indexed, and t0 still reads its first position from it
    assert manager.trie.lookup(ROOT, (0, 1)) == 0
    manager.check_invariants(t0, t1)
    plan = manager.append(t0, torch.tensor([[1]]))
    # shared, so t0 copies it on write; the refilled copy merges back into block 0
    assert plan.copies.tolist() == [[0, 1]]
    store.apply(manager, t0, plan, 1)
    assert t0.blocks.tolist() == t1.blocks.tolist() == [[0]]
    assert manager.pool.live == 1 and manager.pool.count(0) == 2
    assert store.read(manager, t0) == store.read(manager, t1) == [prefixes([0, 1])]
    manager.check_invariants(t0, t1)
    # t0 refills with other tokens: its copy is a block of its own, indexed under them
    manager.truncate(t0, 1)
    plan = manager.append(t0, torch.tensor([[0]]))
    store.apply(manager, t0, plan, 1)
    assert t0.blocks.tolist() == [[1]] and manager.trie.lookup(ROOT, (0, 0)) == 1
    manager.check_invariants(t0, t1)


def test_a_released_prompt_is_shared_by_a_later_one_from_the_cache():
    manager, store = KVCacheManager(block_size=2, bytes_per_block=2), PrefixStore(2)
    first, plan = manager.open([1, 2, 3, 4, 5])
    store.apply(manager, first, plan, 0)
    manager.release(first)
    # its two full blocks stay indexed, cached; the partial one is freed
    assert manager.pool.live == 0 and manager.pool.cached == len(manager.trie) == 2
    manager.check_invariants()
    second, plan = manager.open_shared([1, 2, 3, 4, 9, 9, 9])
    # only the positions past the cached prefix are written
    assert plan.slots.shape == (1, 3) and manager.pool.cached == 0
    store.apply(manager, second, plan, 4)
    assert store.read(manager, second) == [prefixes([1, 2, 3, 4, 9, 9, 9])]
    manager.check_invariants(second)


def test_eviction_takes_children_before_parents_and_only_when_free_blocks_run_out():
    manager, store = KVCacheManager(block_size=1, bytes_per_block=1, capacity=4), PrefixStore(1)
    table, plan = manager.open([1, 2, 3, 4])
    store.apply(manager, table, plan, 0)
    manager.release(table)
    assert manager.pool.cached == 4 and manager.pool.capacity == 4
    # two blocks needed, none free: the two deepest cached blocks make room, the pool stays
    other, plan = manager.open([7, 8])
    store.apply(manager, other, plan, 0)
    assert manager.pool.capacity == 4 and manager.pool.cached == 2
    assert manager.trie.lookup(ROOT, (1,)) is not None and manager.trie.lookup(manager.trie.lookup(ROOT, (1,)), (2,)) is not None
    manager.check_invariants(other)
    # what is left of the first prompt is still shared
    again, plan = manager.open_shared([1, 2, 3, 4])
    assert plan.slots.shape == (1, 2)
    store.apply(manager, again, plan, 2)
    assert store.read(manager, again) == [prefixes([1, 2, 3, 4])]
    manager.check_invariants(other, again)


def test_the_cache_grows_the_pool_up_to_cache_blocks_only():
    manager, store = KVCacheManager(block_size=1, bytes_per_block=1, capacity=1, cache_blocks=4), PrefixStore(1)
    for i in range(10):
        table, plan = manager.open([2 * i, 2 * i + 1])
        store.apply(manager, table, plan, 0)
        manager.release(table)
        # past 4 blocks, the oldest cached blocks make room instead of the pool growing
        assert manager.pool.capacity == min(4, 2 * (i + 1)) and manager.pool.cached <= 4
        manager.check_invariants()
    # the latest prompts are still cached: their first blocks are shared, not computed
    table, plan = manager.open_shared([18, 19])
    assert plan.slots.shape == (1, 1)
    store.apply(manager, table, plan, 1)
    assert store.read(manager, table) == [prefixes([18, 19])]
    with pytest.raises(ValueError, match="cache_blocks"):
        KVCacheManager(block_size=1, bytes_per_block=1, cache_blocks=-1)


def test_writing_a_block_in_place_drops_its_cached_descendants():
    manager, store = KVCacheManager(block_size=2, bytes_per_block=2), PrefixStore(2)
    table, plan = manager.open([1, 2, 3, 4, 5, 6])
    store.apply(manager, table, plan, 0)
    manager.select(table, torch.tensor([0, 0]))
    # row 1 gives up its last block, then row 0 leaves: blocks 2 and 3 of the prompt stay cached
    manager.truncate_rows(table, torch.tensor([6, 4]))
    manager.select(table, torch.tensor([1]))
    assert manager.pool.cached == 1 and len(manager.trie) == 3
    # the row truncates into its second block, which it alone holds, and rewrites it in place
    manager.truncate(table, 3)
    plan = manager.append(table, torch.tensor([[9, 5, 6]]))
    assert plan.copies.numel() == 0
    store.apply(manager, table, plan, 3)
    # the cached block after the old second block left the index with it: a block (5, 6) after
    # the rewritten (3, 9) is computed, never taken from the cache
    assert store.read(manager, table) == [prefixes([1, 2, 3, 9, 5, 6])]
    manager.check_invariants(table)


def test_invariants_catch_full_blocks_the_trie_does_not_share():
    manager, store = KVCacheManager(block_size=2, bytes_per_block=2), PrefixStore(2)
    t0, plan = manager.open([1, 2])
    store.apply(manager, t0, plan, 0)
    t1, plan = manager.open([3, 2])
    store.apply(manager, t1, plan, 0)
    # a full block missing from the index: later rows with its prefix could not share it
    manager.trie.remove(t1.blocks[0].tolist())
    with pytest.raises(AssertionError, match="full block 1 is not in the trie"):
        manager.check_invariants(t0, t1)
    # and t1 claiming t0's prefix in a block of its own
    t1.tokens[0, 0] = 1
    with pytest.raises(AssertionError, match="one full prefix in two blocks, 0 and 1"):
        manager.check_invariants(t0, t1)
    # a partial block listed under two prefixes that part ways (the 1 and the 3 after it)
    t2, plan = manager.open([1, 2, 1])
    store.apply(manager, t2, plan, 0)
    t3, plan = manager.open([1, 2, 3])
    store.apply(manager, t3, plan, 0)
    manager.check_invariants(t0, t2, t3)
    manager.pool.share(t2.blocks[0, 1:])
    t3.blocks[0, 1] = t2.blocks[0, 1]
    with pytest.raises(AssertionError, match=f"table 2 row 0 column 1: block {int(t2.blocks[0, 1])} holds two prefixes"):
        manager.check_invariants(t0, t2, t3)


def test_invariants_catch_a_block_indexed_under_other_tokens():
    manager, store = KVCacheManager(block_size=2, bytes_per_block=2), PrefixStore(2)
    table, plan = manager.open([1, 2, 3, 4])
    store.apply(manager, table, plan, 0)
    # a row whose tokens no longer match its indexed block's key
    table.tokens[0, 3] = 7
    with pytest.raises(AssertionError, match="other tokens"):
        manager.check_invariants(table)


# --- random operations against the reference model --------------------------------------------


def check_against_reference(manager, store, tables, reference):
    manager.check_invariants(*tables)
    listings = torch.zeros(manager.pool.capacity, dtype=torch.int64)
    # (column, full prefix of (column + 1) · block_size tokens, block) over every row of every table
    full = set()
    bs = manager.block_size
    for table, rows in zip(tables, reference):
        assert table.tokens.tolist() == rows
        assert store.read(manager, table) == [prefixes(r) for r in rows]
        flat = table.blocks.reshape(-1)
        listings.index_add_(0, flat, torch.ones_like(flat))
        for row, blocks in zip(rows, table.blocks.tolist()):
            full |= {(j, tuple(row[: (j + 1) * bs]), blocks[j]) for j in range(len(row) // bs)}
    # the tables are the pool's only users: every count equals its listings exactly
    assert [manager.pool.count(b) for b in range(manager.pool.capacity)] == listings.tolist()
    # the trie's contract, all tables sharing one manager: one block per distinct full prefix
    # (as many distinct blocks as prefixes at every column), and one prefix per block
    pairs = {(prefix, block) for _, prefix, block in full}
    for j in {j for j, _, _ in full}:
        at_j = [(prefix, block) for column, prefix, block in full if column == j]
        assert len({p for p, _ in at_j}) == len({b for _, b in at_j}) == len(at_j)
    assert len({block for _, block in pairs}) == len(pairs)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_random_operations_match_reference(block_size):
    rng = random.Random(block_size)
    manager, store = KVCacheManager(block_size, bytes_per_block=block_size, capacity=2), PrefixStore(block_size)
    tables, reference = [], []
    # a two-letter vocabulary makes equal blocks (trie merges) common
    vocab = 2
    for step in range(1000):
        op = rng.random()
        if not tables or (op < 0.05 and len(tables) < 3):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
            if tables and rng.random() < 0.5:
                # a request sharing a prefix with a row of another table
                shared = rng.choice(rng.choice(reference))
                prompt = shared[: rng.randint(1, len(shared))] + prompt[: rng.randint(0, 2)]
            # a joining request shares the trie's blocks of its prompt, cached ones included
            table, plan = manager.open_shared(prompt) if rng.random() < 0.5 else manager.open(prompt)
            store.apply(manager, table, plan, len(prompt) - plan.slots.shape[1])
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
                # a rollback within the last two blocks (as speculative decoding does), or deeper
                deepest = 1 if rng.random() < 0.3 else max(1, table.length - 2 * block_size)
                length = rng.randint(deepest, table.length)
                manager.truncate(table, length)
                reference[i] = [r[:length] for r in rows]
        if step % 5 == 4:
            check_against_reference(manager, store, tables, reference)
    for table in tables:
        manager.release(table)
    manager.check_invariants()
    assert manager.pool.live == 0 and len(manager.trie) == manager.pool.cached
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
        assert lm.manager.pool.live == 0 and len(lm.manager.trie) == lm.manager.pool.cached
