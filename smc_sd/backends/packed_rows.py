"""Rows packed end to end: one forward over only the tokens the rows really read.

When the rows of a batch read different numbers of new tokens (each row a block of its own
length, each joining prompt its own length), padding every row to the widest makes the linear
layers, which hold most of a pass's work, compute filler. A packed forward lays the rows' real
tokens end to end as one sequence of T = sum_b c_b tokens (row b's c_b tokens at its own
positions S_b .. S_b + c_b - 1), so the linear layers and the head see T tokens only.

Attention stays per row. Every layer reads the rows' keys as one padded tensor [R, H, K, D]
(K = max_b seen_b, seen_b = S_b + c_b; positions past seen_b hold some valid KV and are masked),
and query t of row b sees keys j <= S_b + t of its own row only (causal, aligned at the row's end):

    out_b = softmax(q_b k_b^T · scale + M_b) v_b,   M_b[t, j] = 0 if j <= S_b + t else -inf.

So row b's logits are those of its forward alone, up to float summation order. Rows reading at
most `BATCHED_QUERIES` tokens (the cycles' blocks) are attended together, one call per layer: their
queries padded to Q = max c_b (a padding query's output is dropped) and
their keys to max seen_b. A row reading more (a prompt) is attended alone, so no other row is
padded to its width. `RowSpans` holds the gathers and masks, computed once per forward for every
layer.

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
#: rows reading at most this many new tokens are attended in one call per layer
BATCHED_QUERIES = 16


@dataclass(frozen=True)
class ShortRows:
    """The rows attended together, padded to Q queries and K keys each.

    Attributes:
        rows: [S] int64 their indices among the R rows.
        queries: [S · Q] int64 the packed query each padded query reads (a padding query reads
            its row's first).
        mask: [S, 1, Q, K] bool, True where a padded query sees a key.
        real: [n] int64 the padded (row, query) entries s · Q + t that are real queries, t < c_b,
            in packed order; `packed` [n] int64 their packed indices.
        keys: K, the keys the rows read (max seen_b over them).
    """

    rows: torch.Tensor
    queries: torch.Tensor
    mask: torch.Tensor
    real: torch.Tensor
    packed: torch.Tensor
    keys: int

    @classmethod
    def of(cls, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, device) -> ShortRows:
        """The padding of rows `rows` ([S] int64) whose new tokens start at packed index
        starts[s], number counts[s] >= 1 and see seen[s] keys ([S] int64 each)."""
        width, keys = int(counts.max()), int(seen.max())
        t = torch.arange(width)
        real = t[None, :] < counts[:, None]
        # [S, Q]: a padding query reads its row's first query
        queries = starts[:, None] + torch.where(real, t[None, :], 0)
        j = torch.arange(keys)
        # [S, Q, K]: query t of row s sees key j iff j <= seen - count + t (a real query t < count
        # sees no padding key; a padding query's output is dropped)
        mask = j[None, None, :] <= (seen - counts)[:, None, None] + t[None, :, None]
        flat = real.reshape(-1).nonzero()[:, 0]
        return cls(rows.to(device), queries.reshape(-1).to(device), mask[:, None].to(device), flat.to(device),
                   queries.reshape(-1)[flat].to(device), keys)


@dataclass(frozen=True)
class RowSpans:
    """Where each of R rows lies in a packed forward.

    Attributes:
        queries: R + 1 offsets: row b's new tokens are packed tokens queries[b] .. queries[b+1] - 1.
        seen: R ints: row b sees its positions 0 .. seen[b] - 1, the first seen[b] of its keys.
        short: the rows reading 1 .. BATCHED_QUERIES tokens, attended together (None if none).
        alone: the other rows that read tokens, each attended alone.
    """

    queries: list[int]
    seen: list[int]
    short: ShortRows | None
    alone: list[int]

    @classmethod
    def of(cls, counts: torch.Tensor, lengths: torch.Tensor, device=None) -> RowSpans:
        """The spans of rows reading counts[b] new tokens to reach lengths[b] positions ([B]
        int64 each); the gathers on `device` (default: the CPU)."""
        device = torch.device("cpu") if device is None else device
        zero = torch.zeros(1, dtype=torch.int64)
        starts = torch.cat([zero, counts.cumsum(0)])
        batched = (counts >= 1) & (counts <= BATCHED_QUERIES)
        rows = batched.nonzero()[:, 0]
        short = ShortRows.of(rows, starts[rows], counts[rows], lengths[rows], device) if len(rows) else None
        alone = ((counts > BATCHED_QUERIES).nonzero()[:, 0]).tolist()
        return cls(starts.tolist(), lengths.tolist(), short, alone)


def packed_rows_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, row_spans: RowSpans | None = None, **kwargs):
    """Attention of packed rows, each over its own keys (the module docstring's formula).

    Args:
        query: [1, H_q, T, D], the packed rows' queries.
        key, value: [R, H_kv, K, D], the rows' keys and values, padded (H_q a multiple of H_kv:
            grouped-query attention).
        row_spans: where each row's queries and keys lie.

    Returns:
        ([1, T, H_q, D] attention output, None), as transformers' attention functions return.
    """
    if row_spans is None:
        raise ValueError(f"the {PACKED_ATTENTION} attention needs row_spans (a packed forward)")
    heads, head_dim = query.shape[1], query.shape[3]
    out = query.new_empty(1, query.shape[2], heads, head_dim)
    short = row_spans.short
    if short is not None:
        rows, width = len(short.rows), len(short.queries) // len(short.rows)
        # [H, S · Q, D] -> [S, H, Q, D]
        padded = query[0].index_select(1, short.queries).view(heads, rows, width, head_dim).transpose(0, 1)
        keys = key[:, :, : short.keys].index_select(0, short.rows)
        values = value[:, :, : short.keys].index_select(0, short.rows)
        attended = F.scaled_dot_product_attention(padded, keys, values, attn_mask=short.mask, scale=scaling, enable_gqa=True)
        # [S, H, Q, D] -> [S · Q, H, D], the real queries into their packed places
        out[0, short.packed] = attended.transpose(1, 2).reshape(rows * width, heads, head_dim).index_select(0, short.real)
    for b in row_spans.alone:
        q0, q1, seen = row_spans.queries[b], row_spans.queries[b + 1], row_spans.seen[b]
        new = q1 - q0
        # [new, seen] bool: query t sees keys j <= seen - new + t
        causal = torch.ones(new, seen, dtype=torch.bool, device=query.device).tril(seen - new)
        rows = F.scaled_dot_product_attention(
            query[:, :, q0:q1], key[b : b + 1, :, :seen], value[b : b + 1, :, :seen], attn_mask=causal, scale=scaling, enable_gqa=True
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
