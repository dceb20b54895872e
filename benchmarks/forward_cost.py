"""What one target forward costs, rows x new tokens, in each dtype: the cost of a verify pass.

For every dtype in --dtypes and every shape B x L in --shapes, B rows are opened on a
--context-token prompt (untimed) and the timed `extend` appends [B, L] tokens; the rows are
closed again before the next shape opens its own, so a pass sees its own rows' cache only, as a
request's pass does (llama.cpp's unified KV cache: attention and its mask walk every cell up to
the highest one in use, so other rows' cells would cost the pass time). The dtypes and shapes
take turns within each of --repeats rounds (after one untimed round), so a change of load on the
machine hits them alike. Reported per (dtype, shape): the median and the minimum in ms,
and `over_1x1`, the median / that dtype's 1x1 median (what a verify of B x L tokens costs in
one-token passes).

`lm_head` rows time the output layer alone (hidden [R, D] -> logits [R, V] float32) both ways a
bfloat16 model can produce float32 logits: the head in bfloat16 and the logits cast after it
(what the hf backend does), or the hidden states cast and a float32 copy of the head.

Every timing depends on the processor: bfloat16 pays where it has native bf16 matrix
instructions (environment.processor names them), and float32 is faster without them.

`--linear onednn,blas` times the hf models twice, with their linear layers as the backend loads
them (oneDNN, `smc_sd.backends.onednn_linear`) and as torch computes them by default (`F.linear`,
the BLAS torch was built with); the second's rows carry `backend` "hf-blas".

`--backend llama-cpp` (or `hf,llama-cpp`, both in one run) times the llama.cpp backend too, one
model per weight format in --formats (q4_1: the shipped file as it ships; q4_0, q8_0, f16, f32:
copies llama.cpp's quantizer writes from it, cached as the backend caches them,
`llama_formats.format_copy`), one thread per decode; its rows carry `backend` "llama-cpp" and
the format as `dtype`. Beside them, rows of `backend` "llama-cpp-python" time llama-cpp-python's
own decode step on the same file (`Llama.eval` of one token after the same context, its default
context: no flash attention, one sequence, one thread), the cost our 1x1 pass is held to; and
`build` records llama.cpp's system info (the instruction sets the build uses).

Usage: OMP_NUM_THREADS=1 python benchmarks/forward_cost.py [--dtypes float32,bfloat16] [--shapes 1x1,1x5,4x5,8x5]
       [--context 100] [--repeats 5] [--backend hf|llama-cpp|hf,llama-cpp] [--formats q4_1,q8_0]
       [--linear onednn|blas|onednn,blas] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import emit, environment

SHAPES = "1x1,1x5,4x1,4x5,8x5,16x5"
HEAD_ROWS = (1, 5, 20, 40)
TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening, trimmed the wick, polished the lens "
    "and wrote the weather in a ledger that nobody read. Ships passed far out at sea, and on clear nights "
    "their lights answered his own. In winter the storms came from the north and the island shook."
)


def context_tokens(tokenizer, length: int) -> list[int]:
    """`length` token ids of TEXT, repeated as needed."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


def timed(step) -> float:
    """Wall milliseconds of step()."""
    started = time.perf_counter()
    step()
    return (time.perf_counter() - started) * 1e3


def forward_step(lm, prompt: list[int], rows: int, new: int):
    """step() -> ms: opens `rows` rows on `prompt` (untimed), times one `extend` of [rows, new]
    tokens and closes the rows."""
    # [rows, new]: other tokens in every row (a backend may decode rows that gain the same
    # tokens after the same cells once)
    tokens = torch.tensor([prompt[b : b + new] for b in range(rows)])

    def step() -> float:
        sequences, _ = lm.open(prompt, rows)
        try:
            return timed(lambda: sequences.extend(tokens))
        finally:
            sequences.close()

    return step


def blas_linears(model) -> None:
    """Give every nn.Linear of `model` back torch's own forward (`F.linear`)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__dict__.pop("forward", None)


def head_steps(model, rows: int) -> dict:
    """The two ways to float32 logits from a bfloat16 model's head, on [rows, D] hidden states."""
    weight = model.lm_head.weight
    # [V, D] float32: the copy the second way needs besides the model's own weights
    weight32 = weight.float()
    hidden = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    return {
        "bfloat16 head, cast after": lambda: (hidden @ weight.T).float(),
        "float32 head": lambda: hidden.float() @ weight32.T,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to time")
    parser.add_argument("--shapes", default=SHAPES, help=f"comma-separated ROWSxTOKENS (default {SHAPES})")
    parser.add_argument("--context", type=int, default=100, help="tokens already in every row")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (the median is reported)")
    parser.add_argument("--backend", default="hf", help="hf, llama-cpp, or hf,llama-cpp (both in one run)")
    parser.add_argument("--formats", default="q4_1", help="llama-cpp: comma-separated weight formats (q4_1 is the shipped file; q4_0, q8_0, f16, f32 are written from it)")
    parser.add_argument("--linear", default="onednn", help="hf: onednn (as loaded), blas (F.linear), or onednn,blas (both in one run)")
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no file")
    args = parser.parse_args(argv)
    linears = args.linear.split(",")
    if not linears or not set(linears) <= {"onednn", "blas"}:
        parser.error(f"--linear: give onednn, blas or onednn,blas, got {args.linear!r}")
    backends = args.backend.split(",")
    if not set(backends) <= {"hf", "llama-cpp"}:
        parser.error(f"--backend: give hf, llama-cpp or hf,llama-cpp, got {args.backend!r}")
    dtypes = args.dtypes.split(",") if "hf" in backends else []
    for name in dtypes:
        if name not in ("float32", "bfloat16"):
            parser.error(f"--dtypes: unknown dtype {name!r}; use float32 and/or bfloat16")
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: give ROWSxTOKENS pairs such as 1x1,8x5, got {args.shapes!r}")
    if args.repeats < 1 or any(b < 1 or l < 1 or b + l > args.context + 1 for b, l in shapes):
        parser.error("--repeats must be >= 1 and every shape needs rows >= 1, tokens >= 1 and rows + tokens <= --context + 1")

    from smc_sd.backends.hf import HFLanguageModel

    models = {}
    for name in dtypes:
        for linear in linears:
            lm = HFLanguageModel.default(dtype=name)
            if linear == "blas":
                blas_linears(lm.model)
            models["hf" if linear == "onednn" else "hf-blas", name] = lm
    if "llama-cpp" in backends:
        models.update(llama_models(args.formats.split(","), max(b for b, _ in shapes)))
    prompt = context_tokens(next(iter(models.values())).tokenizer, args.context)
    steps, anchors = {}, []
    for name, lm in models.items():
        for rows, new in shapes:
            steps[name, rows, new] = forward_step(lm, prompt, rows, new)
        if name[0] == "llama-cpp":
            anchors.append(anchor_llama(lm.path, prompt, args.context))
            steps[("llama-cpp-python", name[1]), 1, 1] = anchor_step(anchors[-1], prompt)
    times = {key: [] for key in steps}
    with torch.inference_mode():
        for round_ in range(args.repeats + 1):
            for key, step in steps.items():
                ms = step()
                if round_:
                    times[key].append(ms)
    for llm in anchors:
        llm.close()
    rows = []
    for ((backend, name), b, l), samples in times.items():
        rows.append({"backend": backend, "dtype": name, "rows": b, "new_tokens": l, "shape": f"{b}x{l}",
                     "ms_median": statistics.median(samples), "ms_min": min(samples)})
    for row in rows:
        one = next((r for r in rows if (r["backend"], r["dtype"]) == (row["backend"], row["dtype"]) and r["shape"] == "1x1"), None)
        if one is not None:
            row["over_1x1"] = row["ms_median"] / one["ms_median"]
    data = {
        "benchmark": "forward_cost",
        "model": "SmolLM2-135M-Instruct (hf backend, paged KV, eager; llama-cpp: the shipped GGUF and copies)",
        "context": args.context,
        "repeats": args.repeats,
        "environment": environment(),
        "rows": rows,
    }
    if "llama-cpp" in backends:
        import llama_cpp

        data["build"] = {"llama_cpp_python": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode(), "threads": 1}
    if ("hf", "bfloat16") in models:
        data["lm_head"] = lm_head_rows(models["hf", "bfloat16"].model, args.repeats)
    emit("forward_cost", data, write=not args.no_write)
    return data


def llama_models(formats: list[str], rows: int) -> dict:
    """{("llama-cpp", format): LlamaCppLanguageModel} of the default model in each format, one
    thread, room for `rows` rows: the shipped file for q4_1, llama.cpp's cached copy otherwise."""
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel
    from smc_sd.backends.llama_formats import format_copy
    from smc_sd.models.smollm2 import gguf_path

    shipped = LlamaCppLanguageModel(gguf_path(), n_seq_max=rows, n_threads=1)
    models = {}
    for name in formats:
        if name == "q4_1":
            models["llama-cpp", name] = shipped
        else:
            models["llama-cpp", name] = LlamaCppLanguageModel(format_copy(shipped.path, name), tokenizer=shipped.tokenizer, n_seq_max=rows, n_threads=1)
    return models


def anchor_llama(path, prompt: list[int], context: int):
    """llama-cpp-python's `Llama` on GGUF `path` (its default context: no flash attention, one
    sequence; one thread) after decoding `prompt`."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=max(512, 2 * context), n_threads=1, n_threads_batch=1, n_gpu_layers=0, verbose=False)
    llm.eval(prompt)
    return llm


def anchor_step(llm, prompt: list[int]):
    """step() -> ms of llama-cpp-python's own decode of one token after `prompt` (`Llama.eval`,
    which first removes the cells past its token count, then decodes)."""

    def step() -> float:
        llm.n_tokens = len(prompt)
        return timed(lambda: llm.eval(prompt[:1]))

    return step


def lm_head_rows(model, repeats: int) -> list[dict]:
    """Median ms of each way to float32 logits from the bfloat16 head, at HEAD_ROWS rows."""
    out = []
    with torch.inference_mode():
        for rows in HEAD_ROWS:
            ways = head_steps(model, rows)
            samples = {way: [] for way in ways}
            for round_ in range(repeats + 1):
                for way, step in ways.items():
                    ms = timed(step)
                    if round_:
                        samples[way].append(ms)
            out += [{"rows": rows, "way": way, "ms_median": statistics.median(s)} for way, s in samples.items()]
    return out


if __name__ == "__main__":
    main()
