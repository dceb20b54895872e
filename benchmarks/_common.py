"""Helpers every benchmark shares: model loading, program building, statistics and output.

Each benchmark prints one JSON object to stdout, writes the same object to
`benchmarks/results/<name>.json` and its plots to `benchmarks/results/<name>*.png`.
"""

from __future__ import annotations

import datetime
import inspect
import json
import math
import os
import pathlib
import platform
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


# the help of every benchmark's --draft option (the names `load_default_models` takes)
DRAFT_HELP = "'self' (the target without decoder layer 5, the default), 'distilled' (the shipped distilled draft), 'feature' (the shipped feature-reading draft) or a local draft model directory"


# the help of every benchmark's --dtype option
DTYPE_HELP = (
    "dtype of the target and draft (logits stay float32): float32 (the default, comparable with earlier results), "
    "bfloat16, or auto (bfloat16 where the CPU has amx_bf16 or avx512_bf16, else float32)"
)


def add_dtype_argument(parser) -> None:
    """--dtype {auto,float32,bfloat16}, default float32; `choose_precision(args.dtype)` resolves it."""
    from smc_sd.backends.precision import DTYPES

    parser.add_argument("--dtype", choices=DTYPES, default="float32", help=DTYPE_HELP)


def load_default_models(draft_dir: str | None = None, dtype=torch.float32):
    """(target, draft) in `dtype` (a torch dtype or a `precision.DTYPES` name): the embedded
    default model and the default draft, the self-speculative draft ("self": the target without
    decoder layer 5), the shipped distilled draft ("distilled"), the shipped feature-reading draft
    ("feature", paired with this target, in its dtype) or a local draft directory."""
    from smc_sd.backends.hf import HFLanguageModel
    from smc_sd.drafts import named_draft

    target = HFLanguageModel.default(dtype=dtype)
    return target, named_draft(draft_dir, target=target, dtype=dtype)


def describe_draft(draft: str | None) -> str:
    """The draft named as `load_default_models` takes it (or "free", "free+NAME"), in words for a results file."""
    from smc_sd.drafts import FREE

    if draft == FREE:
        return "the free draft alone (smc_sd.program.FreeDraft: continuations found in the prompt and the text so far, no model)"
    if draft is not None and draft.startswith(FREE + "+"):
        return "the free draft where it proposes, elsewhere " + describe_draft(draft[len(FREE) + 1 :])
    if draft in (None, "self"):
        return "the default draft (the target without decoder layer 5)"
    if draft == "distilled":
        return "the shipped distilled draft (--draft distilled: 6 layers over the target's embedding, 16384-token head)"
    if draft == "feature":
        return "the shipped feature-reading draft (--draft feature: one layer over the target's features, the target's tied head)"
    return f"the draft in {draft}"


def build_program(method: str, target, draft, **options):
    """The shipped program `method` ("ar", "sd", "smc-sd", ...) with the options it accepts.

    Options the program's builder does not take (e.g. draft_len for "ar") are dropped; an alpha
    other than 1 for a program without one is an error, since it would silently change the target.
    """
    from smc_sd.programs import get

    module = get(method)
    accepted = inspect.signature(module.program).parameters
    if options.get("alpha", 1.0) != 1.0 and "alpha" not in accepted:
        raise ValueError(f"method {method!r} samples p_T; alpha={options['alpha']} needs smc-sd")
    kept = {k: v for k, v in options.items() if k in accepted}
    return module.program(target, **kept) if method == "ar" else module.program(target, draft, **kept)


def drop_prefix_caches(program) -> None:
    """Empty the prefix caches of a program's models (`LanguageModel.drop_prefix_cache`): a timed
    run then computes its prompt, as the first method run on that prompt does, and methods run
    one after another on the same prompts compare like for like."""
    for lm in (program.target.lm, getattr(program.proposal, "lm", None)):
        if lm is not None:
            lm.drop_prefix_cache()


def setting_label(setting: dict) -> str:
    """A short name for a measured setting: the method, then K, N and alpha where they apply."""
    parts = [setting["method"]]
    if "draft_len" in setting:
        parts.append(f"K={setting['draft_len']}")
    if setting["method"] == "smc-sd":
        parts.append(f"N={setting['particles']}")
    if setting.get("alpha", 1.0) != 1.0:
        parts.append(f"alpha={setting['alpha']:g}")
    return " ".join(parts)


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """Sample mean and its standard error s / sqrt(n) (nan for n < 2)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% for z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def environment() -> dict:
    """Where and when the numbers were measured; `processor` is the CPU's model name and whether
    it has native bf16 matrix instructions (which decide what bfloat16 costs)."""
    from smc_sd.backends.precision import read_processor
    from smc_sd.host_memory import TORCH_THP_VARIABLE, kernel_thp_mode

    processor = read_processor()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.processor() or platform.machine(),
        "processor": None if processor is None else processor.to_json(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # huge pages under torch's large CPU blocks (smc_sd.host_memory), and whether the kernel grants them
        "torch_huge_pages": os.environ.get(TORCH_THP_VARIABLE),
        "kernel_huge_pages": kernel_thp_mode(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # other jobs on a shared machine slow every timing; the 1-minute load average records it
        "load_average": os.getloadavg()[0],
        "command": " ".join([pathlib.Path(sys.argv[0]).name] + sys.argv[1:]),
    }


def progress(text: str) -> None:
    """One line of progress on stderr: stdout carries the JSON alone (`emit`), so `> out.json`
    keeps a file json.load reads."""
    print(text, file=sys.stderr, flush=True)


def emit(name: str, data: dict, write: bool = True) -> None:
    """Print `data` as JSON to stdout and (with write) save it as results/<name>.json."""
    text = json.dumps(data, indent=1)
    print(text, flush=True)
    if write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(text + "\n")


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str) -> str:
    """Save a figure as results/<name>.png and close it; return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    return str(path.relative_to(RESULTS.parent.parent))
