"""The default model's linear layers over T tokens, by kernel: F.linear, oneDNN on the dense
weight, oneDNN on the packed weight (`smc_sd.backends.onednn_linear`).

Every linear layer of the embedded default model (its 30 decoder layers' seven projections and
the 49,152-token head) is applied once to T random rows, per dtype and kernel, in one process
one after the other; reported: milliseconds per sweep of all layers (the best of `--repeats`),
and `packed_speedup` = the faster unpacked kernel's time over the packed kernel's. Times only
the kernels, with the model's own weights; the whole forward is `forward_cost.py --linear`.

Torch runs one thread (check `uptime` first). Prints JSON; writes results/linear_kernels.json.

Usage: python benchmarks/linear_kernels.py [--tokens 1,4,16,48,128,512,1024,2048,4096]
       [--dtypes float32,bfloat16] [--repeats 3] [--no-write]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _common import emit, environment, progress

from smc_sd.backends.onednn_linear import PACKING_ROWS_HINT, onednn_dtypes


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """The weights of every linear layer of the default model, in `dtype` (the head's tied to
    the embedding)."""
    from transformers import AutoModelForCausalLM

    from smc_sd.models.smollm2 import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=dtype, local_files_only=True)
    return [module.weight.detach() for module in model.modules() if isinstance(module, torch.nn.Linear)]


def sweep_ms(kernel, weights: list[torch.Tensor], tokens: int, repeats: int) -> float:
    """The best time of one pass of `kernel(x, weight)` over every weight, T rows of input."""
    inputs = {size: torch.randn(tokens, size, dtype=weights[0].dtype) for size in {w.shape[1] for w in weights}}
    best = float("inf")
    with torch.no_grad():
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            for weight in weights:
                kernel(inputs[weight.shape[1]], weight)
            if attempt:  # the first sweep warms caches and oneDNN's kernel choice
                best = min(best, time.perf_counter() - start)
    return 1e3 * best


def measure(dtype: torch.dtype, tokens: list[int], repeats: int) -> dict:
    weights = model_weights(dtype)
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, PACKING_ROWS_HINT) for w in weights}
    kernels = {
        "F.linear": lambda x, w: F.linear(x, w),
        "onednn_dense": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "onednn_packed": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], None, "none", [], ""),
    }
    rows = []
    for count in tokens:
        times = {name: sweep_ms(kernel, weights, count, repeats) for name, kernel in kernels.items()}
        unpacked = min(times["F.linear"], times["onednn_dense"])
        rows.append({"tokens": count, "ms": times, "packed_speedup": unpacked / times["onednn_packed"]})
        progress(f"{dtype} T={count}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items()))
    return {"dtype": str(dtype).removeprefix("torch."), "layers": len(weights), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,4,16,48,128,512,1024,2048,4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    refused = [d for d in dtypes if d not in onednn_dtypes()]
    if refused:
        parser.error(f"--dtypes: oneDNN does not compute {refused[0]} natively on this processor")
    torch.set_num_threads(1)
    data = {"environment": environment(), "packing_rows_hint": PACKING_ROWS_HINT,
            "results": [measure(dtype, tokens, args.repeats) for dtype in dtypes]}
    emit("linear_kernels", data, write=not args.no_write)


if __name__ == "__main__":
    main()
