"""The serve extraction workload in one process: its requests submitted at once to one
`BatchEngine` on the hf backend, with no HTTP and no client threads.

`serve.py --workload extraction` races whole servers; this script times what the engine and the
backend do with the same 16 requests at concurrency 16, so a change to either is measured without
the noise of server start-up, sockets and a second process. The requests are the ones the server
builds from the same bodies (`smc_sd.serve`: the documents and schemas of `extraction.py`,
`response_format` json_schema, seed i for request i, T = 0.3, 256 tokens). Each request's prompt
is computed once before the timing (a one-token run of every request), so the timed runs find it
in the prefix cache, as a warm server does.

Per method and run: wall seconds, output tokens, tokens/s, target forwards and the seconds inside
the target model's forward (the rest is the engine's host work: masks, drafts, sampling). Runs
alternate between the methods (`--repeats` rounds), and the median run is reported beside every
run: on a shared 2-core machine single runs of the same work differ by 10-20%.

With `--compile-step` every method also runs on a second engine that compiles its step
(`BatchEngine(compile_step=True)`, `smc_sd.engine.kernels`), rows labelled "METHOD compiled",
in the same rounds; its graphs compile in its first timed run of each method, so read the
median of three rounds or more.

To compare two trees, run this script from one with `PYTHONPATH=<other tree>` in between runs
(same machine, alternating); the script uses the serve API only (`Server.requests`).

Torch runs one thread. Prints JSON; writes results/engine_extraction.json.

Usage: python benchmarks/engine_extraction.py [--methods "ar,mask-at-verify free,smc-sd free"]
       [--requests 16] [--max-tokens 256] [--repeats 2] [--dtype float32] [--compile-step] [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from _common import emit, environment, progress
from serve import EXTRACTION_METHODS, extraction_asks

#: the extraction methods of serve.py, as request body fields by label
METHODS = dict(EXTRACTION_METHODS)


class ForwardClock:
    """Counts the target model's forwards and the seconds spent inside them."""

    def __init__(self, model: torch.nn.Module):
        self.seconds, self.calls = 0.0, 0
        inner = model.forward

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        model.forward = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def build_requests(server, parse, fields: dict, args) -> list:
    """The engine requests the server makes of the workload's bodies with `fields`."""
    requests = []
    for i, ask in enumerate(extraction_asks(args.requests)):
        body = {"model": server.model.name, "messages": ask.messages, "max_tokens": args.max_tokens,
                "temperature": args.temperature, "seed": i, **fields, **ask.body()}
        requests += server.requests(parse(body, "chat", server.model))
    return requests


def run_all(engine, requests: list) -> list:
    """Submit every request, step the engine until all are done; their results."""
    handles = [engine.submit(request) for request in requests]
    while engine.step():
        pass
    return [handle.result() for handle in handles]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=2, help="rounds; each round runs every method once")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile-step", action="store_true", help="also run every method on an engine that compiles its step")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/engine_extraction.json")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if args.requests < 1 or args.repeats < 1 or args.max_tokens < 1:
        parser.error("--requests, --repeats and --max-tokens must be >= 1")
    torch.set_num_threads(1)

    from smc_sd.cli import build_parser
    from smc_sd.engine.batch import BatchEngine
    from smc_sd.loading import load_models
    from smc_sd.serve.app import Server
    from smc_sd.serve.parsing import parse

    target, _ = load_models(build_parser().parse_args(["serve", "--dtype", args.dtype]))
    engines = {"": BatchEngine(target, [], max_running=args.requests)}
    if args.compile_step:
        engines[" compiled"] = BatchEngine(target, [], max_running=args.requests, compile_step=True)
    server = Server(engines[""], target, {}, "smc-sd", default_draft="free")
    clock = ForwardClock(target.model)
    requests = {method: build_requests(server, parse, METHODS[method], args) for method in methods}
    # every prompt into each engine's prefix cache: one token of each request
    first = requests[methods[0]]
    for engine in engines.values():
        run_all(engine, [dataclasses.replace(r, schedule=dataclasses.replace(r.schedule, max_tokens=1)) for r in first])

    runs = {method + label: [] for method in methods for label in engines}
    for round_ in range(args.repeats):
        for method, (label, engine) in ((m, e) for m in methods for e in engines.items()):
            clock.reset()
            start = time.perf_counter()
            results = run_all(engine, requests[method])
            seconds = time.perf_counter() - start
            tokens = sum(len(result.tokens) for result in results)
            runs[method + label].append({"seconds": round(seconds, 3), "output_tokens": tokens, "tokens_per_second": round(tokens / seconds, 2),
                                 "target_forwards": clock.calls, "forward_seconds": round(clock.seconds, 3)})
            progress(f"round {round_ + 1} {method}{label}: {seconds:.2f} s, {tokens} tokens")
    rows = {}
    for method, done in runs.items():
        median = statistics.median(run["seconds"] for run in done)
        rows[method] = {"median_seconds": round(median, 3), "median_tokens_per_second": round(statistics.median(r["tokens_per_second"] for r in done), 2),
                        "same_tokens_every_run": len({r["output_tokens"] for r in done}) == 1, "runs": done}
    emit("engine_extraction", {"environment": environment(),
                               "settings": {"requests": args.requests, "max_tokens": args.max_tokens, "temperature": args.temperature,
                                            "repeats": args.repeats, "dtype": args.dtype, "backend": "hf", "compile_step": args.compile_step},
                               "methods": rows}, write=not args.no_write)


if __name__ == "__main__":
    main()
