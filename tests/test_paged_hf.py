"""The paged (token-trie) KV cache on the real default model: logits through shared blocks equal
fresh full forwards after forks, extends, resamples, truncations and releases, and every block
returns to the pool after a run, also after one that raises midway."""

import random

import pytest
import torch

from smc_sd import Schedule, testing
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.programs import get

pytestmark = pytest.mark.model

TEXT = (
    "The lighthouse keeper climbed the stairs every evening, lit the lamp and watched the ships "
    "pass the rocks until morning, writing each one down in a small blue book."
)


@pytest.fixture(scope="module")
def words(default_lm):
    """Natural-text token ids: their logits stay in the model's usual range."""
    return default_lm.tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def atol(default_lm, words):
    """This processor's float32 noise on the text (`testing.float32_logit_tolerance`)."""
    return testing.float32_logit_tolerance(default_lm.model, [words])


def paged(lm, block_size=4):
    """A second front end on the same weights, with its own pool of tiny blocks."""
    return HFLanguageModel(lm.model, lm.tokenizer, kv_cache="paged", block_size=block_size)


def fresh_logits(lm, prefix: list[int]) -> torch.Tensor:
    """[V] next-token logits of a full forward over `prefix`, without any cache reuse."""
    rows, logits = HFLanguageModel(lm.model, lm.tokenizer, kv_cache="copy").open(prefix, 1)
    rows.close()
    return logits


def test_random_fork_extend_resample_release_match_fresh_forwards(default_lm, words, atol):
    lm, rng = paged(default_lm), random.Random(0)
    prompt = words[:9]
    rows, _ = lm.open(prompt, 3)
    reference = [list(prompt) for _ in range(3)]
    for step in range(6):
        if step % 2 == 0:
            length = rng.randint(1, 3)
            # rows draw from a few nearby words, so some repeat each other and blocks merge
            new = [[words[rng.randint(9, 12) + j] for j in range(length)] for _ in reference]
            logits = rows.extend(torch.tensor(new))
            reference = [r + n for r, n in zip(reference, new)]
            for b, row in enumerate(reference):
                deviation = (logits[b, -1] - fresh_logits(default_lm, row)).abs().max().item()
                assert deviation <= atol, f"step {step} row {b}: logits differ by {deviation:.3g}"
        elif step == 3:
            rows.truncate(rows.length - 1)
            reference = [r[:-1] for r in reference]
        else:
            ancestors = [rng.randrange(len(reference)) for _ in range(rng.randint(2, 4))]
            rows.select(torch.tensor(ancestors))
            reference = [list(reference[a]) for a in ancestors]
        rows.check_invariants()
    memory = rows.memory()
    assert memory["peak_bytes"] <= memory["naive_peak_bytes"]
    rows.close()
    assert lm._paged.manager.pool.live == 0 and len(lm._paged.manager.trie) == lm._paged.manager.pool.cached


@pytest.mark.parametrize("kv_cache", ["paged", "copy"])
def test_backend_laws_hold_for_both_caches(default_lm, words, kv_cache, atol):
    lm = HFLanguageModel(default_lm.model, default_lm.tokenizer, kv_cache=kv_cache, block_size=4)
    continuation = torch.tensor([words[6:12], words[7:13]])
    testing.assert_select_consistent(lm, words[:6], continuation, torch.tensor([1, 1, 0]), atol)
    testing.assert_truncate_consistent(lm, words[:6], continuation, 3, atol)


def test_pool_is_empty_after_a_run_and_after_one_that_raises(default_lm, words):
    target, draft = paged(default_lm), paged(default_lm)
    program = get("smc-sd").program(target, draft, draft_len=2)
    result = program.run(words[:10], Schedule(4, max_tokens=6), seed=0)
    assert result.kv["peak_bytes"] > 0 and result.kv["peak_bytes"] < result.kv["naive_peak_bytes"]
    summary = result.to_json()
    assert summary["kv_peak_bytes"] == result.kv["peak_bytes"]
    assert summary["kv_naive_bytes"] == result.kv["naive_peak_bytes"]

    def interrupt(stats, rows):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        program.run(words[:10], Schedule(4, max_tokens=12), seed=1, on_cycle=interrupt)
    for lm in (target, draft):
        manager = lm._paged.manager
        manager.check_invariants()
        assert manager.pool.live == 0 and len(manager.trie) == manager.pool.cached


def test_a_prompt_seen_before_is_read_from_the_prefix_cache(default_lm, words, atol):
    lm = paged(default_lm)
    computed = []
    forward = lm._forward

    def counting_forward(tokens, *args, **kwargs):
        computed.append(tokens.shape[1])
        return forward(tokens, *args, **kwargs)

    lm._forward = counting_forward
    rows, _ = lm.open(words[:10], 2)
    rows.close()
    manager = lm._paged.manager
    # the prompt's two full blocks stay in the trie, cached, after its rows left
    assert manager.pool.live == 0 and manager.pool.cached == len(manager.trie) == 2
    # a longer prompt with the same start computes only what follows those 8 positions
    rows, logits = lm.open(words[:13], 3)
    assert computed == [10, 5] and manager.pool.cached == 0
    assert (logits - fresh_logits(default_lm, words[:13])).abs().max().item() <= atol
    rows.check_invariants()
    rows.close()


def test_dropping_the_prefix_cache_makes_the_next_prompt_computed_in_full(default_lm, words):
    lm = paged(default_lm)
    rows, _ = lm.open(words[:10], 1)
    rows.close()
    lm.drop_prefix_cache()
    manager = lm._paged.manager
    assert manager.pool.cached == len(manager.trie) == 0
    table, plan = manager.open_shared(words[:10])
    assert plan.slots.shape == (1, 10)
    manager.release(table)
    # a model without a prefix cache has nothing to drop
    HFLanguageModel(default_lm.model, default_lm.tokenizer, kv_cache="copy").drop_prefix_cache()
