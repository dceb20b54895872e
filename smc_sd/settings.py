"""A request's decoding settings, judged without a model: the checks the command line and the
server share.

`check_program` turns one request's settings (the CLI's flags, or a server request's body fields)
into the program module, its builder's options and the schedule, refusing every bad value with a
one-line ValueError that names the setting as the caller spells it (`flag` for the CLI). The
model choices, devices and constraints of the command line are checked here too, before any
model loads.
"""

from __future__ import annotations

import inspect
import json
import pathlib

import torch

from smc_sd.backends.precision import DTYPES as HF_DTYPES
from smc_sd.compiler.plan import check_settings
from smc_sd.constraints.json_depth import JSONTooDeepError, load_json
from smc_sd.program import Schedule
from smc_sd.drafts import model_count
from smc_sd.programs import get


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
    from smc_sd.llama_models import check_llama_choice, check_threads

    check_threads(args)
    if model_count(args) == 1 and args.draft is not None:
        raise ValueError(f"--method {args.method} drafts nothing; drop --draft or use sd or smc-sd")
    if args.backend == "llama-cpp":
        return check_llama_choice(args)
    from smc_sd.drafts import PACKAGE_DRAFTS, needs_hf_backend, parse_draft

    if args.target is not None:
        check_model_dir("--target", args.target)
    if model_count(args) == 1:
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

    With "free" alone --draft-len fixes the free draft's block length (every token found, up
    to K: for experiments; without it the block length is chosen by the pass's cost); with
    "free+NAME" it stays the draft LM's K.

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
    if not parse_draft(draft).has_lm and settings.draft_len is not None:
        return {"free_draft": FreeDraft(max_len=settings.draft_len, cost_aware=False)}
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
    except JSONTooDeepError as error:
        raise ValueError(f"--json-schema: {error}") from error
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
        schema = load_json(args.json_schema if inline else pathlib.Path(args.json_schema).read_text(), "the JSON schema")
    return potentials(regex=args.regex, grammar=grammar, json_schema=schema, json_layout=getattr(args, "json_layout", "compact"))


def one_line(error: BaseException) -> str:
    """The error's message on one line (its lines joined by spaces)."""
    return " ".join(str(error).split()) or type(error).__name__
