"""Rows of different lengths (`Sequences.join`, `truncate_rows`, ragged `extend`): the backend laws
of `smc_sd.testing` over ragged rows, for the toy backend and the paged HF backend, and a clear
refusal from the backends whose rows keep one length."""

import pytest
import torch

from smc_sd import testing
from smc_sd.backends.toy import ToyLM

PROMPTS = [[0], [1, 2, 0, 1], [2, 2]]


def continuation(vocab: int, rows: int = 3, steps: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, steps), generator=torch.Generator().manual_seed(seed))


def test_toy_rows_keep_the_laws_when_their_lengths_differ():
    lm = ToyLM.random(4, seed=2)
    c = continuation(4)
    testing.assert_ragged_extend_matches_full_forward(lm, PROMPTS, c, atol=0.0)
    testing.assert_ragged_select_consistent(lm, PROMPTS, c, torch.tensor([2, 0, 2, 1]), atol=0.0)
    testing.assert_ragged_truncate_consistent(lm, PROMPTS, c, [0, 6, 3], atol=0.0)


def test_toy_length_is_refused_once_rows_differ():
    rows, _ = ToyLM.random(4).open([0], 2)
    rows.join([1, 2], 1)
    with pytest.raises(ValueError, match="differ in length"):
        rows.length
    with pytest.raises(ValueError, match="truncate lengths"):
        rows.truncate_rows(torch.tensor([1, 2, 3]))
