"""KV-cache memory of SMC-SD: the shared token-trie cache against one full copy per particle.

For each configuration (method, N particles, draft length K) one run decodes `--new-tokens`
tokens after a `--prompt-tokens` prompt; reported per configuration:
- naive_kv_bytes: the peak of N · length positions' KV, what per-particle copies hold;
- shared_kv_bytes: the peak KV bytes in use in the block pools (target and draft together);
- saving: 1 - shared / naive.

The configurations: SMC-SD at N = 8 and 16, K = 8 (it never truncates: every particle keeps
its K + 1 tokens), and exact speculative decoding (`sd`, one sequence, K = 8), which truncates
both caches every cycle to drop the rejected drafts. One sequence has nothing to share, so its
saving is slightly below 0 (the pools hold whole blocks, so the last block's unfilled positions
count): the figure shows that truncation returns what it cuts, since blocks kept past it would
push the shared peak above the naive one. (Refilled blocks shared with other block tables are
checked by tests/test_kv_cache.py.)

Modes:
- "dry" (default, seconds): the real SMC-SD engine and the real cache bookkeeping
  (`smc_sd.backends.dry_run`), sized by the default target's and draft's KV (layers, heads,
  head size, dtype), with a cheap bigram target and a noisy bigram draft answering the
  forwards. Block counts are exact for the token streams the run produced; how often SMC-SD
  resamples, and so how much it shares, depends on the draft-target mismatch of the bigram pair,
  not of the real models.
  Measured with the defaults: 0.83 at N = 8 (resampling in 49 of 57 cycles) and 0.89 at
  N = 16; a closer draft (--noise 0.3, 9 resamples at N = 8) 0.63; a draft equal to the
  target (--noise 0, never resampling) 0.28, the prompt's sharing alone; sd -0.002 (-0.01
  with the other two drafts).
- "real": the default model and default draft with the paged cache, the same engine, the
  opening of README.md as the prompt; minutes on a CPU (set OMP_NUM_THREADS=1 on a shared
  machine). A run ends early when every particle has emitted EOS: `new_tokens` says how far the
  longest particle got.

Usage: python benchmarks/kv_memory.py [--json] [--mode dry|real] [--new-tokens 512]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch
from _common import emit

from smc_sd.backends.base import LanguageModel, Sequences, Vocabulary

# (method, particles N, draft length K)
CONFIGS = [("smc-sd", 8, 8), ("smc-sd", 16, 8), ("sd", 1, 8)]
README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


class BigramLM(LanguageModel):
    """Next-token logits that depend on the last token only: one [V, V] table.

    Args:
        table: [V, V] float32, row t the logits after token t.
    """

    def __init__(self, table: torch.Tensor, max_length: int = 8192):
        self.table = table
        self._max_length = max_length
        self._vocabulary = Vocabulary(table.shape[0], table.shape[0] - 1, f"bigram-{table.shape[0]}")

    @property
    def vocabulary(self) -> Vocabulary:
        return self._vocabulary

    @property
    def max_length(self) -> int:
        return self._max_length

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))

    def open(self, prompt: list[int], batch_size: int):
        # [B, len(prompt)]
        tokens = torch.tensor([prompt], dtype=torch.int64).expand(batch_size, -1)
        return BigramRows(self, tokens), self.table[prompt[-1]]


class BigramRows(Sequences):
    """B rows of a `BigramLM`: their token ids [B, length] int64 (the logits read the last)."""

    def __init__(self, lm: BigramLM, tokens: torch.Tensor):
        self._lm, self._tokens = lm, tokens

    @property
    def batch_size(self) -> int:
        return self._tokens.shape[0]

    @property
    def length(self) -> int:
        return self._tokens.shape[1]

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        self._tokens = torch.cat([self._tokens, tokens], 1)
        # [B, L, V]
        return self._lm.table[tokens]

    def select(self, rows: torch.Tensor) -> None:
        self._tokens = self._tokens[rows]

    def truncate(self, length: int) -> None:
        self._tokens = self._tokens[:, :length]


def bigram_pair(vocab: int, sharpness: float, noise: float, seed: int) -> tuple[BigramLM, BigramLM]:
    """A bigram target with logits sharpness · N(0, 1), no EOS, and a draft adding noise · N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    table = sharpness * torch.randn(vocab, vocab, generator=generator)
    table[:, -1] = -torch.inf
    draft = table + noise * torch.randn(vocab, vocab, generator=generator)
    return BigramLM(table), BigramLM(draft)


def kv_bytes_per_position(lm) -> int:
    """KV bytes of one position of an `HFLanguageModel`: keys and values of every layer."""
    config = lm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * lm.model.dtype.itemsize


def dry_models(block_size: int, args):
    """Bigram models answering the forwards, with the default target's and draft's KV sizes."""
    from smc_sd.backends.dry_run import DryRunLM

    sized = real_models(block_size)
    target, draft = bigram_pair(args.vocab, args.sharpness, args.noise, args.seed)
    return tuple(
        DryRunLM(bigram, kv_bytes_per_position(lm) * block_size, block_size)
        for bigram, lm in zip((target, draft), sized)
    )


def real_models(block_size: int):
    from smc_sd.backends.hf import HFLanguageModel

    return HFLanguageModel.default(block_size=block_size), HFLanguageModel.default_draft(block_size=block_size)


def measure(
    target, draft, method: str, particles: int, draft_len: int, prompt: list[int], new_tokens: int, seed: int
) -> dict:
    from smc_sd import Schedule
    from smc_sd.programs import get

    program = get(method).program(target, draft, draft_len=draft_len)
    result = program.run(prompt, Schedule(particles, max_tokens=new_tokens), seed=seed)
    naive, shared = result.kv["naive_peak_bytes"], result.kv["peak_bytes"]
    return {
        "method": method,
        "particles": particles,
        "draft_len": draft_len,
        "prompt_tokens": len(prompt),
        # the longest particle: a run stops early only when every particle has emitted EOS
        "new_tokens": max(len(p) for p in result.particles),
        "naive_kv_bytes": naive,
        "shared_kv_bytes": shared,
        "saving": 1 - shared / naive,
        "resamples": result.resamples,
        "cycles": len(result.cycles),
        "seconds": result.seconds,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no files")
    parser.add_argument("--json", dest="no_write", action="store_true", help="the same as --no-write")
    parser.add_argument("--mode", choices=["dry", "real"], default="dry")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64, help="dry mode: bigram vocabulary")
    parser.add_argument("--sharpness", type=float, default=3.0, help="dry mode: target logit scale")
    parser.add_argument("--noise", type=float, default=1.0, help="dry mode: draft logit noise")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.mode == "dry":
        target, draft = dry_models(args.block_size, args)
    else:
        target, draft = real_models(args.block_size)
    if args.mode == "dry":
        generator = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, target.vocabulary.size - 1, (args.prompt_tokens,), generator=generator).tolist()
    else:
        # natural text for the real model: the opening of this project's README
        prompt = target.tokenizer.encode(README.read_text(), add_special_tokens=False)[: args.prompt_tokens]
    started = time.perf_counter()
    configs = [measure(target, draft, method, n, k, prompt, args.new_tokens, args.seed) for method, n, k in CONFIGS]
    data = {
        "benchmark": "kv_memory",
        "mode": args.mode,
        "model": "SmolLM2-135M-Instruct (fp32) and the default draft: their KV shapes",
        "block_size": args.block_size,
        "configs": configs,
        "wall_seconds": time.perf_counter() - started,
    }
    if args.mode == "dry":
        data["dry_models"] = {"vocab": args.vocab, "sharpness": args.sharpness, "noise": args.noise}
    emit(f"kv_memory_{args.mode}", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
