"""The distilled draft: a small Llama distilled from SmolLM2-135M-Instruct, shipped with the package.

The draft reads the target's (frozen) token embedding, runs a few decoder layers of the target's
width (576) and scores a restricted output vocabulary S, |S| = V_S << V: the LM head over all
V = 49152 tokens would cost more than the draft's layers. Only the layers, the final norm, the head
[V_S, 576] and the ids of S are stored (`smollm2_draft/model.safetensors`); the embedding is the
target's own (frozen in training) and is read from the target's weights at load time, so nothing
is downloaded.

Storage: every matrix W [rows, cols] is kept as int8 Q with one fp16 scale per group g of
GROUP consecutive entries of a row,

    s_rg = max_{c in g} |W_rc| / 127,   Q_rc = round(W_rc / s_rg),   loaded as W'_rc = s_rg Q_rc,

and the norms in fp16. The draft IS the dequantized model: its q is computed from W', so
the weights and acceptance tests use exactly the distribution it samples from.

The draft's q is 0 off S: `smc_sd.backends.restricted_vocab.RestrictedVocabLM` runs the model
loaded here and scatters its V_S logits into the full vocabulary; `smc_sd.drafts` pairs the two.
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

DRAFT_DIR = pathlib.Path(__file__).parent / "smollm2_draft"
WEIGHTS = "model.safetensors"
EMBEDDING = "model.embed_tokens.weight"
SCALE = ".int8_scale"
GROUP = 16


def build_student(target_config: LlamaConfig, layers: int, vocab_ids: torch.Tensor) -> LlamaForCausalLM:
    """A Llama with the target's width, `layers` decoder layers and a head over vocab_ids.

    The input embedding has the target's V rows (to be filled with the target's embedding); the
    head is an untied Linear(576 -> V_S).
    """
    config = LlamaConfig(**{**target_config.to_dict(), "num_hidden_layers": layers, "tie_word_embeddings": False})
    config.draft_vocab_size = len(vocab_ids)
    model = LlamaForCausalLM(config)
    model.lm_head = torch.nn.Linear(config.hidden_size, len(vocab_ids), bias=False)
    return model


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q [rows, cols] int8, s [rows, cols / GROUP] float16): W ~ s Q group by group, s = group max |W| / 127."""
    rows, cols = weight.shape
    # [rows, groups, GROUP]
    grouped = weight.detach().float().reshape(rows, cols // GROUP, GROUP)
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    scale = scale.half().float()
    return torch.round(grouped / scale).clamp(-127, 127).to(torch.int8).reshape(rows, cols), scale[..., 0].half()


def dequantize_int8(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 W' = s Q, the inverse of `quantize_int8` up to rounding (|W - W'| <= s / 2)."""
    rows, cols = quantized.shape
    return (quantized.float().reshape(rows, cols // GROUP, GROUP) * scale.float()[..., None]).reshape(rows, cols)


def save_draft(model: LlamaForCausalLM, vocab_ids: torch.Tensor, out_dir: pathlib.Path) -> None:
    """Write config.json and model.safetensors: the trained matrices in int8 with an fp16 scale
    per group of GROUP weights of a row (`quantize_int8`), the norms in fp16 (the embedding, the
    target's own, is left out) and the int64 vocabulary ids."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in model.state_dict().items():
        if name == EMBEDDING:
            continue
        if value.dim() == 2:
            tensors[name], tensors[name + SCALE] = quantize_int8(value)
        else:
            tensors[name] = value.detach().to(torch.float16)
    tensors["vocab_ids"] = vocab_ids.to(torch.int64)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / WEIGHTS))
    (out_dir / WEIGHTS).chmod(0o644)
    (out_dir / "config.json").write_text(json.dumps(model.config.to_dict(), indent=1, sort_keys=True))


def dequantize(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The stored tensors as weights in `dtype`: s * Q (computed in float32, then rounded to dtype)
    for every int8 matrix, the rest cast."""
    weights = {}
    for name, value in state.items():
        if name.endswith(SCALE):
            continue
        weight = dequantize_int8(value, state[name + SCALE]) if value.dtype == torch.int8 else value
        weights[name] = weight.to(dtype)
    return weights


def load_draft_model(
    target_dir: pathlib.Path, draft_dir: pathlib.Path = DRAFT_DIR, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """The draft saved in draft_dir, in `dtype` on the CPU, over the embedding of the target in target_dir.

    In bfloat16 the draft is W' = s Q rounded to bfloat16 (and the target's embedding rounded
    alike): q is computed from those weights, so it is still exactly what the draft samples.

    Returns:
        The model (its head [V_S, 576]) and the ids of S, [V_S] int64.

    Raises:
        FileNotFoundError: if either directory lacks its weights.
    """
    draft_dir, target_dir = pathlib.Path(draft_dir), pathlib.Path(target_dir)
    config = LlamaConfig.from_dict(json.loads((draft_dir / "config.json").read_text()))
    state = load_file(str(draft_dir / WEIGHTS))
    vocab_ids = state.pop("vocab_ids")
    with safe_open(str(target_dir / WEIGHTS), framework="pt") as weights:
        state[EMBEDDING] = weights.get_tensor(EMBEDDING)
    with torch.device("meta"):
        model = build_student(config, config.num_hidden_layers, vocab_ids)
    model.load_state_dict(dequantize(state, dtype), strict=True, assign=True)
    # the rotary tables are buffers computed at construction, not stored weights
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model, vocab_ids


def is_draft_dir(path) -> bool:
    """Whether `path` holds a draft saved by `save_draft` (rather than a full transformers model)."""
    config = pathlib.Path(path) / "config.json"
    return config.is_file() and "draft_vocab_size" in json.loads(config.read_text())
