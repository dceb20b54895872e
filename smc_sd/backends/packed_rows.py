"""Rows packed end to end: one forward over only the tokens the rows really read.

When the rows of a batch read different numbers of new tokens (each row a block of its own
length, each joining prompt its own length), padding every row to the widest makes the linear
layers, which hold most of a pass's work, compute filler. A packed forward lays the rows' real
tokens end to end as one sequence of T = sum_b c_b tokens (row b's c_b tokens at its own
positions S_b .. S_b + c_b - 1), so the linear layers and the head see T tokens only.

Attention stays per row. The KV of every row's positions 0 .. S_b + c_b - 1 is read into one
concatenated key sequence; `RowSpans` says where each row's queries and keys lie in the packed
sequences, and `packed_rows_attention` lets query t of row b see keys j <= S_b + t of its own
row only (causal, aligned at the row's end):

    out_b = softmax(q_b k_b^T · scale + M_b) v_b,   M_b[t, j] = 0 if j <= S_b + t else -inf.

So row b's logits are those of its forward alone, up to float summation order.

The attention function is registered with transformers under `PACKED_ATTENTION` and chosen only
for the length of a packed forward (`packed_attention`): every other forward of the model keeps
its own implementation. A model runs one forward at a time (the engine's loop thread).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

#: the name of `packed_rows_attention` among transformers' attention implementations
PACKED_ATTENTION = "smc_sd_packed_rows"


@dataclass(frozen=True)
class RowSpans:
    """Where each of R rows lies in a packed forward.

    Attributes:
        queries: R + 1 offsets: row b's new tokens are packed tokens queries[b] .. queries[b+1] - 1.
        keys: R + 1 offsets: row b's positions 0 .. S_b + c_b - 1 are packed keys keys[b] .. keys[b+1] - 1.
    """

    queries: list[int]
    keys: list[int]

    @classmethod
    def of(cls, counts: torch.Tensor, lengths: torch.Tensor) -> RowSpans:
        """The spans of rows reading counts[b] new tokens to reach lengths[b] positions ([B] int64 each)."""
        zero = torch.zeros(1, dtype=torch.int64)
        return cls(torch.cat([zero, counts.cumsum(0)]).tolist(), torch.cat([zero, lengths.cumsum(0)]).tolist())


def packed_rows_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, row_spans: RowSpans | None = None, **kwargs):
    """Attention of packed rows, each over its own keys (the module docstring's formula).

    Args:
        query: [1, H_q, T, D], the packed rows' queries.
        key, value: [1, H_kv, T_k, D], every row's keys and values end to end (H_q a multiple
            of H_kv: grouped-query attention).
        row_spans: where each row's queries and keys lie.

    Returns:
        ([1, T, H_q, D] attention output, None), as transformers' attention functions return.
    """
    if row_spans is None:
        raise ValueError(f"the {PACKED_ATTENTION} attention needs row_spans (a packed forward)")
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    spans = zip(row_spans.queries, row_spans.queries[1:], row_spans.keys, row_spans.keys[1:])
    for q0, q1, k0, k1 in spans:
        new, seen = q1 - q0, k1 - k0
        # [new, seen] bool: query t sees keys j <= seen - new + t
        causal = None if new == 1 else torch.ones(new, seen, dtype=torch.bool, device=query.device).tril(seen - new)
        rows = F.scaled_dot_product_attention(
            query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], attn_mask=causal, scale=scaling, enable_gqa=True
        )
        out[:, q0:q1] = rows.transpose(1, 2)
    return out, None


AttentionInterface.register(PACKED_ATTENTION, packed_rows_attention)


@contextlib.contextmanager
def packed_attention(model):
    """Run the model's attention layers with `packed_rows_attention` inside the block; its own
    implementation is restored after it. transformers builds no mask for this implementation."""
    config = model.config
    own = config._attn_implementation
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = own
