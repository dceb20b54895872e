"""The drafts a `--draft` value names, resolved to a `LanguageModel` of the hf backend.

A draft is named by one of PACKAGE_DRAFTS (drafts of the default model shipped with the package)
or by a local directory:
- None or "self": the default model without decoder layer(s) SELF_DRAFT_DROPPED_LAYERS
  (`HFLanguageModel.self_draft`, the default draft);
- "distilled": the shipped distilled draft (`smc_sd.models.draft`) over the default model's
  embedding, run as a `RestrictedVocabLM` (q = 0 off its vocabulary);
- "feature": the shipped feature-reading draft (`smc_sd.models.feature_draft`) of a loaded
  target, run as a `FeatureDraftLM`;
- a directory saved by `smc_sd.models.distill` or `smc_sd.models.feature_distill`: that draft,
  run as above; any other directory: a transformers model.

Model families (`smc_sd.models`) describe weights and recipes and backends run them; this module
is the one place that knows which model a name means and which backend class runs it.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from smc_sd.backends.base import LanguageModel
from smc_sd.backends.feature_draft import FeatureDraftLM
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.backends.precision import as_dtype
from smc_sd.backends.restricted_vocab import RestrictedVocabLM
from smc_sd.models.draft import DRAFT_DIR, is_draft_dir, load_draft_model
from smc_sd.models.feature_draft import FEATURE_DRAFT_DIR, is_feature_draft_dir, load_feature_draft
from smc_sd.models.smollm2 import default_model_dir

#: the --draft names of drafts of the default model shipped with the package
PACKAGE_DRAFTS = ("self", "distilled", "feature")


def model_count(args) -> int:
    """How many models the method's program takes: 1 (the target) for ar, else 2 (target, draft)."""
    return 1 if args.method == "ar" else 2


#: the --draft name of the model-free draft (`smc_sd.program.FreeDraft`); "free+NAME" adds a draft LM
FREE = "free"


@dataclass(frozen=True)
class DraftChoice:
    """What a --draft value asks for.

    Attributes:
        free: whether the model-free sources propose first.
        lm: the draft LM's name or directory (None: the default draft), when `has_lm`.
        has_lm: whether a draft LM runs at all ("free" alone runs none).
    """

    free: bool
    lm: str | None
    has_lm: bool


def parse_draft(value: str | None) -> DraftChoice:
    """Read a --draft value: None, NAME|DIR, "free", or "free+NAME|DIR".

    Raises:
        ValueError: for "free+" with nothing after it.
    """
    if value == FREE:
        return DraftChoice(free=True, lm=None, has_lm=False)
    if value is not None and value.startswith(FREE + "+"):
        name = value[len(FREE) + 1 :]
        if not name:
            raise ValueError("--draft free+NAME needs a draft after the '+' (self, distilled, feature or a directory)")
        return DraftChoice(free=True, lm=name, has_lm=True)
    return DraftChoice(free=False, lm=value, has_lm=True)


def named_draft(
    name: str | None, target_dir=None, device: str | torch.device = "cpu", target=None, dtype: torch.dtype | str = torch.float32
) -> LanguageModel:
    """The draft a `--draft` value names (module docstring).

    Args:
        name: None, one of PACKAGE_DRAFTS, or a local model directory.
        target_dir: the target's directory, whose embedding a distilled draft directory reads
            (default: the default model).
        device: where the draft runs (a feature draft runs where its target does).
        target: the loaded target; needed by a feature draft, which reads its hidden states.
        dtype: the draft's weights, activations and KV (a torch dtype or a name of
            `precision.DTYPES`); a feature draft takes its target's dtype, whose modules it shares.

    Raises:
        ValueError: for a feature draft without `target`.
    """
    dtype = as_dtype(dtype, device)
    if name is None:
        return HFLanguageModel.default_draft(device, dtype=dtype)
    if name == "self":
        return HFLanguageModel.self_draft(device, dtype=dtype)
    if name == "distilled":
        return distilled_draft(device, dtype=dtype)
    if name == "feature" or is_feature_draft_dir(name):
        if target is None:
            raise ValueError("a feature draft reads its target's hidden states: load the target first and pass it")
        return FeatureDraftLM(target, load_feature_draft(target.model, FEATURE_DRAFT_DIR if name == "feature" else name))
    if is_draft_dir(name):
        return load_distilled_draft(target_dir or default_model_dir(), name, device=device, dtype=dtype)
    return HFLanguageModel.from_pretrained(name, device=device, dtype=dtype)


def distilled_draft(device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32, **options) -> RestrictedVocabLM:
    """The draft distilled from the default model and shipped with the package, in `dtype`.

    Six decoder layers over the target's own embedding, scoring a restricted vocabulary
    (q = 0 elsewhere); see `smc_sd.models.draft` and the recipe `smc_sd.models.distill`.
    `options` go to `RestrictedVocabLM` (`kv_cache`, `block_size`).
    """
    return load_distilled_draft(default_model_dir(), device=device, dtype=dtype, **options)


def load_distilled_draft(
    target_dir: pathlib.Path,
    draft_dir: pathlib.Path = DRAFT_DIR,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    **options,
) -> RestrictedVocabLM:
    """The draft saved by the distillation recipe in draft_dir, dequantised into `dtype` (a torch
    dtype or a name of `precision.DTYPES`), with the embedding and tokenizer of the target in
    target_dir; `options` go to `RestrictedVocabLM`.

    Raises:
        FileNotFoundError: if either directory lacks its weights.
    """
    model, vocab_ids = load_draft_model(target_dir, draft_dir, as_dtype(dtype, device))
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    return RestrictedVocabLM(model.to(device), tokenizer, vocab_ids, **options)


def needs_hf_backend(name: str | None) -> bool:
    """Whether the draft `name` runs on the hf backend only: a restricted-vocabulary draft (q = 0
    off its vocabulary) or a feature-reading draft (it reads the target's hidden states)."""
    if name in ("distilled", "feature"):
        return True
    if name in (None, *PACKAGE_DRAFTS):
        return False
    return is_draft_dir(name) or is_feature_draft_dir(name)
