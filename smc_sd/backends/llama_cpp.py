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

The rows, their cell trie and the reusable batch live in `smc_sd.backends.llama_rows`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import pathlib

import numpy as np
import torch

from smc_sd.backends.base import ContextOverflowError, LanguageModel, TokenizerMismatchError, Vocabulary, check_open
from smc_sd.backends.llama_library import _llama_error, llama_cpp
from smc_sd.backends.llama_formats import DEFAULT_FORMAT, FORMATS, PASS_COSTS, format_path
from smc_sd.backends.llama_rows import CellTrie, DecodeBatch, LlamaCppSequences
from smc_sd.backends.pass_cost import PassCost

#: KV-cache bytes the default context may take (cells = this / bytes per cell, never fewer than
#: the model's own context)
DEFAULT_KV_BYTES = 512 << 20

#: bytes of one float16 key or value element (llama.cpp's default KV type)
KV_ELEMENT_BYTES = 2

#: the most threads a pass gets by default (more cores than this gain little on small models and
#: take the machine from everything else)
MAX_DEFAULT_THREADS = 8

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
        llama = self._lib = llama_cpp()
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
        """The embedded default model, SmolLM2-135M-Instruct: the shipped GGUF (Q4_1, DEFAULT_FORMAT)
        or, for another `weight_format`, llama.cpp's cached copy of it (`llama_formats.format_path`),
        with the tokenizer the shipped file holds (the hf backend's token ids)."""
        from smc_sd.models.smollm2 import gguf_path

        options.setdefault("tokenizer", gguf_tokenizer(gguf_path()))
        return cls(format_path(weight_format), **options)

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
        self._lib.llama_memory_seq_cp(self._memory, source, destination, -1, -1)

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
        self._lib.llama_memory_seq_cp(self._memory, seq, self._parking, start, length)
        if not self._lib.llama_memory_seq_rm(self._memory, seq, start, -1):
            raise RuntimeError(f"llama.cpp refused to remove sequence {seq} past position {start}")
        self.parked += length - start

    def unpark(self) -> None:
        """Free the parked cells (every cell is free afterwards when no row holds one)."""
        self._lib.llama_memory_seq_rm(self._memory, self._parking, -1, -1)
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
        status = self._lib.llama_decode(self._ctx, batch)
        if status == 1 and self.parked:
            # room before order: the parked cells go, and later tokens may take cells below
            # their sequence's others (logits then move by rounding, see `park`)
            self.unpark()
            status = self._lib.llama_decode(self._ctx, batch)
        if status == 1:
            raise ContextOverflowError(f"llama.cpp's KV cache is full: {n} new tokens do not fit in its {self.n_cells} cells ({self.trie.live} in use); use fewer particles or requests, or more cells (n_cells)")
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}{_llama_error()}")
        # [count, V] float32: llama.cpp's output rows (batch order), one memcpy into a new tensor
        logits = torch.empty(int(np.count_nonzero(outputs)), self._vocabulary.size, dtype=torch.float32)
        ctypes.memmove(logits.data_ptr(), self._lib.llama_get_logits(self._ctx), logits.numel() * 4)
        return logits

    def __del__(self):
        if getattr(self, "_lib", None) is not None:
            if getattr(self, "_ctx", None):
                self._lib.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_model", None):
                self._lib.llama_model_free(self._model)
                self._model = None


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
