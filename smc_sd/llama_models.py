"""The models `--backend llama-cpp` names, judged before anything loads (`smc_sd.loading` loads them).

The target is the default model's shipped GGUF as it ships (SmolLM2-135M-Instruct, Q4_1
weights; `llama_formats.DEFAULT_FORMAT`) or `--target FILE.gguf`; a draft LM is `--draft FILE.gguf` (or `free+FILE.gguf`), which
must share the target's token ids. There is no packaged draft on this backend (the hf backend's
self, distilled and feature drafts are transformers models): sd and smc-sd take `--draft free` or
a GGUF file; `serve` without `--draft` serves ar and the free drafts.

The context holds as many sequences as the schedule has rows: the particles of one request for
`generate`, max_running x SLOTS_PER_REQUEST for `serve`, at most 255 (llama.cpp's 256 less the
backend's parking sequence): the server's default 16 x 16 slots get 255, and a 256th row at once
would be a one-line error.
"""

from __future__ import annotations

import importlib.util
import pathlib

from smc_sd.drafts import PACKAGE_DRAFTS, model_count, parse_draft

#: rows one llama.cpp context holds: llama.cpp's 256 sequences less the parking one
MAX_ROWS = 255


def check_gguf_file(flag: str, path: str) -> None:
    """Refuse a --target/--draft that is not a local GGUF file."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"{flag} {path}: no such file (--backend llama-cpp takes a local GGUF file)")
    with open(file, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{flag} {path}: not a GGUF file (--backend llama-cpp takes a local GGUF file)")


def check_threads(args) -> None:
    """Refuse a --threads below 1, and one given to a backend that would ignore it."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if args.backend != "llama-cpp":
        raise ValueError(f"--threads is an option of --backend llama-cpp; --backend {args.backend} would ignore it (set OMP_NUM_THREADS)")
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")


def check_llama_choice(args) -> None:
    """Refuse, before loading, llama-cpp model choices that cannot work: a missing
    llama-cpp-python, paths that are not GGUF files, a packaged draft, an LM method without a
    draft, and a --dtype (the GGUF's own weight format runs). Called by
    `smc_sd.settings.check_model_choice`, which has judged what every backend shares."""
    from smc_sd.backends.llama_library import INSTALL

    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError(f"--backend llama-cpp needs llama-cpp-python, which is not installed; install the extra (it builds llama.cpp, 10-16 min on 2 cores): {INSTALL}")
    if args.dtype != "auto":
        raise ValueError(f"--dtype {args.dtype}: --backend llama-cpp runs the GGUF's own weight format; give a GGUF file in the format wanted")
    if args.target is not None:
        check_gguf_file("--target", args.target)
    # settings.check_model_choice has refused a --draft for ar
    if model_count(args) == 1:
        return
    choice = parse_draft(args.draft)
    if choice.lm in PACKAGE_DRAFTS:
        raise ValueError(f"--draft {choice.lm} runs on --backend hf only; with --backend llama-cpp give --draft free or a GGUF file")
    if choice.has_lm and choice.lm is None and getattr(args, "command", "generate") != "serve":
        raise ValueError(f"--method {args.method} on --backend llama-cpp needs --draft free or --draft FILE.gguf (no draft model ships for it)")
    if choice.lm is not None:
        check_gguf_file("--draft", choice.lm)


def sequences_needed(args) -> int:
    """Rows the schedule may hold at once: max_running x SLOTS_PER_REQUEST (at most MAX_ROWS) for
    serve, the request's particles for generate (past MAX_ROWS the model's load refuses them)."""
    from smc_sd.engine.batch import SLOTS_PER_REQUEST
    from smc_sd.programs import get

    if getattr(args, "max_running", None) is not None:
        return min(args.max_running * SLOTS_PER_REQUEST, MAX_ROWS)
    return args.particles if args.particles is not None else get(args.method).DEFAULT_PARTICLES
