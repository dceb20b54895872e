"""The feature-reading draft on tiny random Llamas built in code: the target rows' features, the
draft's backend laws given the same target features, its drafted positions against the training
forward (the training-time test), exact sd through it, smc-sd with it, and the training recipe."""

import os
import pathlib
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from smc_sd import Schedule, testing
from smc_sd.backends.base import LanguageModel, Sequences
from smc_sd.backends.toy import ToyLM
from smc_sd.backends.feature_draft import FeatureDraftLM
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.drafts import named_draft
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.models.feature_distill import held_back_acceptance, teacher_features, train, unrolled_loss
from smc_sd.models.feature_draft import FeatureDraft, capture_layer_outputs, load_feature_draft
from smc_sd.programs import smc_speculative, speculative
from tests.tiny_llama import EOS, PROMPT, continuation, lm, model, tiny_llama  # noqa: F401 (fixtures)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import draft_quality  # noqa: E402  (the benchmark script, importable once its folder is on the path)

# fp32 batching noise of these tiny models is ~1e-5 on logits; their features reach |100|
ATOL = 1e-4
FEATURE_ATOL = 1e-3


def feature_draft(model, layers=(1,), seed: int = 7) -> FeatureDraftLM:
    """A feature draft with random own weights over a fresh target LM of `model`."""
    torch.manual_seed(seed)
    draft = FeatureDraft.from_target(model, layers)
    for weight in (draft.fc.weight, *([draft.fuse.weight] if len(layers) > 1 else [])):
        torch.nn.init.normal_(weight, std=0.3)
    return FeatureDraftLM(lm(model), draft.requires_grad_(False))


def full_features(model, tokens: torch.Tensor, layers) -> torch.Tensor:
    """[B, n, m·D] the layers' outputs by a fresh forward's hidden_states (another code path)."""
    hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states
    last = model.config.num_hidden_layers - 1
    # hidden_states[l + 1] is layer l's output, except that the last entry is after the final norm
    return torch.cat([hidden[l + 1] if l != last else _unnorm(model, tokens) for l in layers], -1)


def _unnorm(model, tokens):
    with capture_layer_outputs(model, (model.config.num_hidden_layers - 1,)) as captured:
        model.model(input_ids=tokens)
    return captured[0]


class Paired(LanguageModel):
    """Target and feature draft as one LM whose rows extend the target first: the draft's logits
    given the same target features, the object the backend laws apply to."""

    def __init__(self, draft: FeatureDraftLM):
        self.draft, self.tokenizer = draft, draft.tokenizer

    vocabulary = property(lambda self: self.draft.vocabulary)
    max_length = property(lambda self: self.draft.max_length)

    def open(self, prompt, batch_size):
        target_rows, _ = self.draft.target.open(prompt, batch_size)
        draft_rows, logits = self.draft.open(prompt, batch_size)
        return PairedRows(target_rows, draft_rows), logits


class PairedRows(Sequences):
    def __init__(self, target_rows, draft_rows):
        self.target_rows, self.draft_rows = target_rows, draft_rows

    batch_size = property(lambda self: self.draft_rows.batch_size)
    length = property(lambda self: self.draft_rows.length)

    def extend(self, tokens):
        self.target_rows.extend(tokens)
        return self.draft_rows.extend(tokens)

    def select(self, rows):
        self.target_rows.select(rows)
        self.draft_rows.select(rows)

    def truncate(self, length):
        self.target_rows.truncate(length)
        self.draft_rows.truncate(length)

    def close(self):
        self.target_rows.close()
        self.draft_rows.close()


@pytest.mark.parametrize("layers", [(1,), (0, 1)], ids=["last", "fused"])
def test_target_rows_keep_the_features_of_a_fresh_forward(model, continuation, layers):
    target = lm(model)
    target.feature_layers = layers
    rows, _ = target.open(PROMPT, 2)
    rows.extend(continuation[:, :2])
    rows.extend(continuation[:, 2:5])
    rows.select(torch.tensor([1, 1, 0]))
    rows.truncate(len(PROMPT) + 3)
    rows.extend(continuation[[1, 1, 0], 3:])
    expected_rows = torch.cat([torch.tensor([PROMPT] * 3), continuation[[1, 1, 0]]], 1)
    assert torch.equal(rows.tokens, expected_rows)
    expected = full_features(model, expected_rows, layers)
    assert rows.features.shape == expected.shape
    assert (rows.features - expected).abs().max() < FEATURE_ATOL


def test_plain_target_rows_keep_no_features(model):
    rows, _ = lm(model).open(PROMPT, 1)
    with pytest.raises(ValueError, match="keep no features"):
        rows.features


@pytest.mark.parametrize("layers,prompt", [((1,), PROMPT), ((0, 1), PROMPT), ((1,), [3])], ids=["last", "fused", "one-token prompt"])
def test_draft_is_the_factorisation_given_the_same_target_features(model, continuation, layers, prompt):
    testing.assert_extend_matches_full_forward(Paired(feature_draft(model, layers)), prompt, continuation, ATOL)


@pytest.mark.parametrize("ancestors", [[1, 1, 0], [0, 0], [1, 0]], ids=["fork", "shrink", "permute"])
def test_draft_select_consistent(model, continuation, ancestors):
    testing.assert_select_consistent(Paired(feature_draft(model)), PROMPT, continuation, torch.tensor(ancestors), ATOL)


@pytest.mark.parametrize("kept", [0, 3])
def test_draft_truncate_consistent(model, continuation, kept):
    testing.assert_truncate_consistent(Paired(feature_draft(model)), PROMPT, continuation, kept, ATOL)


def test_drafted_positions_are_the_training_unroll_and_rereading_replaces_them(model, continuation):
    """Drafting s tokens past the target gives block position s of `FeatureDraft.unroll`; after
    the target reads them, the next extend equals the draft built from true features only."""
    draft = feature_draft(model)
    steps = 3
    full = torch.cat([torch.tensor([PROMPT] * 2), continuation], 1)
    # [B, n - 1, D] outputs of the unroll, one per block position
    unrolled = draft.model.unroll(full, full_features(model, full, (1,))[:, :-1], steps)
    target_rows, _ = draft.target.open(PROMPT, 2)
    rows, _ = draft.open(PROMPT, 2)
    verified = len(PROMPT) - 1
    for s in range(1, steps + 1):
        logits = rows.extend(continuation[:, s - 1 : s])[:, 0]
        expected = draft.model.logits(unrolled[s - 1][:, verified + s - 1])
        assert (logits - expected).abs().max() < ATOL, f"block position {s}"
    # the predicted positions differ from the true-feature ones, so the re-read below is needed
    assert (draft.model.logits(unrolled[1][:, verified + 1]) - draft.model.logits(unrolled[0][:, verified + 1])).abs().max() > 0.1
    target_rows.extend(continuation[:, :steps])
    # [B, 2, V]: the first token reads a true feature (block position 1), the second its output
    logits = rows.extend(continuation[:, steps : steps + 2])
    assert (logits[:, 0] - draft.model.logits(unrolled[0][:, verified + steps])).abs().max() < ATOL
    assert (logits[:, 1] - draft.model.logits(unrolled[1][:, verified + steps + 1])).abs().max() < ATOL


def test_draft_refuses_rows_it_cannot_pair_with(model, continuation):
    draft = feature_draft(model)
    with pytest.raises(ValueError, match="open the target first"):
        draft.open(PROMPT, 2)
    draft.target.open(PROMPT, 2)
    with pytest.raises(ValueError, match="open the target first"):
        draft.open(PROMPT, 3)
    target_rows, _ = draft.target.open(PROMPT, 2)
    rows, _ = draft.open(PROMPT, 2)
    target_rows.extend(continuation[:, :2])
    with pytest.raises(ValueError, match="different tokens"):
        rows.extend(continuation[:, 1:3])
    copy = HFLanguageModel(model, draft.tokenizer, kv_cache="copy")
    with pytest.raises(ValueError, match="paged"):
        FeatureDraftLM(copy, draft.model)
    # any other backend (vLLM, toy) keeps no hidden states for the draft
    with pytest.raises(ValueError, match="only the hf backend"):
        FeatureDraftLM(ToyLM.random(4, seed=0), draft.model)


def test_saved_draft_loads_to_its_fp16_weights(model, tmp_path):
    draft = feature_draft(model, (0, 1)).model
    draft.save(tmp_path)
    loaded = load_feature_draft(model, tmp_path)
    assert loaded.feature_layers == (0, 1)
    for name, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.half().float()), name
    narrower = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="hidden_size"):
        load_feature_draft(narrower, tmp_path)


def two_token_distributions(draft: FeatureDraftLM) -> tuple[dict, dict]:
    """p_T and the draft's own q over completions of at most 2 tokens, enumerated: q(x2 | x1)
    drafted past the target (its own predicted feature), as sd draws its second token."""
    vocab = draft.vocabulary.size
    target_rows, first = draft.target.open(PROMPT, vocab)
    rows, q_first = draft.open(PROMPT, vocab)
    x1 = torch.arange(vocab)[:, None]
    q_second = torch.softmax(rows.extend(x1)[:, 0].double(), -1)
    p_second = torch.softmax(target_rows.extend(x1)[:, 0].double(), -1)
    result = []
    for one, two in ((torch.softmax(first.double(), -1), p_second), (torch.softmax(q_first.double(), -1), q_second)):
        exact = {(EOS,): float(one[EOS])}
        exact.update({(a, b): float(one[a] * two[a, b]) for a in range(1, vocab) for b in range(vocab)})
        result.append(exact)
    return result[0], result[1]


def test_exact_speculative_decoding_with_the_feature_draft_matches_p_t():
    model = tiny_llama(vocab=8, seed=2)
    draft = feature_draft(model)
    exact, drafted = two_token_distributions(draft)
    # the draft alone is far from the target (TV 0.65), so matching p_T is no accident
    assert total_variation(drafted, exact) > 0.4
    n = 1500
    program = speculative.program(draft.target, draft, draft_len=2)
    samples = [tuple(program.run(PROMPT, Schedule(1, max_tokens=2), seed=s).tokens) for s in range(n)]
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


def test_exact_speculative_decoding_rereads_over_many_cycles(model):
    """A long sd run (rejections, truncations, re-reads) keeps draft and target rows paired:
    every extend checks that the draft's tokens are the target's where it reads features."""
    draft = feature_draft(model)
    result = speculative.program(draft.target, draft, draft_len=3).run(PROMPT, Schedule(1, max_tokens=40), seed=0)
    assert len(result.cycles) >= 5
    assert 0 < sum(c.accepted for c in result.cycles) < 3 * len(result.cycles)


def test_smc_sd_runs_with_the_feature_draft(model):
    draft = feature_draft(model)
    result = smc_speculative.program(draft.target, draft, draft_len=3).run(PROMPT, Schedule(4, max_tokens=16), seed=0)
    assert result.resamples > 0
    assert all(len(p) <= 16 for p in result.particles)
    assert torch.isfinite(result.log_weights).any()


@pytest.mark.parametrize("layers", [(1,), (0, 1)], ids=["last", "fused"])
def test_training_sees_what_the_backend_drafts(model, layers):
    """The recipe's data and unrolled loss and the draft benchmark's engine-order measurement
    through the backend give the same acceptance at every block position, on the same target
    samples: the training features, positions and unroll are the ones drafting uses."""
    draft = feature_draft(model, layers)
    generator = torch.Generator().manual_seed(3)
    steps, pooled, samples = 3, [[], [], []], []
    for prompt in ([3, 1, 4, 1, 5], [2, 7, 1, 8]):
        tokens, p = draft_quality.sample_continuation(draft.target, prompt, 10, generator)
        samples.append((prompt + tokens, len(prompt)))
        for k in range(1, steps + 1):
            pooled[k - 1] += draft_quality.block_acceptance(draft.target, draft, prompt, tokens, p, k)
    _, acceptance = unrolled_loss(draft.model, teacher_features(model, samples, layers), steps)
    for k in range(steps):
        assert acceptance[k].item() == pytest.approx(sum(pooled[k]) / len(pooled[k]), abs=1e-4), f"block position {k + 1}"


def test_training_raises_acceptance_at_every_block_position():
    """On a tiny target's own samples, the recipe raises held-back acceptance (1 - TV from the
    target) at block positions 1 and 2 by far more than its noise."""
    target = tiny_llama(vocab=32, seed=11, init=0.3)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(160):
        tokens = torch.randint(1, 32, (1, 4), generator=generator)
        with torch.no_grad():
            for _ in range(12):
                p = torch.softmax(target(input_ids=tokens).logits[0, -1], -1)
                tokens = torch.cat([tokens, torch.multinomial(p, 1, generator=generator)[None]], 1)
        samples.append((tokens[0].tolist(), 4))
    data = teacher_features(target, samples, (1,))
    torch.manual_seed(0)
    draft = FeatureDraft.from_target(target, (1,), init_layer=1)
    # 16 held-back replies of 12 tokens: ~180 positions per block position
    before = held_back_acceptance(draft, data[-16:], 2, 16)
    with open(os.devnull, "w") as quiet:
        train(draft, data[:-16], epochs=20, batch=8, lr=1e-2, steps=2, seed=0, check_every=10**9, log=quiet)
    after = held_back_acceptance(draft, data[-16:], 2, 16)
    assert after[0] > before[0] + 0.07
    assert after[1] > before[1] + 0.07


def test_the_shipped_feature_draft_loads_over_the_default_target():
    with pytest.raises(ValueError, match="pass it"):
        named_draft("feature")
    target = HFLanguageModel.default()
    draft = named_draft("feature", target=target)
    assert draft.model.feature_layers == (target.model.config.num_hidden_layers - 1,)
    prompt = [1, 2, 3, 4]
    target_rows, _ = target.open(prompt, 2)
    rows, first = draft.open(prompt, 2)
    # [2, 2, V]: the second column past the target's features, on the draft's own output
    logits = rows.extend(torch.tensor([[5, 6], [7, 8]]))
    testing.assert_logits_valid(torch.cat([first[None, None].expand(2, 1, -1), logits], 1), "the shipped feature draft")
    assert target_rows.features.shape == (2, len(prompt), target.model.config.hidden_size)
