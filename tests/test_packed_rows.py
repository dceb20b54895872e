"""`packed_rows_attention` against attention computed row by row in float64: rows reading few
tokens (attended in groups, padded) and rows reading many (attended alone) in one forward, with
grouped-query heads and keys padded past each row's length with values that must not leak in."""

import math

import pytest
import torch

from smc_sd.backends.packed_rows import BATCHED_QUERIES, KEY_SLACK, RowSpans, packed_rows_attention


def row_attention(q, k, v, seen: int) -> torch.Tensor:
    """[H_q, c, D] float64: query t sees keys j <= seen - c + t of k, v [H_kv, >= seen, D]."""
    groups = q.shape[0] // k.shape[0]
    k, v = k[:, :seen].repeat_interleave(groups, 0).double(), v[:, :seen].repeat_interleave(groups, 0).double()
    c = q.shape[1]
    scores = q.double() @ k.transpose(1, 2) / math.sqrt(q.shape[2])
    visible = torch.arange(seen)[None, :] <= seen - c + torch.arange(c)[:, None]
    return scores.masked_fill(~visible, -math.inf).softmax(-1) @ v


@pytest.mark.parametrize("counts, lengths", [
    ([1, 3, 5, 1], [7, 12, 5, 30]),              # all rows attended together, one reads its whole length
    ([2, BATCHED_QUERIES + 4, 1, 40], [9, 24, 50, 41]),  # two prompts attended alone beside two blocks
    ([BATCHED_QUERIES, BATCHED_QUERIES + 1], [16, 17]),  # the boundary on either side
    ([1, 9, 2, 1, 3, 16, 4, 5, 8, 2, 30], [40, 9, 3, 61, 20, 16, 33, 5, 70, 12, 30]),  # every width class, rows interleaved
    ([1, 1, 1, 1, 1, 2, 2], [100, 95, 91, 90, 60, 50, 49]),  # rows of one class, cut where keys differ by more than KEY_SLACK
])
def test_packed_rows_attention_equals_each_row_alone(counts, lengths):
    generator = torch.Generator().manual_seed(sum(counts))
    heads, kv_heads, head_dim = 6, 2, 8
    counts_t, lengths_t = torch.tensor(counts), torch.tensor(lengths)
    longest = max(lengths)
    query = torch.randn(1, heads, sum(counts), head_dim, generator=generator)
    # past each row's length: large values, which a leak would show
    key = torch.randn(len(counts), kv_heads, longest, head_dim, generator=generator)
    value = torch.randn(len(counts), kv_heads, longest, head_dim, generator=generator)
    for b, seen in enumerate(lengths):
        key[b, :, seen:] = 50.0
        value[b, :, seen:] = 1e3
    spans = RowSpans.of(counts_t, lengths_t)
    # every row is attended once; a prompt alone; a group pads fewer than 2x a row's queries and
    # at most KEY_SLACK x its keys
    assert sorted(b for group in spans.groups for b in group.rows.tolist()) == list(range(len(counts)))
    for group in spans.groups:
        rows, width = group.rows.tolist(), len(group.queries) // len(group.rows)
        assert len(rows) == 1 or width <= BATCHED_QUERIES
        assert all(width < 2 * counts[b] or width == counts[b] for b in rows)
        assert all(group.keys <= KEY_SLACK * lengths[b] for b in rows)
    # the keys group by group, as the paged cache reads them ([S_g, H, K_g, D])
    keys, values = ([part.transpose(1, 2) for part in spans.split(tensors.transpose(1, 2))] for tensors in (key, value))
    out, _ = packed_rows_attention(None, query, keys, values, None, scaling=head_dim ** -0.5, row_spans=spans)
    assert out.shape == (1, sum(counts), heads, head_dim)
    offsets = [0, *torch.tensor(counts).cumsum(0).tolist()]
    for b, (q0, q1) in enumerate(zip(offsets, offsets[1:])):
        expected = row_attention(query[0, :, q0:q1], key[b], value[b], lengths[b])
        # float32 attention of values of size 1: summation-order noise only
        assert (out[0, q0:q1].transpose(0, 1).double() - expected).abs().max() < 1e-5


def test_packed_rows_attention_needs_its_spans():
    with pytest.raises(ValueError, match="needs row_spans"):
        packed_rows_attention(None, torch.zeros(1, 2, 1, 4), (torch.zeros(1, 2, 1, 4),), (torch.zeros(1, 2, 1, 4),), None)
