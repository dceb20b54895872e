"""The shipped distilled draft: it loads offline, pairs with the target, obeys the backend laws,
puts q = 0 off its vocabulary, is cheap, and predicts the target on held-out prompts."""

import pathlib

import pytest
import torch

from smc_sd import testing
from smc_sd.backends.base import check_same_vocabulary
from smc_sd.backends.hf import chat_prompt
from smc_sd.backends.restricted_vocab import RestrictedVocabLM
from smc_sd.models.draft import DRAFT_DIR, GROUP, dequantize_int8, is_draft_dir, quantize_int8

pytestmark = pytest.mark.model

HELDOUT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.txt"
# Mean 1 - TV over 2 held-out prompts x 16 target-sampled positions. The shipped draft measures
# 0.385 here (its forward-KL-only predecessor 0.372); the 3-layer, 8192-token draft before that
# 0.28, a barely trained student (10 optimiser steps) 0.08, and drafts made by skipping a third
# or more of the target's layers 0.03-0.2 (cheap, but far worse).
ACCEPTANCE_FLOOR = 0.32


@pytest.fixture(scope="module")
def prompt(default_lm):
    return chat_prompt(default_lm.tokenizer, HELDOUT.read_text().splitlines()[0])


def test_int8_storage_rounds_each_weight_to_half_a_step_of_its_group():
    generator = torch.Generator().manual_seed(0)
    # [8, 64] weights with a few large outliers, as trained matrices have
    weight = torch.randn(8, 64, generator=generator)
    weight[0, 3], weight[5, 40] = 30.0, -12.0
    quantized, scale = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and scale.shape == (8, 64 // GROUP)
    error = (dequantize_int8(quantized, scale) - weight).abs()
    # [8, 64] the step s of each weight's group
    step = scale.float().repeat_interleave(GROUP, dim=1)
    assert torch.all(error <= step / 2 + 1e-6)
    # an outlier only coarsens its own group: the other groups keep fine steps
    assert step[0, GROUP:].max() < step[0, 0] / 5


def test_shipped_files_are_small_and_self_contained():
    assert is_draft_dir(DRAFT_DIR)
    size = sum(f.stat().st_size for f in DRAFT_DIR.iterdir())
    assert size < 40e6


@pytest.fixture(scope="module")
def distilled_draft():
    from smc_sd import drafts

    return drafts.distilled_draft()


def test_distilled_draft_is_restricted_and_pairs_with_the_target(default_lm, distilled_draft):
    assert isinstance(distilled_draft, RestrictedVocabLM)
    check_same_vocabulary(distilled_draft, default_lm)
    assert distilled_draft.vocabulary.fingerprint == default_lm.vocabulary.fingerprint
    # multiply-adds per token: the draft's layers and restricted head [V_S, 576] against the
    # target's layers and full head [V, 576] (the input embeddings are lookups, not products)
    def macs(lm, head_rows):
        layers = sum(p.numel() for n, p in lm.model.named_parameters() if ".layers." in n)
        return layers + head_rows * lm.model.config.hidden_size

    assert macs(distilled_draft, len(distilled_draft.vocab_ids)) < macs(default_lm, default_lm.vocabulary.size) / 4


def test_draft_obeys_the_laws(distilled_draft, prompt):
    reply = distilled_draft.tokenizer.encode("The lighthouse keeper lit the lamp at dusk.")
    # [2, 6] natural text, the second row shifted by one token so rows differ
    rows = torch.tensor([reply[:6], reply[1:7]])
    atol = testing.float32_logit_tolerance(distilled_draft.model, [prompt + row for row in rows.tolist()])
    testing.assert_extend_matches_full_forward(distilled_draft, prompt, rows[:1], atol)
    testing.assert_select_consistent(distilled_draft, prompt, rows, torch.tensor([1, 0, 1]), atol)
    testing.assert_truncate_consistent(distilled_draft, prompt, rows, 2, atol)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 10.0])
def test_q_is_exactly_zero_off_the_draft_vocabulary(distilled_draft, prompt, temperature):
    _, logits = distilled_draft.open(prompt, 1)
    q = torch.softmax(logits / temperature, dim=-1)
    off = torch.ones_like(q, dtype=torch.bool)
    off[distilled_draft.vocab_ids] = False
    assert int(off.sum()) == q.numel() - len(distilled_draft.vocab_ids)
    assert torch.all(q[off] == 0)
    assert torch.all(q[~off] > 0)
    assert abs(q.sum().item() - 1) < 1e-5


def test_acceptance_on_heldout_prompts(default_lm, distilled_draft):
    """Mean sum_v min(p, q) along target samples (T = 1, seeded) of two held-out prompts."""
    generator = torch.Generator().manual_seed(0)
    accept = []
    for text in HELDOUT.read_text().splitlines()[1:3]:
        prompt = chat_prompt(default_lm.tokenizer, text)
        target_rows, p_logits = default_lm.open(prompt, 1)
        draft_rows, q_logits = distilled_draft.open(prompt, 1)
        for _ in range(16):
            p = torch.softmax(p_logits, -1)
            accept.append(torch.minimum(p, torch.softmax(q_logits, -1)).sum().item())
            token = torch.multinomial(p, 1, generator=generator)[None]
            p_logits, q_logits = target_rows.extend(token)[0, -1], draft_rows.extend(token)[0, -1]
    assert sum(accept) / len(accept) > ACCEPTANCE_FLOOR
