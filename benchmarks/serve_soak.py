"""Memory under a long run of constrained requests: `smc-sd serve`'s resident memory while the
`openai` client sends JSON-schema requests, first each with its own schema, then one schema
repeated.

Two phases of R requests each (default R = 1,000), sent through C client threads (default 8):
- distinct: request i asks for a schema no other request uses (an object with a property named
  after i, beside a string and an enum), so every request compiles a new constraint;
- repeated: every request asks for one schema (the same JSON text), so after its first request
  the compiled constraint is reused.
Every request is a chat completion with `response_format` json_schema, method ar, max_tokens 3
(the constraint is compiled and its masks computed; the answer is cut short), seed i, T = 1.

Resident memory is VmRSS of the server's process (/proc/<pid>/status), read before the first
request, after the first request and the first W requests of each phase (default W = 100:
first-use costs such as the constraint tokenizer, the KV pool and the allocator's warm-up stay
out of the growth), and at the end of each phase. Reported growth, in MB (10^6 bytes):
- distinct_growth_mb = RSS after the distinct phase - RSS after its first W requests
  (goal: at most 50 MB for R = 1,000);
- repeated_growth_mb = RSS after the repeated phase - RSS after its first W requests
  (goal: at most 5 MB for R = 1,000).
A request that fails or is refused counts in `failed` (its first error is kept); the run stops
at --max-seconds and says so (`complete`: false).

The server runs with --threads torch/OpenMP threads (default 1: the machine is shared) and
--dtype (default float32). The server is started as a subprocess on 127.0.0.1 (`--port 0`,
the port it prints) and stopped by its own process handle.

Usage: python benchmarks/serve_soak.py [--requests 1000] [--warmup 100] [--concurrency 8]
       [--max-tokens 3] [--method ar] [--threads 1] [--dtype float32] [--max-seconds 7200]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

from _common import emit, environment, progress
from serve import MODEL, start_smc_sd

#: seconds one request may take before it counts as failed
REQUEST_SECONDS = 300
PROMPT = "Describe a person as a JSON object."


def distinct_schema(i: int) -> dict:
    """A schema only request i uses: its own property name and enum value."""
    return {"type": "object",
            "properties": {f"field_{i}": {"type": "integer"}, "name": {"type": "string"},
                           "kind": {"enum": [f"kind_{i}", "other"]}},
            "required": [f"field_{i}", "name", "kind"]}


#: the schema of every request of the repeated phase
REPEATED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                   "required": ["name", "age"]}


def resident_mb(pid: int) -> float:
    """VmRSS of a process, in MB (10^6 bytes)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024 / 1e6


def send(client, i: int, schema: dict, args) -> str | None:
    """One constrained chat request; None when answered, else the error in one line."""
    try:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=args.max_tokens,
            temperature=1.0, seed=i, timeout=REQUEST_SECONDS,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            extra_body={"method": args.method})
    except Exception as error:  # every failure is counted and shown, none stops the soak
        return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    return None


def phase(client, pid: int, schemas, args, deadline: float) -> dict:
    """Send every schema's request through C threads; RSS after the first W and at the end."""
    done, failed, errors, marks = 0, 0, [], {}
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        pending = set()
        queue = iter(enumerate(schemas))
        while True:
            while len(pending) < args.concurrency and time.monotonic() < deadline:
                item = next(queue, None)
                if item is None:
                    break
                pending.add(pool.submit(send, client, item[0], item[1], args))
            if not pending:
                break
            finished, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                done += 1
                error = future.result()
                if error is not None:
                    failed += 1
                    errors.append(error)
                if done in (1, args.warmup):
                    marks["rss_after_first_mb" if done == 1 else "rss_after_warmup_mb"] = resident_mb(pid)
    return {"requests": done, "failed": failed, "first_error": errors[0] if errors else None,
            "seconds": time.perf_counter() - started, **marks, "rss_end_mb": resident_mb(pid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per phase")
    parser.add_argument("--warmup", type=int, default=100, help="requests of each phase before its growth is counted")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--method", default="ar")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of the server")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-seconds", type=float, default=7200, help="the whole soak stops here")
    args = parser.parse_args()
    if not 0 < args.warmup < args.requests:
        parser.error(f"--warmup must lie in 1 .. --requests - 1, got {args.warmup}")
    import openai

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    server, url = start_smc_sd(sys.executable, ["--dtype", args.dtype], env)
    pid = server.process.pid
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=REQUEST_SECONDS)
        deadline = time.monotonic() + args.max_seconds
        before = resident_mb(pid)
        distinct = phase(client, pid, [distinct_schema(i) for i in range(args.requests)], args, deadline)
        repeated = phase(client, pid, [REPEATED_SCHEMA] * args.requests, args, deadline)
    finally:
        server.stop()
    complete = distinct["requests"] == repeated["requests"] == args.requests

    def growth(row: dict) -> float | None:
        return row["rss_end_mb"] - row["rss_after_warmup_mb"] if "rss_after_warmup_mb" in row else None

    data = {
        "environment": environment() | {"server_threads": args.threads, "dtype": args.dtype},
        "settings": {"requests_per_phase": args.requests, "warmup": args.warmup, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "method": args.method, "prompt": PROMPT,
                     "repeated_schema": REPEATED_SCHEMA, "distinct_schema_0": distinct_schema(0)},
        "complete": complete,
        "rss_before_mb": before,
        "distinct": distinct,
        "repeated": repeated,
        "distinct_growth_mb": growth(distinct),
        "repeated_growth_mb": growth(repeated),
        "goals": {"distinct_growth_mb_at_most": 50, "repeated_growth_mb_at_most": 5},
    }
    emit("serve_soak", data, write=complete and args.requests == 1000)
    progress(json.dumps({"distinct_growth_mb": data["distinct_growth_mb"], "repeated_growth_mb": data["repeated_growth_mb"]}))


if __name__ == "__main__":
    main()
