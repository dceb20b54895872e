"""The distillation recipe's loss and training loop, on tiny random Llamas built in code."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from smc_sd.models.distill import batch_loss, choose_vocabulary, init_student, train

VOCAB, EOS = 48, 0
CONFIG = LlamaConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
)


def tiny_pair(draft_vocab: int):
    """(teacher, student heading draft_vocab tokens picked by a random mass, their ids, 40 samples)."""
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(CONFIG).eval().requires_grad_(False)
    # a random Llama's next-token distributions are near uniform: sharpen them
    teacher.model.norm.weight.mul_(30)
    generator = torch.Generator().manual_seed(1)
    # (tokens, first reply index): a 4-token prompt and 6 to 11 reply tokens
    samples = [(torch.randint(1, VOCAB, (4 + 6 + i % 6,), generator=generator).tolist(), 4) for i in range(40)]
    mass = torch.rand(VOCAB, generator=generator, dtype=torch.float64)
    vocab_ids = choose_vocabulary(mass, draft_vocab, EOS)
    student = init_student(teacher, vocab_ids, [1])
    # a fresh head: the student starts far from the teacher
    student.lm_head.weight.data.normal_(0, 0.02, generator=generator)
    return teacher, student, vocab_ids, samples


def test_acceptance_is_one_minus_tv_and_the_loss_is_the_cross_entropy():
    teacher, student, vocab_ids, samples = tiny_pair(32)
    batch = samples[:3]
    cross_entropy, acceptance = batch_loss(student, teacher, batch, vocab_ids, EOS)
    tv, ce, positions = 0.0, 0.0, 0
    with torch.no_grad():
        for tokens, start in batch:
            ids = torch.tensor([tokens])
            # [reply positions, V] and [reply positions, V_S]
            p = torch.softmax(teacher(ids).logits[0, start - 1:-1], -1)
            logq = torch.log_softmax(student(ids).logits[0, start - 1:-1], -1)
            q = torch.zeros_like(p)
            q[:, vocab_ids] = logq.exp()
            tv += 0.5 * (p - q).abs().sum().item()
            ce -= (p[:, vocab_ids] * logq).sum().item()
            positions += len(tokens) - start
    # batch_loss runs its forwards in bf16 autocast: agreement to bf16 precision
    assert abs(acceptance.item() - (1 - tv / positions)) < 0.02
    assert abs(cross_entropy.item() - ce / positions) < 0.05


def check_acceptance(student, teacher, samples, vocab_ids) -> float:
    with torch.no_grad():
        return batch_loss(student, teacher, samples, vocab_ids, EOS)[1].item()


def test_each_objective_raises_acceptance_on_its_training_samples():
    """A few epochs of either loss must move q towards p: 1 - TV on the samples goes up."""
    for objective in ("kl", "tv"):
        teacher, student, vocab_ids, samples = tiny_pair(40)
        before = check_acceptance(student, teacher, samples, vocab_ids)
        train(student, teacher, samples, vocab_ids, EOS, epochs=4, batch=8, lr=3e-3, seed=0, objective=objective)
        after = check_acceptance(student, teacher, samples, vocab_ids)
        assert after > before + 0.05, (objective, before, after)
