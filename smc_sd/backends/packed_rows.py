"""Rows packed end to end: one forward over only the tokens the rows really read.

When the rows of a batch read different numbers of new tokens (each row a block of its own
length, each joining prompt its own length), padding every row to the widest makes the linear
layers, which hold most of a pass's work, compute filler. A packed forward lays the rows' real
tokens end to end as one sequence of T = sum_b c_b tokens (row b's c_b tokens at its own
positions S_b .. S_b + c_b - 1), so the linear layers and the head see T tokens only.

Attention stays per row, in groups of rows, one SDPA call per group and layer:

    out_b = softmax(q_b k_b^T · scale + M_b) v_b,   M_b[t, j] = 0 if j <= S_b + t else -inf,

query t of row b seeing keys j <= S_b + t of its own row only (causal, aligned at the row's end).
So row b's logits are those of its forward alone, up to float summation order. A group's queries
are padded to Q = max c_b and its keys to K = max seen_b over its rows (seen_b = S_b + c_b; a
padding query's output is dropped, a padding key is masked), so the groups keep the padding small:

- a row reading more than `BATCHED_QUERIES` tokens (a prompt) is a group alone;
- the others are split by width class (2^(i-1) < c_b <= 2^i: 1, 2, 3-4, 5-8, 9-16 tokens), and
  within a class, rows ordered by seen_b from the longest, a group ends before a row that sees
  fewer than 1 / KEY_SLACK of the group's first row's keys.

A group's padded queries per row are then fewer than 2x the row's own, its padded keys at most
KEY_SLACK x.
Padding every block of a cycle to the widest and every row's keys to the longest computed 3.6x
the real attention on the serve extraction workload (smc-sd N = 4 with the free draft: most
particles read 1 token, a few 8 to 16, prompts of different lengths). The keys reach the attention
one tensor per group ([S_g, H_kv, K_g, D], `RowSpans.split` of the rows' slots, gathered by the
cache straight from the store), so no row's keys are copied twice. `RowSpans` holds the gathers
and masks, computed once per forward for every layer.

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
#: the (low, high] widths of the classes of rows attended together
WIDTH_CLASSES = ((0, 1), (1, 2), (2, 4), (4, 8), (8, 16))
#: rows reading more new tokens than this are attended alone
BATCHED_QUERIES = WIDTH_CLASSES[-1][1]
#: a group's padded keys per row are at most this times any of its rows' own
KEY_SLACK = 1.1


@dataclass(frozen=True)
class RowGroup:
    """Rows attended together, padded to Q queries and K keys each.

    Attributes:
        rows: [S] int64 their indices among the R rows (on the CPU).
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
    def of(cls, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, device) -> RowGroup:
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
        return cls(rows, queries.reshape(-1).to(device), mask[:, None].to(device), flat.to(device),
                   queries.reshape(-1)[flat].to(device), keys)


@dataclass(frozen=True)
class RowSpans:
    """How the R rows of a packed forward are attended: their groups (the module docstring).

    Attributes:
        groups: every row that reads tokens in exactly one group.
    """

    groups: tuple[RowGroup, ...]

    @classmethod
    def of(cls, counts: torch.Tensor, lengths: torch.Tensor, device=None) -> RowSpans:
        """The groups of rows reading counts[b] new tokens to reach lengths[b] positions ([B]
        int64 each, on the CPU), packed row after row; the gathers on `device` (default: the CPU)."""
        device = torch.device("cpu") if device is None else device
        starts = counts.cumsum(0) - counts
        members = [row[None] for row in (counts > BATCHED_QUERIES).nonzero()[:, 0]]
        for low, high in WIDTH_CLASSES:
            rows = ((counts > low) & (counts <= high)).nonzero()[:, 0]
            members += key_runs(rows[lengths[rows].argsort(descending=True, stable=True)], lengths)
        return cls(tuple(RowGroup.of(rows, starts[rows], counts[rows], lengths[rows], device) for rows in members))

    def split(self, padded: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each group's rows of `padded` [R, >= K, ...], its first K positions: [S_g, K_g, ...]."""
        return tuple(padded[group.rows.to(padded.device), : group.keys] for group in self.groups)


def key_runs(rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """`rows` (ordered by lengths, longest first) cut into runs whose first row's length is at
    most KEY_SLACK times each of the run's others."""
    runs, first = [], 0
    sizes = lengths[rows].tolist()
    for i, size in enumerate(sizes):
        if size * KEY_SLACK < sizes[first]:
            runs.append(rows[first:i])
            first = i
    if sizes:
        runs.append(rows[first:])
    return runs


def packed_rows_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, row_spans: RowSpans | None = None, **kwargs):
    """Attention of packed rows, each over its own keys (the module docstring's formula).

    Args:
        query: [1, H_q, T, D], the packed rows' queries.
        key, value: one tensor per group of `row_spans`, [S_g, H_kv, K_g, D]: its rows' keys and
            values, padded (H_q a multiple of H_kv: grouped-query attention).
        row_spans: how the rows are grouped.

    Returns:
        ([1, T, H_q, D] attention output, None), as transformers' attention functions return.
    """
    if row_spans is None:
        raise ValueError(f"the {PACKED_ATTENTION} attention needs row_spans (a packed forward)")
    heads, head_dim = query.shape[1], query.shape[3]
    out = query.new_empty(1, query.shape[2], heads, head_dim)
    for group, keys, values in zip(row_spans.groups, key, value, strict=True):
        rows, width = len(group.rows), len(group.queries) // len(group.rows)
        # [H, S · Q, D] -> [S, H, Q, D]
        padded = query[0].index_select(1, group.queries).view(heads, rows, width, head_dim).transpose(0, 1)
        attended = F.scaled_dot_product_attention(padded, keys, values, attn_mask=group.mask, scale=scaling, enable_gqa=True)
        # [S, H, Q, D] -> [S · Q, H, D], the real queries into their packed places
        out[0, group.packed] = attended.transpose(1, 2).reshape(rows * width, heads, head_dim).index_select(0, group.real)
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
