"""A llama.cpp backend: rows are sequences of one unified KV cache (llama-cpp-python's low-level API).

llama.cpp keeps one pool of KV cells per context; with `kv_unified` a cell holds the keys and
values of one position and carries a set of sequence ids, and a token of sequence s attends to
the cells that carry s at positions up to its own. A row here is one sequence id:

- `open(prompt, B)` decodes the prompt once for one id and adds the other B - 1 ids to its
  cells (`seq_cp`): B rows, one copy of the prompt's KV;
- `select(a)` (resampling, forking) keeps the id of the first row that takes old row a[i] and
  gives every further copy a free id whose cells become those of a[i] (`seq_cp` adds the id to
  the cells: shared, no byte is copied); ids no row takes lose their cells (`seq_rm`);
- `truncate` / `truncate_rows` remove a row's id from its cells past the kept length (`seq_rm`);
- `extend(tokens)` / `extend_rows(tokens, counts)` are ONE `llama_decode` over every row's new
  tokens at the row's own positions (rows of different lengths in one batch; only the tokens a
  row keeps), with a logits flag on every new token; rows that hold the same cells (copies made
  by resampling) and gain the same tokens are decoded once, each token carrying all their ids,
  so they share the new cells as they shared the old ones (the hf backend computes such rows
  once too);
- `join` / `join_many` decode the joining prompts in one batch, each under a fresh id.

The cells therefore form a token trie: a cell is a trie node (a position after a path of tokens)
and a sequence id is a path from the root to its leaf; a cell is live while some id's path runs
through it. `LlamaCppSequences` mirrors the trie with reference-counted nodes to report the cells
in use (`memory()`, as the paged hf backend reports blocks, with blocks of one position).

Logits are llama.cpp's float32 rows of the positions flagged for output (a prompt flags its last
position only), copied by one memcpy from its output buffer (batch order) into a torch tensor.
The batch's arrays are numpy buffers kept between decodes (`DecodeBatch`).
Numerics: the weights run in the GGUF's own format (a Q4_1 file runs as Q4_1), the KV cache in
float16, attention through llama.cpp's flash-attention kernel. For 4- and 8-bit weights llama.cpp
rounds activations to 8 bits in every matrix product, so a rounding change anywhere (another
summation order) flips later roundings and moves the logits by up to about 0.5 (TV 0.04 between
the two next-token distributions, measured on the shipped file). The backend keeps the things
that would change the order fixed: flash attention computes each query alone over its own
sequence's cells in cache order, and no cell is ever freed below a live one (`park`), so every
sequence's cells lie in position order and a position's logits are the same bits whatever the
batch, the rows around it, resampling or rollback (`tests/llama` checks the laws at tolerance 0
where that holds). Exactness then holds against the weights that run, evaluated one way.

Invariants of `LlamaCppSequences`: row b's id carries exactly the cells at positions
0 .. lengths[b] - 1 of its tokens; distinct rows have distinct ids; every id not held by an open
row is free and carries no cell; after `close()` other methods raise ValueError.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import pathlib

import numpy as np
import torch

from smc_sd.backends.base import (
    ContextOverflowError,
    LanguageModel,
    Sequences,
    TokenizerMismatchError,
    Vocabulary,
    check_counts,
    check_extend,
    check_join,
    check_open,
    check_rows,
    check_truncate,
    check_truncate_rows,
)
from smc_sd.backends.llama_formats import DEFAULT_FORMAT, FORMATS, PASS_COSTS, SHIPPED_FORMAT, format_copy
from smc_sd.backends.pass_cost import PassCost

#: the portable build of the llama extra (no -march=native: the building and the running
#: processor may differ); README, "llama.cpp backend"
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install -e ".[llama]"'

#: KV-cache bytes the default context may take (cells = this / bytes per cell, never fewer than
#: the model's own context)
DEFAULT_KV_BYTES = 512 << 20

#: bytes of one float16 key or value element (llama.cpp's default KV type)
KV_ELEMENT_BYTES = 2

#: the most threads a pass gets by default (more cores than this gain little on small models and
#: take the machine from everything else)
MAX_DEFAULT_THREADS = 8

#: llama.cpp's ggml log level of errors (GGML_LOG_LEVEL_ERROR)
_LOG_ERROR = 4

_llama = None
_log_callback = None
_last_errors: list[str] = []


def llama_cpp():
    """The `llama_cpp` module, imported (and its backend initialised, its log silenced) once.

    Raises:
        ValueError: when llama-cpp-python is not installed, saying how to install it.
    """
    global _llama, _log_callback
    if _llama is None:
        try:
            import llama_cpp as module
        except ImportError as error:
            raise ValueError(f"--backend llama-cpp needs llama-cpp-python, which is not installed; install the extra (it builds llama.cpp, 10-16 min on 2 cores): {INSTALL}") from error

        def log(level, text, _data):
            # llama.cpp logs every load at length; keep its errors for our one-line messages
            if level == _LOG_ERROR and text:
                _last_errors.append(text.decode(errors="replace").strip())
                del _last_errors[:-4]

        _log_callback = module.llama_log_callback(log)
        module.llama_log_set(_log_callback, ctypes.c_void_p(0))
        module.llama_backend_init()
        _llama = module
    return _llama


def default_threads(cap: int = MAX_DEFAULT_THREADS) -> int:
    """One thread per physical core this process may run on (hyper-threads of one core count
    once, as read from /sys), at most `cap`; the logical CPU count where the topology is unknown."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = pathlib.Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, min(cap, len(cores)))


def _llama_error() -> str:
    """llama.cpp's last logged error, or an empty string."""
    return f" ({_last_errors[-1]})" if _last_errors else ""


class LlamaCppLanguageModel(LanguageModel):
    """One GGUF model in one llama.cpp context with a unified KV cache.

    Args:
        path: a local GGUF file.
        tokenizer: a transformers tokenizer whose token ids are the GGUF's (None: loaded from the
            GGUF by transformers, `gguf_tokenizer`).
        n_seq_max: rows (of all open `Sequences` together) the context holds, at most 255:
            llama.cpp's `llama_max_parallel_sequences()` (256) less the parking sequence.
        n_cells: KV cells of the context (None: DEFAULT_KV_BYTES worth, at least the model's
            context length).
        n_threads: threads of every decode, >= 1 (None: `default_threads()`, one per physical
            core, at most MAX_DEFAULT_THREADS; benchmarks pass 1).

    Raises:
        ValueError: one line naming the problem (a missing or unreadable file, n_seq_max past
            llama.cpp's limit, a tokenizer whose ids differ from the GGUF's).
    """

    def __init__(self, path, tokenizer=None, n_seq_max: int = 16, n_cells: int | None = None, n_threads: int | None = None):
        llama = llama_cpp()
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no such GGUF file")
        # one sequence id more than the rows: PARKING (see `park`)
        limit = llama.llama_max_parallel_sequences() - 1
        if not 1 <= n_seq_max <= limit:
            raise ValueError(f"the schedule needs {n_seq_max} llama.cpp sequences (particles x running requests); one llama.cpp context holds 1 .. {limit} rows")
        if n_threads is not None and not (isinstance(n_threads, int) and n_threads >= 1):
            raise ValueError(f"threads must be a whole number >= 1, got {n_threads!r}")
        params = llama.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = llama.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"{self.path}: llama.cpp cannot load it as a GGUF model{_llama_error()}")
        model = self._model
        self._vocab = llama.llama_model_get_vocab(model)
        n_vocab = llama.llama_vocab_n_tokens(self._vocab)
        ftype = llama.llama_model_ftype(model)
        #: the weights' format as llama.cpp names the file's type (q4_1 for the shipped file)
        self.weight_format = next((name for name, value in FORMATS.items() if value == ftype), f"ftype {ftype}")
        #: KV bytes of one cell: keys and values of every layer
        self.cell_bytes = 2 * llama.llama_model_n_layer(model) * llama.llama_model_n_head_kv(model) * (llama.llama_model_n_embd(model) // llama.llama_model_n_head(model)) * KV_ELEMENT_BYTES
        context = llama.llama_model_n_ctx_train(model)
        cells = n_cells or max(context, DEFAULT_KV_BYTES // self.cell_bytes)
        threads = n_threads or default_threads()
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = cells
        # one decode may carry every cell's token (a join of long prompts); llama.cpp splits it
        # into physical batches of n_ubatch
        cparams.n_batch = cells
        cparams.n_seq_max = n_seq_max + 1
        cparams.kv_unified = True
        # flash attention: a query's result depends only on its own sequence's cells in cache
        # order, so with every sequence's cells in position order (`park`) a position's logits
        # are the same bits whatever the batch around it (module docstring, "Numerics")
        cparams.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self._ctx = llama.llama_init_from_model(model, cparams)
        if not self._ctx:
            raise ValueError(f"{self.path}: llama.cpp cannot make a context of {cells} cells and {n_seq_max} sequences{_llama_error()}")
        self._memory = llama.llama_get_memory(self._ctx)
        self.n_cells = llama.llama_n_ctx(self._ctx)
        #: threads of every decode, as llama.cpp reports them back
        self.n_threads = llama.llama_n_threads(self._ctx)
        self.n_seq_max = n_seq_max
        self._batch = DecodeBatch(llama)
        self._max_length = min(context, self.n_cells)
        self._free_ids = list(range(n_seq_max - 1, -1, -1))
        self._parking = n_seq_max
        #: cells the parking sequence holds (an upper bound: cells parked twice count twice)
        self.parked = 0
        self.trie = CellTrie()
        self.fingerprint = gguf_fingerprint(llama, self._vocab, n_vocab)
        self.tokenizer = tokenizer if tokenizer is not None else gguf_tokenizer(self.path)
        if vocabulary_fingerprint(self.tokenizer) != self.fingerprint:
            raise TokenizerMismatchError(f"{self.path}: the tokenizer's token ids differ from the GGUF's own vocabulary (a draft must share the target's tokenizer)")
        self._vocabulary = Vocabulary(n_vocab, llama.llama_vocab_eos(self._vocab), self.fingerprint)

    @classmethod
    def default(cls, weight_format: str = DEFAULT_FORMAT, **options) -> LlamaCppLanguageModel:
        """The embedded default model, SmolLM2-135M-Instruct, from the shipped GGUF (Q4_1) or, for
        another `weight_format`, llama.cpp's cached copy of it (`llama_formats.format_copy`; the
        default, DEFAULT_FORMAT, is chosen by measured pass costs), with the tokenizer the
        shipped file holds (the hf backend's token ids)."""
        from smc_sd.models.smollm2 import gguf_path

        shipped = gguf_path()
        path = shipped if weight_format == SHIPPED_FORMAT else format_copy(shipped, weight_format)
        options.setdefault("tokenizer", gguf_tokenizer(shipped))
        return cls(path, **options)

    @property
    def vocabulary(self) -> Vocabulary:
        return self._vocabulary

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def pass_cost(self) -> PassCost:
        """What a decode of n positions costs in one-position decodes, for this weight format
        (PASS_COSTS; the costliest table, Q4_1's, for a format not measured)."""
        return PASS_COSTS.get(self.weight_format, PASS_COSTS["q4_1"])

    def open(self, prompt: list[int], batch_size: int) -> tuple[LlamaCppSequences, torch.Tensor]:
        """Decode the prompt once for one sequence id and give its cells to `batch_size` ids.

        Returns:
            The rows and the next-token logits after the prompt, [V] float32.
        """
        check_open(prompt, batch_size, self.max_length)
        rows = LlamaCppSequences(self)
        return rows, rows.join(prompt, batch_size)

    def check_room(self, count: int, freed: int = 0) -> None:
        """Refuse to take `count` sequence ids once `freed` more are free.

        Raises:
            ValueError: when fewer would be free than asked.
        """
        if count > len(self._free_ids) + freed:
            raise ValueError(f"the rows need {count} more llama.cpp sequences; {self.n_seq_max - len(self._free_ids) - freed} of this context's {self.n_seq_max} (n_seq_max) are in use")

    def acquire(self, count: int) -> list[int]:
        """`count` free sequence ids (`check_room`'s error when fewer are free)."""
        self.check_room(count)
        taken = [self._free_ids.pop() for _ in range(count)]
        return taken

    def release(self, ids: list[int], lengths: list[int]) -> None:
        """Park every cell of the ids (`park`) and free the ids; lengths[i]: the cells ids[i] holds."""
        for seq, length in zip(ids, lengths):
            self.park(seq, 0, length)
        self._free_ids.extend(ids)

    def copy(self, source: int, destination: int) -> None:
        """Add `destination` to every cell of `source` (the cells are shared, no byte moves)."""
        _llama.llama_memory_seq_cp(self._memory, source, destination, -1, -1)

    def park(self, seq: int, start: int, length: int) -> None:
        """Remove `seq` from its cells at positions start .. length - 1, which stay held by the
        parking sequence instead of becoming free.

        llama.cpp gives new tokens the first free cells; a cell freed below a sequence's other
        cells would take its next token out of position order, and flash attention sums a
        sequence's cells in cache order (in float16), so the same position's logits would change
        by llama.cpp's rounding (measured on the shipped Q4_1 file: up to 0.5, TV 0.04, since a
        rounding change flips 8-bit activation roundings in later layers). Parked cells keep
        every new cell past all others; they are freed when no row holds a cell (`unpark`).
        """
        if length <= start:
            return
        _llama.llama_memory_seq_cp(self._memory, seq, self._parking, start, length)
        if not _llama.llama_memory_seq_rm(self._memory, seq, start, -1):
            raise RuntimeError(f"llama.cpp refused to remove sequence {seq} past position {start}")
        self.parked += length - start

    def unpark(self) -> None:
        """Free the parked cells (every cell is free afterwards when no row holds one)."""
        _llama.llama_memory_seq_rm(self._memory, self._parking, -1, -1)
        self.parked = 0

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def run(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray) -> torch.Tensor:
        """One `llama_decode` of n tokens, token i at position positions[i] of the sequences seqs[i].

        Args:
            tokens, positions: [n] int32; outputs: [n] int8, 1 where logits are read.
            seqs: [n] int32 (one sequence per token) or [n, W] int32, the sequences of token i
                first and -1 after them (a token of several sequences writes one cell they share).

        Returns:
            [sum(outputs), V] float32 logits of the flagged tokens, in batch order.

        Raises:
            ContextOverflowError: when the KV cache has no room for the tokens.
            RuntimeError: on any other llama.cpp failure.
        """
        n = len(tokens)
        batch = self._batch.fill(tokens, positions, seqs, outputs)
        if self.trie.live == 0 and self.parked:
            self.unpark()
        status = _llama.llama_decode(self._ctx, batch)
        if status == 1 and self.parked:
            # room before order: the parked cells go, and later tokens may take cells below
            # their sequence's others (logits then move by rounding, see `park`)
            self.unpark()
            status = _llama.llama_decode(self._ctx, batch)
        if status == 1:
            raise ContextOverflowError(f"llama.cpp's KV cache is full: {n} new tokens do not fit in its {self.n_cells} cells ({self.trie.live} in use); use fewer particles or requests, or more cells (n_cells)")
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}{_llama_error()}")
        # [count, V] float32: llama.cpp's output rows (batch order), one memcpy into a new tensor
        logits = torch.empty(int(np.count_nonzero(outputs)), self._vocabulary.size, dtype=torch.float32)
        ctypes.memmove(logits.data_ptr(), _llama.llama_get_logits(self._ctx), logits.numel() * 4)
        return logits

    def __del__(self):
        if _llama is not None:
            if getattr(self, "_ctx", None):
                _llama.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_model", None):
                _llama.llama_model_free(self._model)
                self._model = None


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

    def __init__(self, lm: LlamaCppLanguageModel):
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
        """Add counts[j] rows holding prompts[j], every prompt decoded once in ONE decode.

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
        tokens = np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts])
        positions = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
        seqs = np.concatenate([np.full(len(p), ids[f], dtype=np.int32) for p, f in zip(prompts, firsts)])
        # a logits flag on each prompt's last token
        outputs = np.zeros(len(tokens), dtype=np.int8)
        outputs[np.cumsum([len(p) for p in prompts]) - 1] = 1
        try:
            logits = lm.run(tokens, positions, seqs, outputs)
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


def gguf_fingerprint(llama, vocab, n_vocab: int) -> str:
    """`vocabulary_fingerprint` of the GGUF's own token list: sha256 (hex) of the sorted
    (token text, id) pairs, equal to the fingerprint of a transformers tokenizer with those ids."""
    pairs = sorted((llama.llama_vocab_get_text(vocab, i).decode("utf-8", errors="surrogateescape"), i) for i in range(n_vocab))
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


def vocabulary_fingerprint(tokenizer) -> str:
    """sha256 (hex) of the tokenizer's sorted (token string, id) pairs (as the hf backend's)."""
    pairs = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


def gguf_tokenizer(path: pathlib.Path):
    """The transformers tokenizer a GGUF file holds, read once and kept in smc-sd's cache.

    transformers parses the file's metadata to build it (about 7 s for the default model), so
    the tokenizer is saved under the cache root, keyed by the file's path, size and time.
    """
    from transformers import AutoTokenizer

    from smc_sd.models.smollm2 import cache_root, write_directory_atomically

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = pathlib.Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    directory = cache_root() / "gguf-tokenizers" / f"{path.stem}-{key}"
    if not directory.is_dir():
        directory.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        write_directory_atomically(directory, tokenizer.save_pretrained)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)
