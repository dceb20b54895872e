"""The transformers backend on the real default model: the backend laws, greedy decoding, drafts."""

import dataclasses
import types

import pytest
import torch

from smc_sd import testing
from smc_sd.backends.base import TokenizerMismatchError, check_same_vocabulary
from smc_sd.backends.hf import chat_prompt

pytestmark = pytest.mark.model

PARIS_QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def prompt(default_lm):
    return chat_prompt(default_lm.tokenizer, PARIS_QUESTION)


def greedy(lm, prompt, max_tokens):
    """Greedy reply token ids by repeated 1-token extends, stopping at end-of-sequence."""
    rows, logits = lm.open(prompt, 1)
    reply = []
    while len(reply) < max_tokens:
        token = int(logits.argmax())
        if token == lm.vocabulary.eos_token_id:
            break
        reply.append(token)
        logits = rows.extend(torch.tensor([[token]]))[0, -1]
    rows.close()
    return reply


@pytest.fixture(scope="module")
def continuation_rows(default_lm, prompt):
    """[2, 6] int64: the greedy reply and the reply shifted by one token, so rows differ.

    Natural text keeps logits in the model's usual range.
    """
    reply = greedy(default_lm, prompt, 7)
    return torch.tensor([reply[:6], reply[1:7]])


@pytest.fixture(scope="module")
def atol(default_lm, prompt, continuation_rows):
    """This processor's float32 noise on the rows the laws read (`testing.float32_logit_tolerance`)."""
    return testing.float32_logit_tolerance(default_lm.model, [prompt + row for row in continuation_rows.tolist()])


def test_prompt_is_a_list_of_ints(prompt):
    assert isinstance(prompt, list) and all(type(token) is int for token in prompt)


def test_greedy_answer_is_paris(default_lm, prompt):
    reply = greedy(default_lm, prompt, 20)
    assert default_lm.decode(reply) == "The capital of France is Paris."


def test_extend_matches_full_forward(default_lm, prompt, continuation_rows, atol):
    testing.assert_extend_matches_full_forward(default_lm, prompt, continuation_rows, atol)


@pytest.mark.parametrize("ancestors", [[1, 1, 0], [0, 0]], ids=["fork", "shrink"])
def test_select_consistent(default_lm, prompt, continuation_rows, ancestors, atol):
    testing.assert_select_consistent(
        default_lm, prompt, continuation_rows, torch.tensor(ancestors), atol
    )


@pytest.mark.parametrize("kept", [0, 3])
def test_truncate_consistent(default_lm, prompt, continuation_rows, kept, atol):
    testing.assert_truncate_consistent(default_lm, prompt, continuation_rows, kept, atol)


def test_open_logits(default_lm, prompt):
    rows, logits = default_lm.open(prompt, 3)
    assert logits.shape == (default_lm.vocabulary.size,) and logits.dtype == torch.float32
    testing.assert_logits_valid(logits)
    assert (rows.batch_size, rows.length) == (3, len(prompt))
    # the forward's own logits, not a copy: an edit in place (which the Sequences contract
    # forbids) fails loudly instead of changing what another reader sees
    assert logits.is_inference()
    with pytest.raises(RuntimeError, match="inference tensor"):
        logits[0] = 0.0


def test_vocabulary(default_lm):
    vocabulary = default_lm.vocabulary
    assert vocabulary.size == 49152
    assert vocabulary.eos_token_id == default_lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert default_lm.max_length == 8192


@pytest.mark.parametrize(
    "change", [{"fingerprint": "0" * 64}, {"size": 49153}, {"eos_token_id": 0}]
)
def test_mismatched_vocabulary_is_refused(default_lm, change):
    other = types.SimpleNamespace(vocabulary=dataclasses.replace(default_lm.vocabulary, **change))
    with pytest.raises(TokenizerMismatchError):
        check_same_vocabulary(other, default_lm)


def test_invalid_inputs_are_refused(default_lm, prompt):
    with pytest.raises(ValueError, match="at least one token"):
        default_lm.open([], 1)
    with pytest.raises(ValueError, match="batch_size"):
        default_lm.open(prompt, 0)
    rows, _ = default_lm.open(prompt, 2)
    for tokens in [torch.tensor([1, 2]), torch.tensor([[1], [2], [3]]), torch.zeros(2, 0)]:
        with pytest.raises(ValueError, match="shape"):
            rows.extend(tokens.long())
    with pytest.raises(ValueError, match="integer"):
        rows.extend(torch.zeros(2, 1))
    with pytest.raises(ValueError, match="truncate"):
        rows.truncate(len(prompt) + 1)
    with pytest.raises(ValueError, match="rows"):
        rows.select(torch.tensor([2]))
    rows.close()
    rows.close()
    with pytest.raises(ValueError, match="closed"):
        rows.extend(torch.tensor([[1], [2]]))


def test_drop_layers_validates_indices(default_lm):
    from smc_sd.backends.hf import drop_decoder_layers

    with pytest.raises(ValueError, match="0 .. 29"):
        drop_decoder_layers(default_lm.model, [30])


def test_default_draft_is_the_self_draft_obeys_the_laws_and_shares_the_vocabulary(default_lm, default_draft, prompt, continuation_rows, atol):
    # the default draft is `self_draft`: the target without one decoder layer
    assert len(default_draft.model.get_decoder().layers) == len(default_lm.model.get_decoder().layers) - 1
    check_same_vocabulary(default_draft, default_lm)
    testing.assert_extend_matches_full_forward(default_draft, prompt, continuation_rows[:1], atol)
    testing.assert_select_consistent(default_draft, prompt, continuation_rows, torch.tensor([1, 0, 1]), atol)
