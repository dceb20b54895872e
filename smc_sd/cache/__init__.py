"""The token-trie KV cache: blocks of token positions shared by particles through a trie.

Layers, outermost first (each module opens with its invariants):

- `manager`: block tables of equal-length rows (fork, resample, extend, truncate, release) and
  the memory statistics; the only door callers use;
- `trie`: full blocks indexed by (parent block, token ids), so equal prefixes share blocks;
- `pool`: block ids and their reference counts, the one place the refcount contract lives;
- `store`: the KV bytes at the pool's slots (one per model), which the manager never reads.
"""

from smc_sd.cache.manager import AppendPlan, BlockTables, KVCacheManager
from smc_sd.cache.pool import BlockPool
from smc_sd.cache.store import KVStore
from smc_sd.cache.trie import TokenTrie

__all__ = ["AppendPlan", "BlockPool", "BlockTables", "KVCacheManager", "KVStore", "TokenTrie"]
