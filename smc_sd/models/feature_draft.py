"""A draft that reads the target's features (EAGLE-style): the model family.

Letters: B rows, n tokens per row, D the target's width, m target layers read, V vocabulary.

The target's feature at position t is F_t = [y^(l)_t for l in `feature_layers`], [m·D]: the
outputs of those decoder layers (before the final norm), concatenated. The draft keeps a state
h_t [D] per position: h_t = fuse(F_t) (a Linear m·D -> D; the identity when m = 1) where the
target has read position t, else its own prediction o_t. Draft position t reads token x_{t+1}:

    u_t     = fc([embed(x_{t+1}), h_t])                 Linear 2D -> D
    o_{t+1} = Layer(u_0 .. u_t)_t                       one Llama decoder layer, causal, rotary position t
    q(x_{t+2} = v | x_0 .. x_{t+1}) = softmax(head(norm(o_{t+1})))_v

`embed`, `norm` and `head` are the target's own (frozen, tied embedding), so q is a proper
distribution over all V tokens, and o_{t+1} is the draft's prediction of h_{t+1}. A row of n
tokens holds draft positions 0 .. n - 2 (token x_0 has no feature before it).

Training-time test (EAGLE-3): at block position s the draft's state for the positions past the
last verified one are its own outputs. `FeatureDraft.unroll` computes every block position s =
1..S at every t at once: step s reads h^(s)_t = o^(s-1)_t (the output of step s - 1 at position
t - 1; h^(1) = fuse(F)), and its query at t attends to the keys of step 1 at positions <= t - s + 1
(built from true features) and to the key of step r at position t - s + r for r = 2..s (the
positions drafted since), exactly what the cached `step` sees when it drafts s tokens after the
verified position t - s + 1.

Storage: config.json (the feature layers and the target's LlamaConfig) and the draft's own
weights (fuse, fc, the decoder layer) in fp16; the model IS the fp16-rounded weights.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import pathlib

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

FEATURE_DRAFT_DIR = pathlib.Path(__file__).parent / "smollm2_feature_draft"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


@contextlib.contextmanager
def capture_layer_outputs(model, layers: tuple[int, ...]):
    """Record the outputs of decoder layers `layers` of a transformers CausalLM during forwards.

    Yields a list that receives one [B, L, m·D] tensor (the layers' outputs concatenated, in the
    order of `layers`) per forward run inside the block.
    """
    decoder_layers = model.get_decoder().layers
    outputs: dict[int, torch.Tensor] = {}
    captured: list[torch.Tensor] = []

    def hook(index):
        def record(module, args, output):
            outputs[index] = output[0] if isinstance(output, tuple) else output
            if len(outputs) == len(layers):
                captured.append(torch.cat([outputs.pop(i) for i in layers], -1).float())
        return record

    handles = [decoder_layers[i].register_forward_hook(hook(i)) for i in layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


class FeatureDraft(torch.nn.Module):
    """The draft's own layers over the target's frozen embedding, final norm and tied head.

    Args:
        target_config: the target's LlamaConfig (width, heads, rotary settings).
        feature_layers: the target's decoder layers whose outputs make F (m of them).
        embed, norm, head: the target's modules; held by reference, not parameters of the draft.
    """

    def __init__(self, target_config: LlamaConfig, feature_layers: tuple[int, ...], embed, norm, head):
        super().__init__()
        if not feature_layers or not all(0 <= i < target_config.num_hidden_layers for i in feature_layers):
            raise ValueError(f"feature_layers must name layers 0 .. {target_config.num_hidden_layers - 1}, got {feature_layers}")
        width = target_config.hidden_size
        self.target_config, self.feature_layers = target_config, tuple(feature_layers)
        config = LlamaConfig(**{**target_config.to_dict(), "num_hidden_layers": 1})
        config._attn_implementation = "sdpa"
        self.fuse = torch.nn.Linear(len(feature_layers) * width, width, bias=False) if len(feature_layers) > 1 else torch.nn.Identity()
        self.fc = torch.nn.Linear(2 * width, width, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        # a tuple keeps the target's modules out of this module's parameters and state dict
        self._target = (embed, norm, head)
        params = inspect.signature(LlamaDecoderLayer.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_target(cls, target, feature_layers: tuple[int, ...], init_layer: int | None = None) -> FeatureDraft:
        """A fresh draft over a transformers LlamaForCausalLM `target`: fc starts as [I, I]
        (u = embed + h) and the decoder layer as a copy of the target's layer `init_layer`."""
        draft = cls(target.config, feature_layers, target.get_input_embeddings(), target.model.norm, target.lm_head)
        width = target.config.hidden_size
        with torch.no_grad():
            draft.fc.weight.copy_(torch.cat([torch.eye(width), torch.eye(width)], 1))
            if init_layer is not None:
                draft.layer.load_state_dict(target.model.layers[init_layer].state_dict())
        return draft

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        """h = fuse(F): [..., m·D] -> [..., D] in the draft's dtype (F may be float32)."""
        return self.fuse(features.to(self.fc.weight.dtype))

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """[..., D] outputs o -> [..., V] float32 logits head(norm(o))."""
        _, norm, head = self._target
        return head(norm(outputs)).float()

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int, cache) -> torch.Tensor:
        """Draft positions start .. start + L - 1 over a transformers Cache holding 0 .. start - 1.

        Args:
            tokens: [B, L] int64, x_{t+1} for each position t.
            hidden: [B, L, D] in the draft's dtype, h_t for each position t.
            cache: a DynamicCache of this draft's one layer; grows by L positions.

        Returns:
            [B, L, D] outputs o_{t+1}, in the draft's dtype.
        """
        embed = self._target[0]
        length = tokens.shape[1]
        # [B, L, D]
        inputs = self.fc(torch.cat([embed(tokens), hidden], -1))
        positions = torch.arange(start, start + length, device=tokens.device)[None]
        # [1, 1, L, start + L] additive causal mask over the cached and the new positions
        allowed = torch.ones(length, start + length, dtype=torch.bool, device=tokens.device).tril(start)
        mask = torch.zeros(allowed.shape, dtype=inputs.dtype, device=tokens.device).masked_fill(~allowed, torch.finfo(inputs.dtype).min)
        return self.layer(
            inputs,
            attention_mask=mask[None, None],
            position_ids=positions,
            position_embeddings=self.rotary(inputs, positions),
            use_cache=True,
            **{self._cache_kwarg: cache},
        )

    def unroll(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test: every draft position at block positions 1 .. steps.

        Args:
            tokens: [B, n] int64 rows x_0 .. x_{n-1}.
            features: [B, n - 1, m·D] the target's F_t at t = 0 .. n - 2.
            steps: S >= 1.

        Returns:
            S tensors [B, n - 1, D]: entry s - 1 at t is o_{t+1} drafted s tokens after the
            verified position t - s + 1 (for t < s - 1 there is no such position; those entries
            are computed from a placeholder and must be ignored).
        """
        attn, width = self.layer.self_attn, self.target_config.hidden_size
        batch, positions = tokens.shape[0], tokens.shape[1] - 1
        # [B, T, D] token embeddings of x_1 .. x_{n-1}
        embedded = self._target[0](tokens[:, 1:])
        pos = torch.arange(positions, device=tokens.device)[None]
        hidden = self.hidden(features)
        keys, values, outputs = [], [], []
        for s in range(1, steps + 1):
            if s > 1:
                # h^(s)_t = o^(s-1)_t, the step s - 1 output at position t - 1; t = 0 gets h_0
                hidden = torch.cat([hidden[:, :1], outputs[-1][:, :-1]], 1)
            x = self.fc(torch.cat([embedded, hidden], -1))
            normed = self.layer.input_layernorm(x)
            # [B, H, T, hd] and [B, Hkv, T, hd]
            shape = (batch, positions, -1, attn.head_dim)
            q = attn.q_proj(normed).view(shape).transpose(1, 2)
            k = attn.k_proj(normed).view(shape).transpose(1, 2)
            v = attn.v_proj(normed).view(shape).transpose(1, 2)
            cos, sin = self.rotary(x, pos)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.append(repeat_kv(k, attn.num_key_value_groups))
            values.append(repeat_kv(v, attn.num_key_value_groups))
            # [B, H, T, T] scores against step 1's keys at positions <= t - s + 1
            first = q @ keys[0].transpose(-1, -2) * attn.scaling
            allowed = torch.ones(positions, positions, dtype=torch.bool, device=tokens.device).tril(1 - s)
            scores = [first.masked_fill(~allowed, -math.inf)]
            shifted_values = [values[0]]
            for r in range(2, s + 1):
                # the key of step r at position t - (s - r), shifted to line up with t: [B, H, T, hd]
                lag = s - r
                k_r = torch.nn.functional.pad(keys[r - 1], (0, 0, lag, 0))[:, :, :positions]
                v_r = torch.nn.functional.pad(values[r - 1], (0, 0, lag, 0))[:, :, :positions]
                diagonal = (q * k_r).sum(-1, keepdim=True) * attn.scaling
                valid = (torch.arange(positions, device=tokens.device) >= lag)[None, None, :, None]
                scores.append(diagonal.masked_fill(~valid, -math.inf))
                shifted_values.append(v_r)
            weights = torch.softmax(torch.cat(scores, -1), -1)
            # [B, H, T, hd]: step 1's values by matrix product, the diagonal ones one each
            mixed = weights[..., :positions] @ values[0]
            for j, v_r in enumerate(shifted_values[1:]):
                mixed = mixed + weights[..., positions + j : positions + j + 1] * v_r
            x = x + attn.o_proj(mixed.transpose(1, 2).reshape(batch, positions, width))
            outputs.append(x + self.layer.mlp(self.layer.post_attention_layernorm(x)))
        return outputs

    def save(self, out_dir: pathlib.Path) -> None:
        """Write config.json and the draft's own weights in fp16 (the target's modules are left out)."""
        out_dir = pathlib.Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {name: value.detach().to(torch.float16).contiguous() for name, value in self.state_dict().items()}
        save_file(tensors, str(out_dir / WEIGHTS))
        (out_dir / WEIGHTS).chmod(0o644)
        config = {"feature_layers": list(self.feature_layers), "target": self.target_config.to_dict()}
        (out_dir / CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True))


def load_feature_draft(target, draft_dir: pathlib.Path = FEATURE_DRAFT_DIR) -> FeatureDraft:
    """The draft saved in draft_dir, in the target's dtype, over the modules of the transformers CausalLM `target`.

    Raises:
        FileNotFoundError: if draft_dir holds no saved draft.
        ValueError: if the draft was trained for a target of another shape.
    """
    draft_dir = pathlib.Path(draft_dir)
    if not (draft_dir / CONFIG).is_file() or not (draft_dir / WEIGHTS).is_file():
        raise FileNotFoundError(f"{draft_dir} holds no feature draft ({CONFIG} and {WEIGHTS})")
    config = json.loads((draft_dir / CONFIG).read_text())
    trained_for = LlamaConfig.from_dict(config["target"])
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        if getattr(trained_for, key) != getattr(target.config, key):
            raise ValueError(f"the feature draft in {draft_dir} was trained for a target with {key} "
                             f"{getattr(trained_for, key)}, this target has {getattr(target.config, key)}")
    draft = FeatureDraft(target.config, tuple(config["feature_layers"]), target.get_input_embeddings(), target.model.norm, target.lm_head)
    state = {name: value.to(target.dtype) for name, value in load_file(str(draft_dir / WEIGHTS)).items()}
    # assign: the parameters take the stored tensors' dtype (the rotary tables stay float32)
    draft.load_state_dict(state, strict=True, assign=True)
    return draft.to(target.device).eval()


def is_feature_draft_dir(path) -> bool:
    """Whether `path` holds a draft saved by `FeatureDraft.save`."""
    config = pathlib.Path(path) / CONFIG
    return config.is_file() and "feature_layers" in json.loads(config.read_text())
