"""`smc-sd generate PROMPT ...`: run a decoding program on the default model or local ones.

Without --json the text streams to stdout as it becomes final (for SMC-SD: the prefix every
particle shares, which no later resampling can change) and a progress line with tokens/s goes to
stderr. With --json stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import sys
import time

from smc_sd.program import Schedule
from smc_sd.programs import MODULES, get


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smc-sd", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="sample a completion of one prompt")
    g.add_argument("prompt", help="an instruction (wrapped in the chat template unless --raw)")
    g.add_argument("--method", choices=sorted(MODULES), default="smc-sd")
    g.add_argument("--particles", type=int, default=None, help="N (default: the method's own, 4 for smc-sd)")
    g.add_argument("--draft-len", type=int, default=4, help="K, draft tokens per particle per cycle")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0, help="target temperature T")
    g.add_argument("--draft-temperature", type=float, default=1.0, help="draft temperature T_d")
    g.add_argument("--alpha", type=float, default=1.0, help="power: sample p_T(x)^alpha")
    g.add_argument("--ess-threshold", type=float, default=0.5, help="resample when ESS < tau N")
    g.add_argument("--resampling", default="systematic", help="systematic, multinomial, stratified or residual")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--target", default=None, help="local transformers model directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default=None, help="local model directory sharing the target's tokenizer, a draft saved by smc_sd.models.distill, 'self' (the default model without decoder layer 5, the default) or 'distilled' (the shipped distilled draft, --backend hf only)")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="transformers (hf) or a vLLM engine per model")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs each model is split over")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm: fraction of GPU memory per engine")
    g.add_argument("--dtype", default="float32", help="vllm: weights dtype (float32, bfloat16, float16, auto)")
    g.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    g.add_argument("--grammar", default=None, metavar="FILE.lark", help="constrain the output to this Lark grammar")
    g.add_argument("--json-schema", default=None, metavar="FILE.json", help="constrain the output to JSON valid under this schema")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return parser


DISTILLED_ON_VLLM = "smc-sd: a distilled restricted-vocabulary draft runs on --backend hf only"


def load_models(args):
    """The target and (for methods that draft) the draft, as HFLanguageModels (or vLLM engines)."""
    check_draft_choice(args)
    if args.backend == "vllm":
        return load_vllm_models(args)
    from smc_sd.backends.hf import HFLanguageModel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.target is None:
        target = HFLanguageModel.default(args.device)
    else:
        target = HFLanguageModel.from_pretrained(args.target, device=args.device)
    if args.method == "ar":
        return target, None
    if args.draft is None and args.target is not None:
        raise SystemExit(f"smc-sd: --method {args.method} with --target needs a --draft model directory")
    return target, HFLanguageModel.named_draft(args.draft, args.target, args.device)


def check_draft_choice(args) -> None:
    """Refuse, before loading anything, `--draft self|distilled` (drafts of the default model) with
    another `--target`, and the restricted-vocabulary distilled draft on vLLM."""
    if args.draft in ("self", "distilled") and args.target is not None:
        raise SystemExit(f"smc-sd: --draft {args.draft} is a draft of the default model; "
                         "with --target give a --draft model directory")
    if args.draft == "distilled" and args.backend == "vllm":
        raise SystemExit(DISTILLED_ON_VLLM)


def load_vllm_models(args):
    """The target and draft as VLLMLanguageModels, one engine each, with the CLI's engine options.

    The default draft is the default model without decoder layer 5 (`--draft self`, as on hf;
    vLLM cannot serve the package's distilled restricted-vocabulary draft).
    """
    from smc_sd.backends.vllm import VLLMLanguageModel, VLLMOptions
    from smc_sd.models.draft import is_draft_dir

    options = VLLMOptions(
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        # a GPU sizes its KV cache from the memory fraction; the CPU default keeps 1 GiB
        kv_cache_bytes=None if args.device.startswith("cuda") else VLLMOptions.kv_cache_bytes,
        block_size=None if args.device.startswith("cuda") else VLLMOptions.block_size,
    )
    target = VLLMLanguageModel(args.target, options) if args.target else VLLMLanguageModel.default(options)
    if args.method == "ar":
        return target, None
    if args.draft is not None and is_draft_dir(args.draft):
        raise SystemExit(DISTILLED_ON_VLLM)
    if args.draft is not None and args.draft != "self":
        return target, VLLMLanguageModel(args.draft, options)
    if args.target is None:
        return target, VLLMLanguageModel.self_draft(options)
    raise SystemExit(f"smc-sd: --method {args.method} with --target needs a --draft model directory")


def program_options(module, args) -> dict:
    """The CLI options the program's builder accepts."""
    options = {
        "temperature": args.temperature,
        "draft_temperature": args.draft_temperature,
        "alpha": args.alpha,
        "draft_len": args.draft_len,
    }
    accepted = inspect.signature(module.program).parameters
    if args.alpha != 1.0 and "alpha" not in accepted:
        raise SystemExit(f"smc-sd: --method {args.method} samples p_T (alpha = 1); use --method smc-sd for --alpha")
    constraints = constraint_potentials(args)
    if constraints:
        if "constraints" not in accepted:
            raise SystemExit(f"smc-sd: --method {args.method} takes no constraints; use smc-sd or mask-at-verify")
        options["constraints"] = constraints
    return {name: value for name, value in options.items() if name in accepted}


def constraint_potentials(args) -> tuple:
    """The genlm-control potentials of --regex, --grammar and --json-schema (empty without them)."""
    if args.regex is None and args.grammar is None and args.json_schema is None:
        return ()
    from smc_sd.programs.constrained import potentials

    grammar = pathlib.Path(args.grammar).read_text() if args.grammar else None
    schema = json.loads(pathlib.Path(args.json_schema).read_text()) if args.json_schema else None
    return potentials(regex=args.regex, grammar=grammar, json_schema=schema)


class TextStream:
    """Prints, once per cycle, the text that has become final, and a progress line to stderr."""

    def __init__(self, decode, eos: int, started: float, particles: int):
        self.decode, self.eos, self.started, self.particles = decode, eos, started, particles
        self.printed = ""
        self.tokens = 0

    def __call__(self, stats, rows: list[list[int]]) -> None:
        shared = common_prefix(rows)
        if self.eos in shared:
            shared = shared[: shared.index(self.eos)]
        self.show(self.decode(shared))
        self.tokens += stats.tokens
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        ess = f", ESS {stats.ess:.1f}/{self.particles}" if self.particles > 1 else ""
        print(f"\r[{self.tokens} tokens, {rate:.1f} tok/s{ess}]", end="", file=sys.stderr, flush=True)

    def show(self, text: str) -> None:
        # a trailing U+FFFD is an incomplete multi-byte character: wait for the rest
        text = text.rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text


def common_prefix(rows: list[list[int]]) -> list[int]:
    """The longest token prefix every row shares."""
    first = rows[0]
    length = len(first)
    for row in rows[1:]:
        length = min(length, len(row))
        length = next((i for i in range(length) if row[i] != first[i]), length)
    return first[:length]


def generate(args) -> int:
    from smc_sd.backends.hf import chat_prompt

    if not args.prompt.strip():
        raise ValueError("the prompt is empty; give some text")
    module = get(args.method)
    started = time.perf_counter()
    target, draft = load_models(args)
    load_seconds = time.perf_counter() - started
    builder_args = (target,) if draft is None else (target, draft)
    program = module.program(*builder_args, **program_options(module, args))
    if args.raw:
        prompt = target.tokenizer.encode(args.prompt, add_special_tokens=False)
    else:
        prompt = chat_prompt(target.tokenizer, args.prompt)
    particles = args.particles if args.particles is not None else module.DEFAULT_PARTICLES
    schedule = Schedule(particles, args.ess_threshold, args.resampling, args.max_new_tokens)
    stream = None if args.json else TextStream(target.decode, target.vocabulary.eos_token_id, time.perf_counter(), particles)
    result = program.run(prompt, schedule, seed=args.seed, on_cycle=stream)
    if args.json:
        summary = result.to_json()
        summary.update(
            draft_len=program.proposal.draft_len if program.proposal is not None else 0,
            prompt_tokens=len(prompt),
            load_seconds=load_seconds,
            seed=args.seed,
            temperature=args.temperature,
            alpha=args.alpha,
        )
        print(json.dumps(summary))
    else:
        stream.show(result.text)
        print()
        print(
            f"\r[{len(result.tokens)} tokens in {result.seconds:.2f} s, {result.tokens_per_second:.2f} tok/s, "
            f"{result.target_passes} target passes, {result.resamples} resamples, log Z {result.log_ml:.3f}]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return generate(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"smc-sd: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
