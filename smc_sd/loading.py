"""The models a command line (or a server's flags) names, loaded: target and draft on hf or vLLM,
in the dtype `--dtype` means, each load failure one line naming its flag."""

from __future__ import annotations

import contextlib
import os

import torch

from smc_sd.backends.precision import Precision, choose_precision
from smc_sd.drafts import model_count
from smc_sd.settings import one_line


def model_precision(args) -> Precision:
    """The dtype --dtype means for both models on --device (`smc_sd.backends.precision`)."""
    if args.dtype == "float16":
        return Precision(torch.float16, "asked for")
    if getattr(args, "backend", "hf") == "llama-cpp":
        return Precision(torch.float32, "llama.cpp: float32 activations and logits, the GGUF's own weight format, float16 KV")
    return choose_precision(args.dtype, args.device)


def load_models(args):
    """The target and (for methods that draft) the draft, as HFLanguageModels (or vLLM engines),
    in the dtype of `model_precision`.

    Raises:
        ValueError: when a model directory does not load, naming it (one line).
    """
    if args.backend == "vllm":
        return load_vllm_models(args)
    if args.backend == "llama-cpp":
        return load_llama_models(args)
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


def load_llama_models(args):
    """The target and (where the method and flags name one) the draft, as LlamaCppLanguageModels.

    Raises:
        ValueError: one line naming the flag whose model does not load.
    """
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel
    from smc_sd.drafts import parse_draft
    from smc_sd.llama_models import sequences_needed

    sequences = sequences_needed(args)
    with loading("--target", args.target):
        target = LlamaCppLanguageModel.default(n_seq_max=sequences, n_threads=args.threads) if args.target is None else LlamaCppLanguageModel(args.target, n_seq_max=sequences, n_threads=args.threads)
    choice = parse_draft(args.draft)
    if model_count(args) == 1 or choice.lm is None:
        return target, None
    with loading("--draft", choice.lm):
        return target, LlamaCppLanguageModel(choice.lm, tokenizer=target.tokenizer, n_seq_max=sequences, n_threads=args.threads)


def target_description(args, target) -> dict:
    """What ran as the target, for `generate --json`: `target_file` (the GGUF file on llama.cpp,
    the model directory on hf and vLLM; the default model's is the float32 conversion in smc-sd's
    cache), `weight_format` (llama.cpp: the file's format, e.g. q4_1; hf and vLLM: the dtype the
    weights run in) and on llama.cpp `threads` (as llama.cpp reports them)."""
    if args.backend == "llama-cpp":
        return {"target_file": str(target.path), "weight_format": target.weight_format, "threads": target.n_threads}
    if args.backend == "vllm":
        return {"target_file": str(target.path), "weight_format": model_precision(args).name}
    return {"target_file": str(target.model.config._name_or_path), "weight_format": str(target.model.dtype).removeprefix("torch.")}
