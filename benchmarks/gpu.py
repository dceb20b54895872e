"""Per-cycle cost of ar, sd and smc-sd on an H200-class CUDA GPU, with real-sized random models.

No weights can be downloaded on the GPU machine, and timing does not depend on weight values, so
the target is a Llama-3.1-8B-shaped and the draft a Llama-3.2-1B-shaped model with random bf16
weights (HF eager, batch 1, a 256-token prompt in the KV cache). Per cycle:
- ar: one target forward of [1, 1] tokens; 1 token per cycle.
- sd(K): K draft forwards of [1, 1] and one target forward of [1, K + 1]; tokens per cycle are
  the standard expectation (1 - a^(K+1)) / (1 - a) at acceptance rate a (shown for a = 0.6..0.9;
  acceptance is a property of the real draft/target pair, not of random weights).
- smc-sd(N, K): K draft forwards of [N, 1], one target forward of [N, K + 1] and one resampling
  (a row gather of both KV caches); exactly K + 1 tokens per cycle, whatever the acceptance.
tokens/s = tokens per cycle / cycle time. Next to them: the memory-bandwidth floor of one target
step, (weight bytes + KV bytes) / bandwidth, which a CUDA-graph-captured static step approaches
and eager HF (launch-bound) does not.

Usage: python benchmarks/gpu.py [--shapes llama|tiny] [--device cuda] [--iters 20]
(`--shapes tiny --device cpu` is a smoke test of the script itself.) Sized to finish in under
5 minutes on an H200: 16 settings, each 3 warm-up and 20 timed cycles (not yet run on one).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from _common import emit, environment

SHAPES = {
    "llama": {
        "target": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
        "draft": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                      tie_word_embeddings=True),
        "names": ("Llama-3.1-8B-shaped", "Llama-3.2-1B-shaped"),
    },
    "tiny": {
        "target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1024),
        "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024),
        "names": ("tiny target", "tiny draft"),
    },
}
DRAFT_LENS = (2, 4, 8)
PARTICLES = (4, 8, 16, 32)
ACCEPTANCE = (0.6, 0.7, 0.8, 0.9)
# measured device-to-device copy on the project's H200 (TB/s); the datasheet says 4.8
H200_BANDWIDTH_TBS = 4.27


def build(config_kwargs: dict, device: str, dtype: torch.dtype):
    """A LlamaForCausalLM with random weights, created directly on `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=8192, **config_kwargs)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class Rows:
    """B rows of one model sharing a prompt, in one DynamicCache; `step` times a forward and
    rolls the cache back, so every timed forward sees the same prompt length."""

    def __init__(self, model, prompt_len: int, batch: int):
        from transformers import DynamicCache

        self.model = model
        self.kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.vocab = model.config.vocab_size
        self.cache = DynamicCache()
        prompt = torch.randint(self.vocab, (1, prompt_len), device=model.device)
        self.forward(prompt)
        with torch.inference_mode():
            self.cache.batch_repeat_interleave(batch)
        self.length, self.batch = prompt_len, batch

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, L] at the cache's end; return logits [B, L, V]."""
        start = self.cache.get_seq_length()
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        with torch.inference_mode():
            return self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                              **{self.kwarg: self.cache}).logits

    def rollback(self) -> None:
        extra = self.cache.get_seq_length() - self.length
        if extra > 0:
            with torch.inference_mode():
                # a negative argument removes that many positions (every transformers 4.4x-5.x)
                self.cache.crop(-extra)

    def tokens(self, length: int) -> torch.Tensor:
        # [B, length] random ids
        return torch.randint(self.vocab, (self.batch, length), device=self.model.device)


def cycle_ms(target, draft, particles: int, draft_len: int, prompt_len: int, device: str, iters: int,
             resample: bool) -> float:
    """Median milliseconds of one cycle: K draft steps [N, 1], a target step [N, K + 1] and (for
    smc-sd) one resampling gather of both caches; caches are rolled back outside the timing."""
    t_rows = Rows(target, prompt_len, particles)
    d_rows = Rows(draft, prompt_len, particles) if draft_len else None
    block = t_rows.tokens(draft_len + 1)
    ancestors = torch.arange(particles, device=device).flip(0)

    def cycle():
        for _ in range(draft_len):
            logits = d_rows.forward(d_rows.tokens(1))
            torch.multinomial(torch.softmax(logits[:, -1].float(), -1), 1)
        logits = t_rows.forward(block)
        torch.log_softmax(logits.float(), -1)
        if resample:
            with torch.inference_mode():
                t_rows.cache.batch_select_indices(ancestors)
                d_rows.cache.batch_select_indices(ancestors)

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    for i in range(iters + 3):
        sync()
        start = time.perf_counter()
        cycle()
        sync()
        if i >= 3:
            times.append(1000 * (time.perf_counter() - start))
        t_rows.rollback()
        if d_rows is not None:
            d_rows.rollback()
    del t_rows, d_rows
    return statistics.median(times)


def expected_sd_tokens(acceptance: float, draft_len: int) -> float:
    """E[tokens per sd cycle] = (1 - a^(K+1)) / (1 - a) for i.i.d. acceptance a (Leviathan et al.)."""
    return (1 - acceptance ** (draft_len + 1)) / (1 - acceptance)


def memory_floor_ms(model, prompt_len: int, bandwidth_tbs: float) -> tuple[float, float]:
    """(floor ms, bytes): reading every weight and the prompt's KV once at `bandwidth_tbs`."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * prompt_len * 2
    total = weight_bytes + kv_bytes
    return 1000 * total / (bandwidth_tbs * 1e12), total


def table(data: dict) -> str:
    lines = [f"{'method':<22}{'cycle ms':>10}{'tok/cycle':>11}{'tok/s':>10}{'x ar':>8}"]
    for r in data["rows"]:
        lines.append(f"{r['label']:<22}{r['cycle_ms']:>10.2f}{r['tokens_per_cycle']:>11.2f}"
                     f"{r['tokens_per_second']:>10.1f}{r['speedup_vs_ar']:>8.2f}")
    f = data["floor"]
    lines.append(f"{'target step floor':<22}{f['ms']:>10.2f}{1:>11.2f}{1000 / f['ms']:>10.1f}"
                 f"{(1000 / f['ms']) / data['rows'][0]['tokens_per_second']:>8.2f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH_TBS, help="memory bandwidth, TB/s")
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu.py: no CUDA device; use --shapes tiny --device cpu for a smoke run")

    started = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    shapes = SHAPES[args.shapes]
    target = build(shapes["target"], args.device, dtype)
    draft = build(shapes["draft"], args.device, dtype)
    time_cycle = lambda n, k, resample: cycle_ms(target, draft, n, k, args.prompt_len, args.device, args.iters, resample)

    ar_ms = time_cycle(1, 0, False)
    rows = [{"label": "ar", "method": "ar", "particles": 1, "draft_len": 0, "cycle_ms": ar_ms, "tokens_per_cycle": 1.0}]
    for k in DRAFT_LENS:
        ms = time_cycle(1, k, False)
        for a in ACCEPTANCE:
            rows.append({"label": f"sd K={k} a={a}", "method": "sd", "particles": 1, "draft_len": k, "acceptance": a,
                         "cycle_ms": ms, "tokens_per_cycle": expected_sd_tokens(a, k)})
    for n in PARTICLES:
        for k in DRAFT_LENS:
            rows.append({"label": f"smc-sd N={n} K={k}", "method": "smc-sd", "particles": n, "draft_len": k,
                         "cycle_ms": time_cycle(n, k, True), "tokens_per_cycle": float(k + 1)})
    for r in rows:
        r["tokens_per_second"] = 1000 * r["tokens_per_cycle"] / r["cycle_ms"]
        r["speedup_vs_ar"] = r["tokens_per_second"] / rows[0]["tokens_per_second"]
    floor_ms, floor_bytes = memory_floor_ms(target, args.prompt_len, args.bandwidth)
    data = {
        "benchmark": "gpu",
        "target": shapes["names"][0],
        "draft": shapes["names"][1],
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "batch": 1,
        "environment": environment(),
        "floor": {"ms": floor_ms, "bytes": floor_bytes, "bandwidth_tbs": args.bandwidth},
        "rows": rows,
        "wall_seconds": time.perf_counter() - started,
    }
    emit("gpu", data, write=not args.no_write)
    print(table(data))
    return data


if __name__ == "__main__":
    main()
