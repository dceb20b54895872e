"""The rows of a llama.cpp context: sequence ids, the cell trie that mirrors their KV cells, and
the reusable batch of a decode (`smc_sd.backends.llama_cpp` describes how rows map onto
llama.cpp's unified KV cache).

Invariants of `LlamaCppSequences`: row b's id carries exactly the cells at positions
0 .. lengths[b] - 1 of its tokens; distinct rows have distinct ids; every id not held by an open
row is free and carries no cell; after `close()` other methods raise ValueError.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from smc_sd.backends.base import (
    Sequences,
    check_counts,
    check_extend,
    check_join,
    check_rows,
    check_truncate,
    check_truncate_rows,
)


class DecodeBatch:
    """One `llama_batch` whose arrays live in numpy buffers kept between decodes (grown by
    doubling), so filling it is a few slice copies: no per-token Python, no new ctypes objects.

    Token i's sequence ids are row i of a [capacity, W] int32 table; `seq_id[i]` points at it.
    """

    def __init__(self, llama):
        self.struct = llama.llama_batch()
        self._capacity = self._width = 0

    def _reserve(self, n: int, width: int) -> None:
        if n <= self._capacity and width <= self._width:
            return
        self._capacity, self._width = max(n, 2 * self._capacity, 16), max(width, self._width)
        c = self._capacity
        self.tokens, self.positions, self.counts = (np.zeros(c, dtype=np.int32) for _ in range(3))
        self.outputs = np.zeros(c, dtype=np.int8)
        self.ids = np.full((c, self._width), -1, dtype=np.int32)
        # [c] addresses of the rows of `ids`
        self.pointers = (self.ids.ctypes.data + self.ids.strides[0] * np.arange(c, dtype=np.uint64)).astype(np.uintp)
        b = self.struct
        b.token = self.tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.pos = self.positions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = self.counts.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = self.pointers.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.logits = self.outputs.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray):
        """The batch of `LlamaCppLanguageModel.run`'s arguments (its shapes), ready to decode."""
        n = len(tokens)
        seqs = seqs.reshape(n, -1)
        self._reserve(n, seqs.shape[1])
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.outputs[:n] = outputs
        self.ids[:n, : seqs.shape[1]] = seqs
        self.counts[:n] = (seqs >= 0).sum(1)
        self.struct.n_tokens = n
        return self.struct


class Cell:
    """A node of the cell trie: one KV cell (a position after a path of tokens)."""

    __slots__ = ("parent", "depth", "refs")

    def __init__(self, parent: Cell | None):
        self.parent = parent
        self.depth = 1 if parent is None else parent.depth + 1
        # children plus rows whose leaf it is
        self.refs = 0


class CellTrie:
    """Reference counts of the cells in use, shared by every row of one context.

    A row holds its leaf (None: an empty row); a cell is live while a row's leaf or a live child
    holds it, and the trie counts live cells as llama.cpp's cache holds them: a cell that loses
    its last sequence id is free there too.
    """

    def __init__(self):
        self.live = 0

    def grow(self, leaf: Cell | None, count: int) -> Cell | None:
        """The leaf after `count` new cells appended below `leaf`; the row's hold moves to it
        (the new child takes the hold the row gave up, so `leaf`'s count is unchanged)."""
        for _ in range(count):
            leaf = Cell(leaf)
            leaf.refs = 1
            self.live += 1
        return leaf

    def hold(self, cell: Cell | None) -> None:
        if cell is not None:
            cell.refs += 1

    def drop(self, cell: Cell | None) -> None:
        """Release one hold on `cell`, freeing it and, in turn, ancestors no one holds."""
        while cell is not None:
            cell.refs -= 1
            if cell.refs:
                return
            self.live -= 1
            cell = cell.parent

    @staticmethod
    def ancestor(cell: Cell | None, depth: int) -> Cell | None:
        """The cell at `depth` on the path to `cell` (None at depth 0)."""
        while cell is not None and cell.depth > depth:
            cell = cell.parent
        return cell


class LlamaCppSequences(Sequences):
    """B rows of a `LlamaCppLanguageModel`: one sequence id, one length and one trie leaf each."""

    def __init__(self, lm):
        """lm: the `LlamaCppLanguageModel` whose context holds the rows."""
        self._lm = lm
        self._ids: list[int] = []
        self._lengths: list[int] = []
        self._leaves: list[Cell | None] = []
        self._closed = False
        self._peak_cells = 0
        self._naive_peak_cells = 0

    @property
    def batch_size(self) -> int:
        return len(self._ids)

    @property
    def length(self) -> int:
        if len(set(self._lengths)) > 1:
            raise ValueError("these rows differ in length; read lengths")
        return self._lengths[0]

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor(self._lengths, dtype=torch.int64)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, L] int64 at each row's own positions in one decode; logits [B, L, V]."""
        self._check_open()
        check_extend(tokens, self.batch_size, max(self._lengths), self._lm.max_length)
        batch, steps = tokens.shape
        return self._append(tokens, [steps] * batch).view(batch, steps, -1)

    def extend_rows(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append to row b its first counts[b] tokens of tokens [B, L], in one decode of only
        those tokens; their logits packed row after row, [sum(counts), V] float32."""
        self._check_open()
        counts = check_counts(counts, tokens)
        check_extend(tokens, self.batch_size, max(n + c for n, c in zip(self._lengths, counts.tolist())) - tokens.shape[1], self._lm.max_length)
        return self._append(tokens, counts.tolist())

    def _append(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Row b gains tokens[b, :counts[b]]; rows that hold the same cells (one trie leaf: copies
        made by resampling or forking) and gain the same tokens are decoded once, each token
        carrying every such row's sequence id, so they share the new cells too.

        Returns:
            [sum(counts), V] float32 logits packed row after row: row b's are those of the
            decoded copy of its tokens (the same bits: a position's logits depend only on its
            sequence's cells, module docstring).
        """
        lm, trie = self._lm, self._lm.trie
        rows = tokens.tolist()
        # (leaf, new tokens) -> the rows that share them; dict order is the first row's order
        shared: dict[tuple, list[int]] = {}
        for b, count in enumerate(counts):
            if count:
                shared.setdefault((id(self._leaves[b]), tuple(rows[b][:count])), []).append(b)
        if not shared:
            return torch.empty(0, lm.vocabulary.size)
        width = max(len(members) for members in shared.values())
        n = sum(len(new) for _, new in shared)
        flat, positions = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)
        seqs = np.full((n, width), -1, dtype=np.int32)
        # [B]: where row b's tokens start in the batch
        starts = [0] * len(counts)
        at = 0
        for (_, new), members in shared.items():
            first = members[0]
            end = at + len(new)
            flat[at:end] = new
            positions[at:end] = np.arange(self._lengths[first], self._lengths[first] + len(new))
            seqs[at:end, : len(members)] = [self._ids[b] for b in members]
            for b in members:
                starts[b] = at
            at = end
        logits = lm.run(flat, positions, seqs, np.ones(n, dtype=np.int8))
        for (_, new), members in shared.items():
            old = self._leaves[members[0]]
            leaf = trie.grow(old, len(new))
            for b in members[1:]:
                # row b's hold moves from the old leaf to the new one (which holds the old)
                trie.hold(leaf)
                trie.drop(old)
            for b in members:
                self._leaves[b] = leaf
                self._lengths[b] += len(new)
        self._record_peak()
        if width == 1:
            # no row shared its decode: the batch is already packed row after row
            return logits
        # [sum(counts)]: the batch entry of each kept token, row after row
        index = torch.cat([torch.arange(starts[b], starts[b] + c) for b, c in enumerate(counts) if c])
        return logits.index_select(0, index)

    def join(self, prompt: list[int], count: int) -> torch.Tensor:
        """Add `count` rows holding `prompt`, decoded once; the logits after it, [V] float32."""
        self._check_open()
        check_join(prompt, count, self._lm.max_length)
        return self.join_many([prompt], [count])[0]

    def join_many(self, prompts: list[list[int]], counts: list[int]) -> list[torch.Tensor]:
        """Add counts[j] rows holding prompts[j], every prompt decoded once, each in a decode of
        its own: llama.cpp's numerics depend on the batch a token is decoded in (its matrix
        kernels change with the batch's size), so a prompt decoded beside others gets other
        logits than alone, and a request's draws would depend on what joined with it.

        Returns:
            [V] float32 next-token logits after each prompt.
        """
        self._check_open()
        if not prompts:
            return []
        for prompt, count in zip(prompts, counts):
            check_join(prompt, count, self._lm.max_length)
        lm, trie = self._lm, self._lm.trie
        ids = lm.acquire(sum(counts))
        firsts = np.cumsum([0, *counts[:-1]])
        logits = []
        try:
            for prompt, first in zip(prompts, firsts.tolist()):
                # a logits flag on the prompt's last token
                outputs = np.zeros(len(prompt), dtype=np.int8)
                outputs[-1] = 1
                logits += list(lm.run(np.asarray(prompt, dtype=np.int32), np.arange(len(prompt), dtype=np.int32), np.full(len(prompt), ids[first], dtype=np.int32), outputs))
        except BaseException:
            lm.release(ids, [0] * len(ids))
            raise
        for prompt, count, first in zip(prompts, counts, firsts.tolist()):
            leaf = trie.grow(None, len(prompt))
            for seq in ids[first + 1 : first + count]:
                lm.copy(ids[first], seq)
                trie.hold(leaf)
            self._ids += ids[first : first + count]
            self._lengths += [len(prompt)] * count
            self._leaves += [leaf] * count
        self._record_peak()
        return list(logits)

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i]: ids gain cells (`seq_cp`), no KV byte moves."""
        self._check_open()
        check_rows(rows, self.batch_size)
        lm, trie = self._lm, self._lm.trie
        chosen = rows.tolist()
        firsts = {}
        for i, a in enumerate(chosen):
            firsts.setdefault(a, i)
        dropped = [a for a in range(self.batch_size) if a not in firsts]
        # refused before anything changes: the copies may reuse the dropped rows' ids
        lm.check_room(len(chosen) - len(firsts), len(dropped))
        lm.release([self._ids[a] for a in dropped], [self._lengths[a] for a in dropped])
        extra = lm.acquire(len(chosen) - len(firsts))
        ids, spare = [], iter(extra)
        for i, a in enumerate(chosen):
            if firsts[a] == i:
                ids.append(self._ids[a])
            else:
                seq = next(spare)
                lm.copy(self._ids[a], seq)
                ids.append(seq)
        leaves = [self._leaves[a] for a in chosen]
        for leaf in leaves:
            trie.hold(leaf)
        for leaf in self._leaves:
            trie.drop(leaf)
        self._ids, self._leaves = ids, leaves
        self._lengths = [self._lengths[a] for a in chosen]
        self._record_peak()

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of every row (`seq_rm` past them)."""
        self._check_open()
        check_truncate(length, self.length)
        self._cut([length] * self.batch_size)

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] positions of row b."""
        self._check_open()
        self._cut(check_truncate_rows(lengths, self.lengths).tolist())

    def close(self) -> None:
        if self._closed:
            return
        self._lm.release(self._ids, self._lengths)
        for leaf in self._leaves:
            self._lm.trie.drop(leaf)
        self._ids, self._lengths, self._leaves = [], [], []
        self._closed = True

    def memory(self) -> dict:
        """Cells of the context's KV cache as blocks of one position: in use now (all rows of the
        context), the most these rows saw in use, and what rows each holding its own copy of
        every position would have needed at that point."""
        lm = self._lm
        return {
            "block_size": 1,
            "live_blocks": lm.trie.live,
            "pool_blocks": lm.n_cells,
            "live_bytes": lm.trie.live * lm.cell_bytes,
            "peak_bytes": self._peak_cells * lm.cell_bytes,
            "naive_peak_bytes": self._naive_peak_cells * lm.cell_bytes,
        }

    def _cut(self, lengths: list[int]) -> None:
        trie = self._lm.trie
        for b, (seq, old, new) in enumerate(zip(self._ids, self._lengths, lengths)):
            if new < old:
                self._lm.park(seq, new, old)
                leaf = trie.ancestor(self._leaves[b], new)
                trie.hold(leaf)
                trie.drop(self._leaves[b])
                self._leaves[b] = leaf
        self._lengths = list(lengths)

    def _record_peak(self) -> None:
        self._peak_cells = max(self._peak_cells, self._lm.trie.live)
        self._naive_peak_cells = max(self._naive_peak_cells, sum(self._lengths))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("these sequences were closed")

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()
