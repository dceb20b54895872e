"""Rows of different lengths (`Sequences.join`, `truncate_rows`, ragged `extend`, `extend_rows`): the backend laws
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
    testing.assert_join_many_consistent(lm, PROMPTS, [1, 2, 1], continuation(4, rows=4), atol=0.0)
    testing.assert_extend_rows_consistent(lm, PROMPTS, c, [1, 5, 0], atol=0.0)


def test_toy_length_is_refused_once_rows_differ():
    rows, _ = ToyLM.random(4).open([0], 2)
    rows.join([1, 2], 1)
    with pytest.raises(ValueError, match="differ in length"):
        rows.length
    with pytest.raises(ValueError, match="truncate lengths"):
        rows.truncate_rows(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="counts must lie in 0 .. 2"):
        rows.extend_rows(torch.tensor([[1, 2], [3, 0], [0, 0]]), torch.tensor([1, -1, 2]))


@pytest.fixture(scope="module")
def paged_llama():
    from tests.tiny_llama import lm, tiny_llama

    # tiny blocks, so prompts span several and a joined prompt shares full ones
    return lm(tiny_llama(), kv_cache="paged", block_size=2)


def test_paged_hf_rows_keep_the_laws_when_their_lengths_differ(paged_llama):
    prompts = [[3, 1, 4, 1, 5], [3, 1, 4, 1, 9, 2, 6, 5], [7]]
    c = continuation(64)
    testing.assert_ragged_extend_matches_full_forward(paged_llama, prompts, c, atol=2e-5)
    testing.assert_ragged_select_consistent(paged_llama, prompts, c, torch.tensor([2, 0, 2, 1]), atol=2e-5)
    testing.assert_ragged_truncate_consistent(paged_llama, prompts, c, [0, 11, 6], atol=2e-5)
    # rows reading blocks of their own lengths, one the whole width, one nothing
    testing.assert_extend_rows_consistent(paged_llama, prompts, c, [2, 5, 0], atol=2e-5)
    # prompts sharing full blocks and not, of several lengths, one of them a single token
    prompts += [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8, 8, 8]]
    testing.assert_join_many_consistent(paged_llama, prompts, [2, 1, 3, 1, 2], continuation(64, rows=9), atol=2e-5)
    manager = paged_llama._paged.manager
    manager.check_invariants()
    assert manager.pool.live == 0 and len(manager.trie) == manager.pool.cached


def test_paged_hf_join_computes_only_the_prompt_past_its_shared_prefix(paged_llama):
    system = [3, 1, 4, 1, 5, 9, 2, 6]
    rows, _ = paged_llama.open(system + [7], 2)
    live = paged_llama._paged.manager.pool.live
    calls = []
    handle = paged_llama.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        logits = rows.join(system + [8, 8], 3)
        # the 4 full blocks of the system prompt are shared: one forward over the last 2 positions
        assert calls == [(1, 2)] and paged_llama._paged.manager.pool.live == live + 1
        # two prompts in one forward: 3 and 1 positions past the shared blocks, packed end to end
        rows.join_many([system + [1, 2, 3], system + [4]], [1, 2])
        assert calls == [(1, 2), (1, 4)]
        # rows reading 1 and 3 tokens: 4 tokens computed, not 2 rows of 3
        rows.extend_rows(torch.tensor([[5, 5, 5]] * 8), torch.tensor([1, 3, 1, 1, 1, 1, 1, 1]))
        assert calls[-1] == (1, 10)
    finally:
        handle.remove()
    assert (logits - testing.fresh_logits(paged_llama, system + [8, 8])).abs().max() < 2e-5
    assert rows.lengths.tolist() == [10, 12, 11, 11, 11, 12, 10, 10]
    rows.check_invariants()
    rows.close()


@pytest.mark.parametrize("kv_cache", ["copy", "static"])
def test_backends_with_rows_of_one_length_refuse_ragged_rows_by_name(kv_cache):
    from tests.tiny_llama import lm, tiny_llama

    rows, _ = lm(tiny_llama(layers=1), kv_cache=kv_cache).open([3, 1, 4], 2)
    with pytest.raises(NotImplementedError, match="Sequences keeps rows of one length only"):
        rows.join([1, 2], 1)
    with pytest.raises(NotImplementedError, match="cannot truncate rows to different lengths"):
        rows.truncate_rows(torch.tensor([1, 2]))
    # one common length is still a plain truncate
    rows.truncate_rows(torch.tensor([2, 2]))
    assert rows.length == 2


@pytest.mark.model
def test_default_model_ragged_rows_match_fresh_forwards_within_float_noise(default_lm):
    from smc_sd.backends.hf import HFLanguageModel, chat_prompt

    # its own pool with small blocks
    lm = HFLanguageModel(default_lm.model, default_lm.tokenizer, block_size=4)
    tokenizer = default_lm.tokenizer
    prompts = [chat_prompt(tokenizer, q) for q in ("Why is the sky blue?", "Name a painter.", "How do bees make honey, and why?")]
    words = tokenizer.encode(" The light of the evening sun fell on the old stone bridge", add_special_tokens=False)
    c = torch.tensor([words[0:5], words[3:8], words[6:11]])
    # float32 noise of this processor on these rows (fresh float32 against float64), not a constant
    atol = testing.float32_logit_tolerance(default_lm.model, [p + row for p, row in zip(prompts, c.tolist())])
    testing.assert_ragged_extend_matches_full_forward(lm, prompts, c, atol=atol)
    testing.assert_join_many_consistent(lm, prompts, [2, 1, 2], torch.cat([c[:1], c, c[2:]]), atol=atol)
    testing.assert_extend_rows_consistent(lm, prompts, c, [1, 4, 2], atol=atol)
