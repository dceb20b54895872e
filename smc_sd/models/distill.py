"""Distil the default draft from SmolLM2-135M-Instruct: `python -m smc_sd.models.distill`.

The recipe, every step seeded and offline (56 minutes on 2 CPU cores with bf16 matrix units):
1. Data. `instruction_prompts` builds distinct chat prompts (templates over word lists and
   standard-library docstrings; the held-out prompts in benchmarks/prompts/heldout.txt are
   excluded). The target (bf16 copy) samples a reply to each at T = 1; only the token ids are
   kept, plus a running token mass m = sum_t p_t [V] over all reply positions t.
2. Vocabulary. S = the V_S tokens of largest mass m (EOS always included).
3. Student. `build_student`: the target's frozen embedding, `len(init_layers)` decoder layers
   copied from the target's layers `init_layers`, its final norm, and a head over S initialised
   with the embedding rows of S.
4. Loss. Forward KL from the target's full next-token distribution p_t, computed online by the
   target at every reply position of the batch, to the student's q_t (softmax over S):

       loss_t = - sum_{v in S} p_t(v) log q_t(v)   (= KL(p_t || q_t) + const; q_t = 0 off S),

   averaged over reply positions (the positions the draft is asked about). AdamW, linear
   warm-up then cosine decay, gradient norm clipped at 1; forwards in bf16 autocast.
   Then a shorter second phase (its own warm-up and decay, a lower peak rate) minimises the
   quantity the draft is judged by, TV(p_t, q_t) = 1 - sum_v min(p_t(v), q_t(v)) (q_t = 0 off S):
   its gradient only pushes mass onto the tokens where q_t < p_t (and is blind to how q_t spreads
   over the rest), so it is a poor loss from a random start but a good finish once q_t is close
   (in a trial, 80 steps of it raised held-back acceptance by 0.011 where 80 more steps of
   forward KL raised it by 0.001).
5. Output: int8 weights (fp16 scales per group of 16) and config in smc_sd/models/smollm2_draft
   (see `smc_sd.models.draft`).

Progress (loss, and the acceptance sum_v min(p_t, q_t) = 1 - TV(p_t, q_t) on a slice of samples
kept out of the optimiser) goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import pathlib
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from smc_sd.models.chat import chat_prompt
from smc_sd.models.draft import DRAFT_DIR, build_student, save_draft
from smc_sd.models.instructions import instruction_prompts
from smc_sd.models.smollm2 import default_model_dir

HELDOUT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "heldout.txt"
# a sample: (prompt + reply token ids, index of the first reply token)
Sample = tuple[list[int], int]


class MassRecorder(LogitsProcessor):
    """Adds each unfinished row's next-token distribution to `mass` during `generate`."""

    def __init__(self, prompt_len: int, eos: int, mass: torch.Tensor):
        self.prompt_len, self.eos, self.mass = prompt_len, eos, mass

    def __call__(self, input_ids, scores):
        live = ~(input_ids[:, self.prompt_len:] == self.eos).any(dim=-1)
        # [live rows, V]
        self.mass += torch.softmax(scores[live].float(), dim=-1).sum(dim=0).double()
        return scores


def sample_replies(model, tokenizer, prompts, batch: int, max_new_tokens: int, seed: int) -> dict:
    """The target's replies at T = 1 to every prompt, and their token mass.

    Prompts are generated in batches of similar length (less padding).

    Returns:
        {"samples": list of Sample, "mass": [V] float64 sum of p_t over every reply position}.
    """
    eos = tokenizer.eos_token_id
    mass = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    encoded = sorted((chat_prompt(tokenizer, p) for p in prompts), key=len)
    samples: list[Sample] = []
    started = time.perf_counter()
    for first in range(0, len(encoded), batch):
        chunk = encoded[first:first + batch]
        width = max(map(len, chunk))
        # [b, width] left-padded prompts and their attention mask
        input_ids = torch.tensor([[eos] * (width - len(e)) + e for e in chunk])
        attention = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in chunk])
        # transformers' sampler draws from the global generator: seed it per batch
        torch.manual_seed(seed * 1_000_003 + first)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=eos,
                logits_processor=[MassRecorder(width, eos, mass)],
            )
        for prompt, reply in zip(chunk, out[:, width:].tolist()):
            n = reply.index(eos) + 1 if eos in reply else len(reply)
            samples.append((prompt + reply[:n], len(prompt)))
        positions = sum(len(tokens) - start for tokens, start in samples)
        print(f"data: {len(samples)}/{len(encoded)} prompts, {positions} reply positions, "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"samples": samples, "mass": mass}


def choose_vocabulary(mass: torch.Tensor, size: int, eos: int) -> torch.Tensor:
    """The `size` token ids of largest mass, EOS forced in; sorted [size] int64."""
    order = mass.argsort(descending=True)
    chosen = order[:size]
    if eos not in chosen.tolist():
        chosen[-1] = eos
    return chosen.sort().values


def init_student(target, vocab_ids: torch.Tensor, init_layers: list[int]):
    """`build_student`, with weights copied from the target; the embedding is frozen."""
    student = build_student(target.config, len(init_layers), vocab_ids)
    student.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    student.model.embed_tokens.weight.requires_grad_(False)
    for mine, theirs in zip(student.model.layers, init_layers):
        mine.load_state_dict(target.model.layers[theirs].state_dict())
    student.model.norm.load_state_dict(target.model.norm.state_dict())
    student.lm_head.weight.data.copy_(target.model.embed_tokens.weight.data[vocab_ids])
    return student


def reply_hidden(model, tokens: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[P, hidden] final hidden states of `model` (a CausalLM) at positions (rows, cols)."""
    return model.model(input_ids=tokens).last_hidden_state[rows, cols]


def batch_loss(student, teacher, samples: list[Sample], vocab_ids: torch.Tensor, eos: int):
    """Forward KL from the teacher's full distributions to the student's, and 1 - TV, for a batch.

    Position t of a sample predicts token t + 1, so the reply tokens are predicted at positions
    start - 1 ... len - 2.

    Returns:
        (cross_entropy, acceptance): scalar tensors with gradients, means over the batch's reply
        positions; cross_entropy = -sum_{v in S} p log q, acceptance = sum_v min(p, q) with q = 0
        off S.
    """
    width = max(len(tokens) for tokens, _ in samples)
    # [b, width] right-padded: causal attention keeps padding out of earlier positions
    tokens = torch.tensor([t + [eos] * (width - len(t)) for t, _ in samples])
    rows = torch.cat([torch.full((len(t) - s,), b) for b, (t, s) in enumerate(samples)])
    cols = torch.cat([torch.arange(s - 1, len(t) - 1) for t, s in samples])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            # [P, V] the target's next-token distributions, restricted to S
            p = torch.softmax(teacher.lm_head(reply_hidden(teacher, tokens, rows, cols)).float(), dim=-1)
            p_s = p[:, vocab_ids]
        # [P, V_S]
        logq = torch.log_softmax(student.lm_head(reply_hidden(student, tokens, rows, cols)).float(), dim=-1)
    cross_entropy = -(p_s * logq).sum(-1).mean()
    acceptance = torch.minimum(p_s, logq.exp()).sum(-1).mean()
    return cross_entropy, acceptance


def hold_back(samples: list) -> tuple[list, list]:
    """(training samples, the last 2% held back for the acceptance figures)."""
    split = max(1, len(samples) // 50)
    return samples[:-split], samples[-split:]


def warmup_cosine_adamw(model, lr: float, steps: int):
    """AdamW (no weight decay) over the trainable parameters, with a linear warm-up over the first
    5% of `steps` and a cosine decay to 0 at `steps`: (optimiser, its LambdaLR schedule)."""
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    return optimiser, schedule


def train(student, teacher, samples, vocab_ids, eos, epochs, batch, lr, seed, objective="kl", log_every=25):
    """AdamW over shuffled batches of samples (the last 2% held back for the acceptance figure).

    objective: "kl" minimises the cross-entropy (forward KL), "tv" minimises 1 - acceptance =
    TV(p, q) itself.
    """
    if objective not in ("kl", "tv"):
        raise ValueError(f"objective must be 'kl' or 'tv', not {objective!r}")
    generator = torch.Generator().manual_seed(seed)
    train_set, check_set = hold_back(samples)
    steps = epochs * math.ceil(len(train_set) / batch)
    optimiser, schedule = warmup_cosine_adamw(student, lr, steps)

    def check() -> float:
        with torch.no_grad():
            return sum(batch_loss(student, teacher, check_set[i:i + batch], vocab_ids, eos)[1].item()
                       for i in range(0, len(check_set), batch)) / math.ceil(len(check_set) / batch)

    print(f"train: {steps} steps, check acceptance before training {check():.3f}", file=sys.stderr, flush=True)
    started, step = time.perf_counter(), 0
    for epoch in range(epochs):
        order = torch.randperm(len(train_set), generator=generator).tolist()
        for first in range(0, len(order), batch):
            cross_entropy, acceptance = batch_loss(
                student, teacher, [train_set[i] for i in order[first:first + batch]], vocab_ids, eos
            )
            loss = cross_entropy if objective == "kl" else 1 - acceptance
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(optimiser.param_groups[0]["params"], 1.0)
            optimiser.step()
            schedule.step()
            step += 1
            if step % log_every == 0 or step == steps:
                checked = f" check acceptance {check():.3f}" if step % (4 * log_every) == 0 or step == steps else ""
                print(f"train {objective}: epoch {epoch} step {step}/{steps} loss {loss.item():.3f} "
                      f"acceptance {acceptance.item():.3f}{checked} {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="distil the default draft from SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=3072, help="generated training prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="reply length cap")
    parser.add_argument("--gen-batch", type=int, default=128, help="prompts per generate call")
    parser.add_argument("--draft-vocab", type=int, default=16384, help="V_S, the draft's output tokens")
    parser.add_argument("--init-layers", default="0,1,2,3,4,29", help="target layers the student starts from")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="replies per optimiser step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tv-epochs", type=int, default=1, help="epochs of the second phase, minimising TV")
    parser.add_argument("--tv-lr", type=float, default=2e-4, help="peak learning rate of the TV phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "smc-sd" / "distill",
                        help="where the sampled replies are kept (reused when present)")
    parser.add_argument("--out", type=pathlib.Path, default=DRAFT_DIR)
    return parser


def frozen_target():
    """The default model in fp32, in eval mode with no gradients, and its tokenizer (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target_dir = default_model_dir()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True).eval()
    target.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(target_dir, local_files_only=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    target, tokenizer = frozen_target()
    eos = tokenizer.eos_token_id
    # the replies depend on the batching too (each batch is seeded by its first prompt's index)
    data_file = args.work / f"replies-p{args.prompts}-m{args.max_new_tokens}-b{args.gen_batch}-s{args.seed}.pt"
    # the teacher: a bf16 copy of the target (bf16 matrix units make it ~4x faster on CPU)
    teacher = copy.deepcopy(target).to(torch.bfloat16)
    if data_file.exists():
        data = torch.load(data_file)
    else:
        heldout = HELDOUT.read_text().splitlines()
        prompts = instruction_prompts(args.prompts, args.seed, exclude=heldout)
        data = sample_replies(teacher, tokenizer, prompts, args.gen_batch, args.max_new_tokens, args.seed)
        args.work.mkdir(parents=True, exist_ok=True)
        torch.save(data, data_file)
    vocab_ids = choose_vocabulary(data["mass"], args.draft_vocab, eos)
    covered = (data["mass"][vocab_ids].sum() / data["mass"].sum()).item()
    print(f"vocabulary: {len(vocab_ids)} tokens hold {covered:.4f} of the target's mass", file=sys.stderr)
    # shuffle once (seeded): the samples come sorted by prompt length, and the check slice is the tail
    order = torch.randperm(len(data["samples"]), generator=torch.Generator().manual_seed(args.seed)).tolist()
    samples = [data["samples"][i] for i in order]
    student = init_student(target, vocab_ids, [int(i) for i in args.init_layers.split(",")])
    del target
    train(student, teacher, samples, vocab_ids, eos, args.epochs, args.batch, args.lr, args.seed)
    if args.tv_epochs:
        # a new seed: the TV phase visits the samples in another order
        train(student, teacher, samples, vocab_ids, eos, args.tv_epochs, args.batch, args.tv_lr, args.seed + 1,
              objective="tv")
    save_draft(student, vocab_ids, args.out)
    print(f"saved the draft to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
