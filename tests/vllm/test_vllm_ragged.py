"""vLLM rows of different lengths: the backend laws of `smc_sd.testing` over ragged rows (rows
joined from several prompts, rolled back to lengths of their own, then extended), and clear
refusals of what rows of several lengths cannot do.

Run in the vLLM environment with `python -m pytest tests/vllm -m vllm` (see README).
"""

import pytest
import torch

from smc_sd import testing
from smc_sd.backends.hf import chat_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.model]

QUESTIONS = ("Why is the sky blue?", "Name a painter.", "How do bees make honey, and why?")


@pytest.fixture(scope="module")
def prompts(hf_lm):
    """Three chat prompts of different lengths."""
    return [chat_prompt(hf_lm.tokenizer, question) for question in QUESTIONS]


@pytest.fixture(scope="module")
def continuation(hf_lm):
    """[3, 5] int64: overlapping windows of one sentence, a different one per row."""
    words = hf_lm.tokenizer.encode(" The light of the evening sun fell on the old stone bridge", add_special_tokens=False)
    return torch.tensor([words[0:5], words[3:8], words[6:11]])


@pytest.fixture(scope="module")
def atol(hf_lm, prompts, continuation):
    """This processor's float32 noise on the rows the laws read (`testing.float32_logit_tolerance`),
    measured on the hf twin of the vLLM engine: the same weights, so the same sums to round;
    the bound's spread covers vLLM's kernels blocking them differently."""
    return testing.float32_logit_tolerance(hf_lm.model, [p + row for p, row in zip(prompts, continuation.tolist())])


def test_ragged_extend_is_each_rows_own_factorisation(vllm_lm, prompts, continuation, atol):
    testing.assert_ragged_extend_matches_full_forward(vllm_lm, prompts, continuation, atol)


def test_rows_truncated_to_lengths_of_their_own_extend_as_rows_alone(vllm_lm, prompts, continuation, atol):
    # one row emptied, one cut inside its prompt, one inside its continuation
    lengths = [0, len(prompts[1]) - 4, len(prompts[2]) + 3]
    testing.assert_ragged_truncate_consistent(vllm_lm, prompts, continuation, lengths, atol)


def test_ragged_select_carries_lengths(vllm_lm, prompts, continuation, atol):
    testing.assert_ragged_select_consistent(vllm_lm, prompts, continuation, torch.tensor([2, 0, 2, 1]), atol)


def test_join_many_is_joining_one_by_one(vllm_lm, prompts, continuation, atol):
    rows = torch.cat([continuation[:1], continuation, continuation[2:]])
    testing.assert_join_many_consistent(vllm_lm, prompts, [2, 1, 2], rows, atol)


def test_join_many_runs_its_prompts_in_one_vllm_call(vllm_lm, prompts, monkeypatch):
    rows, _ = vllm_lm.open(prompts[0], 1)
    calls, run = [], vllm_lm._run

    def counted(requests, last):
        calls.append(len(requests))
        return run(requests, last)

    monkeypatch.setattr(vllm_lm, "_run", counted)
    # prompts never sent before: nothing of their last positions is cached
    fresh = [prompt + [5000 + k] for k, prompt in enumerate(prompts)]
    rows.join_many(fresh, [3, 1, 2])
    assert calls == [3]
    assert rows.lengths.tolist() == [len(prompts[0])] + [len(fresh[0])] * 3 + [len(fresh[1])] + [len(fresh[2])] * 2
    rows.close()


def test_rows_of_several_lengths_refuse_what_needs_one_length(vllm_lm, prompts):
    rows, _ = vllm_lm.open(prompts[1], 2)
    rows.join(prompts[0], 1)
    with pytest.raises(ValueError, match="differ in length"):
        rows.length
    with pytest.raises(ValueError, match="differ in length"):
        rows.truncate(3)
    with pytest.raises(ValueError, match="truncate lengths"):
        rows.truncate_rows(torch.tensor([1, 2, len(prompts[0]) + 1]))
    with pytest.raises(ValueError, match="a join adds at least one row"):
        rows.join(prompts[2], 0)
    # one common length is still a plain truncate
    rows.truncate_rows(torch.tensor([4, 4, 4]))
    assert rows.length == 4
    rows.close()
