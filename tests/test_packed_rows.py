"""`packed_rows_attention` against attention computed row by row in float64: rows reading few
tokens (attended together, padded) and rows reading many (attended alone) in one forward, with
grouped-query heads and keys padded past each row's length with values that must not leak in."""

import math

import pytest
import torch

from smc_sd.backends.packed_rows import BATCHED_QUERIES, RowSpans, packed_rows_attention


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
    assert spans.alone == [b for b, c in enumerate(counts) if c > BATCHED_QUERIES]
    out, _ = packed_rows_attention(None, query, key, value, None, scaling=head_dim ** -0.5, row_spans=spans)
    assert out.shape == (1, sum(counts), heads, head_dim)
    for b, (q0, q1) in enumerate(zip(spans.queries, spans.queries[1:])):
        expected = row_attention(query[0, :, q0:q1], key[b], value[b], lengths[b])
        # float32 attention of values of size 1: summation-order noise only
        assert (out[0, q0:q1].transpose(0, 1).double() - expected).abs().max() < 1e-5


def test_packed_rows_attention_needs_its_spans():
    with pytest.raises(ValueError, match="needs row_spans"):
        packed_rows_attention(None, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), None)
