"""vLLM rows of different lengths: the backend laws of `smc_sd.testing` over ragged rows (rows
joined from several prompts, rolled back to lengths of their own, then extended), and clear
refusals of what rows of several lengths cannot do.

Run in the vLLM environment with `python -m pytest tests/vllm -m vllm` (docs/backends.md).
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


@pytest.mark.parametrize("counts", [[1, 4, 2], [0, 3, 4]], ids=["ragged", "one-row-reads-nothing"])
def test_extend_rows_appends_each_rows_own_count(vllm_lm, prompts, continuation, atol, counts):
    testing.assert_extend_rows_consistent(vllm_lm, prompts, continuation, counts, atol)


def test_rows_holding_sessions_compute_only_their_new_tokens(vllm_lm, prompts, continuation):
    """After one pass every row holds a session, so vLLM computes exactly the kept tokens; a fork's
    second copy has none and recomputes what its full blocks do not cover."""
    rows = testing.open_ragged(vllm_lm, prompts, atol=float("inf"))
    rows.extend(continuation[:, :1])
    computed = lambda: vllm_lm.prompt_tokens - vllm_lm.cached_tokens  # noqa: E731
    before = computed()
    rows.extend_rows(continuation[:, 1:4], torch.tensor([1, 3, 2]))
    assert computed() - before == 6
    rows.select(torch.tensor([0, 0, 1, 2]))
    before = computed()
    rows.extend_rows(continuation[[0, 0, 1, 2], 4:5], torch.tensor([1, 1, 1, 1]))
    # three sessions compute one token each; the copy computes its tail past its last full block
    block = vllm_lm.options.block_size
    tail = rows.lengths[1].item() % block or block
    assert computed() - before == 3 + tail
    rows.close()


def test_rolled_back_rows_keep_their_sessions(vllm_lm, prompts, continuation, atol):
    """A row shortened by truncate_rows (a rejected draft) keeps its session, rolled back: the
    next extend computes only its new token, and its logits are the shortened row's own."""
    rows = testing.open_ragged(vllm_lm, prompts[:2], atol)
    filler = torch.arange(3000, 3040).repeat(2, 1)
    rows.extend(filler)
    # row 0 back into a block it filled, row 1 back to a block boundary's far side
    lengths = [len(prompts[0]) + 3, len(prompts[1]) + 37]
    rows.truncate_rows(torch.tensor(lengths))
    before = vllm_lm.prompt_tokens - vllm_lm.cached_tokens
    logits = rows.extend(continuation[:2, :1])
    assert vllm_lm.prompt_tokens - vllm_lm.cached_tokens - before == 2
    for b, (prompt, length) in enumerate(zip(prompts, lengths)):
        prefix = prompt + filler[b, : length - len(prompt)].tolist() + continuation[b, :1].tolist()
        torch.testing.assert_close(logits[b, 0], testing.fresh_logits(vllm_lm, prefix), atol=atol, rtol=0)
    rows.close()


def test_rolling_back_into_a_shared_block_leaves_the_sharer_intact(vllm_lm, prompts, continuation, atol):
    """A fork's copy reads its source's full blocks from the prefix cache; the source rolled back
    into one of them must not write over it (it opens a new session instead)."""
    rows, _ = vllm_lm.open(prompts[0], 1)
    filler = torch.arange(4000, 4064)[None, :]
    rows.extend(filler)
    rows.select(torch.tensor([0, 0]))
    rows.extend(continuation[:2, :1])
    # into a full block both rows now hold (the copy read it from the prefix cache)
    cut = len(prompts[0]) + 10
    rows.truncate_rows(torch.tensor([cut, rows.lengths[1].item()]))
    before = vllm_lm.prompt_tokens - vllm_lm.cached_tokens
    logits = rows.extend(continuation[:2, 1:2])
    # the copy computes its one token; the source, in a new session, its tail past its last full block
    assert vllm_lm.prompt_tokens - vllm_lm.cached_tokens - before == 1 + cut % vllm_lm.options.block_size + 1
    shared = prompts[0] + filler[0].tolist()
    expected = [shared[:cut] + continuation[0, 1:2].tolist(), shared + continuation[1, :2].tolist()]
    for b in range(2):
        torch.testing.assert_close(logits[b, 0], testing.fresh_logits(vllm_lm, expected[b]), atol=atol, rtol=0)
    rows.close()


def test_sessions_beyond_the_engines_slots_end_the_idle_ones(vllm_lm, atol):
    """More rows than vLLM has request slots: idle sessions end as needed, and every row's
    logits are still its own."""
    slots = vllm_lm.options.max_num_seqs
    prompts = [[1000 + k, 2000 + k] for k in range(slots + 8)]
    rows, _ = vllm_lm.open([1, 2, 3], 1)
    joined = rows.join_many(prompts, [1] * len(prompts))
    assert len(vllm_lm._sessions) <= slots
    for k in (0, slots // 2, len(prompts) - 1):
        torch.testing.assert_close(joined[k], testing.fresh_logits(vllm_lm, prompts[k]), atol=atol, rtol=0)
    logits = rows.extend(torch.full((rows.batch_size, 1), 7))
    for b in (1, rows.batch_size - 1):
        torch.testing.assert_close(logits[b, 0], testing.fresh_logits(vllm_lm, prompts[b - 1] + [7]), atol=atol, rtol=0)
    held = [session for session in rows._sessions if session is not None]
    rows.close()
    assert held and not any(session in vllm_lm._sessions for session in held)


def test_join_many_is_joining_one_by_one(vllm_lm, prompts, continuation, atol):
    rows = torch.cat([continuation[:1], continuation, continuation[2:]])
    testing.assert_join_many_consistent(vllm_lm, prompts, [2, 1, 2], rows, atol)


def test_join_many_runs_its_prompts_in_one_vllm_call(vllm_lm, prompts, monkeypatch):
    rows, _ = vllm_lm.open(prompts[0], 1)
    calls, run = [], vllm_lm._run

    def counted(requests, *args, **options):
        calls.append(len(requests))
        return run(requests, *args, **options)

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
