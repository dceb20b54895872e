"""Distil the default draft from SmolLM2-135M-Instruct: `python -m smc_sd.models.distill`.

The recipe, every step seeded:
1. Data. `instruction_prompts` builds distinct chat prompts offline (templates over word lists and
   standard-library docstrings; the held-out prompts in benchmarks/prompts/heldout.txt are
   excluded). The target samples a reply to each at T = 1; at every generated position t it keeps
   the top-k of its next-token distribution p_t (ids and log-probabilities) and adds the full p_t
   to a running token mass m = sum_t p_t [V].
2. Vocabulary. S = the V_S tokens of largest mass m (EOS always included).
3. Student. `build_student`: the target's frozen embedding, `len(init_layers)` decoder layers
   copied from the target's layers `init_layers`, its final norm, and a head over S initialised
   with the embedding rows of S.
4. Loss. Forward KL from the target's distribution to the student's, over the stored top-k:

       loss_t = - sum_{v in topk(p_t), v in S} p_t(v) log q_t(v),   q_t = softmax over S,

   averaged over generated positions (the target's own replies, the positions the draft will be
   asked about). AdamW, linear warm-up then cosine decay, gradient norm clipped at 1.
5. Output: fp16 weights and config in smc_sd/models/smollm2_draft (see `smc_sd.models.draft`).

Progress (loss, and sum_v min(p, q) over the top-k, a lower bound on 1 - TV, on a slice of
samples kept out of the optimiser) goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from smc_sd.backends.hf import chat_prompt
from smc_sd.models.draft import DRAFT_DIR, build_student, save_draft
from smc_sd.models.instructions import instruction_prompts
from smc_sd.models.smollm2 import default_model_dir

HELDOUT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "heldout.txt"


class TopKRecorder(LogitsProcessor):
    """Records the top-k of each unfinished row's next-token distribution during `generate`."""

    def __init__(self, prompt_len: int, eos: int, top_k: int, mass: torch.Tensor):
        self.prompt_len, self.eos, self.top_k, self.mass = prompt_len, eos, top_k, mass
        self.ids: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        # [B, V] float32 log p_t; rows that already emitted EOS add nothing to the mass
        logp = torch.log_softmax(scores.float(), dim=-1)
        live = ~(input_ids[:, self.prompt_len:] == self.eos).any(dim=-1)
        self.mass += logp[live].exp().sum(dim=0).double()
        top = logp.topk(self.top_k, dim=-1)
        self.ids.append(top.indices.to(torch.int32))
        self.logps.append(top.values.to(torch.float16))
        return scores


def collect(model, tokenizer, prompts, batch: int, max_new_tokens: int, top_k: int, seed: int) -> dict:
    """Target replies at T = 1 and their top-k next-token distributions.

    Returns:
        {"samples": list of (tokens list[int], start int, ids [n, k] int32, logp [n, k] fp16),
         "mass": [V] float64}. Row s of ids/logp is the target's distribution of reply token s,
         predicted at position start + s of tokens (start = prompt length - 1).
    """
    eos = tokenizer.eos_token_id
    mass = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    samples = []
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        encoded = [chat_prompt(tokenizer, p) for p in prompts[first:first + batch]]
        width = max(map(len, encoded))
        # [b, width] left-padded prompts and their attention mask
        input_ids = torch.tensor([[eos] * (width - len(e)) + e for e in encoded])
        attention = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        recorder = TopKRecorder(width, eos, top_k, mass)
        # transformers' sampler draws from the global generator: seed it per batch
        torch.manual_seed(seed * 1_000_003 + first)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=eos,
                logits_processor=[recorder],
            )
        # [b, steps]
        replies = out[:, width:]
        ids, logps = torch.stack(recorder.ids, 1), torch.stack(recorder.logps, 1)
        for row, prompt in enumerate(encoded):
            reply = replies[row].tolist()
            n = reply.index(eos) + 1 if eos in reply else len(reply)
            samples.append((prompt + reply[:n], len(prompt) - 1, ids[row, :n].clone(), logps[row, :n].clone()))
        done = first + len(encoded)
        tokens = sum(s[2].shape[0] for s in samples)
        print(f"data: {done}/{len(prompts)} prompts, {tokens} positions, {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)
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


def batch_loss(student, samples, compact: torch.Tensor, eos: int):
    """Forward KL over the stored top-k, and the top-k overlap sum min(p, q), for a batch.

    Args:
        samples: a list of samples as returned by `collect`.
        compact: [V] int64 map from token id to its index in S, -1 off S.

    Returns:
        (loss, overlap): scalar tensors, means over the batch's generated positions.
    """
    width = max(len(s[0]) for s in samples)
    # [b, width] right-padded: causal attention keeps padding out of earlier positions
    tokens = torch.tensor([s[0] + [eos] * (width - len(s[0])) for s in samples])
    # [b, width, V_S]
    logq = torch.log_softmax(student(input_ids=tokens).logits.float(), dim=-1)
    rows = torch.cat([torch.full((s[2].shape[0],), b) for b, s in enumerate(samples)])
    cols = torch.cat([torch.arange(s[1], s[1] + s[2].shape[0]) for s in samples])
    # [P, k] target top-k in S coordinates, and their probabilities (0 off S)
    ids = compact[torch.cat([s[2] for s in samples]).long()]
    p = torch.cat([s[3] for s in samples]).float().exp() * (ids >= 0)
    logq_k = logq[rows, cols].gather(-1, ids.clamp(min=0))
    loss = -(p * logq_k).sum(-1).mean()
    overlap = torch.minimum(p, logq_k.detach().exp()).sum(-1).mean()
    return loss, overlap


def train(student, samples, compact, eos, epochs, batch, lr, seed, log_every=10):
    """AdamW over shuffled batches of samples (last 5% held back for the overlap figure)."""
    generator = torch.Generator().manual_seed(seed)
    split = max(1, len(samples) // 20)
    train_set, check_set = samples[:-split], samples[-split:]
    steps = epochs * math.ceil(len(train_set) / batch)
    params = [p for p in student.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    started, step = time.perf_counter(), 0
    for epoch in range(epochs):
        order = torch.randperm(len(train_set), generator=generator).tolist()
        for first in range(0, len(order), batch):
            loss, overlap = batch_loss(student, [train_set[i] for i in order[first:first + batch]], compact, eos)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            schedule.step()
            step += 1
            if step % log_every == 0 or step == steps:
                with torch.no_grad():
                    _, check = batch_loss(student, check_set, compact, eos)
                print(f"train: epoch {epoch} step {step}/{steps} loss {loss.item():.3f} overlap {overlap.item():.3f} "
                      f"check overlap {check.item():.3f} {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="distil the default draft from SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=512, help="generated training prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="reply length cap")
    parser.add_argument("--gen-batch", type=int, default=64, help="prompts per generate call")
    parser.add_argument("--top-k", type=int, default=64, help="target probabilities kept per position")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="V_S, the draft's output tokens")
    parser.add_argument("--init-layers", default="0,1,2", help="target layers the student starts from")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="replies per optimiser step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "smc-sd" / "distill",
                        help="where the collected data is kept (reused when present)")
    parser.add_argument("--out", type=pathlib.Path, default=DRAFT_DIR)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(args.seed)
    target_dir = default_model_dir()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    eos = tokenizer.eos_token_id
    data_file = args.work / f"data-p{args.prompts}-m{args.max_new_tokens}-k{args.top_k}-s{args.seed}.pt"
    if data_file.exists():
        data = torch.load(data_file)
    else:
        heldout = HELDOUT.read_text().splitlines()
        prompts = instruction_prompts(args.prompts, args.seed, exclude=heldout)
        data = collect(target, tokenizer, prompts, args.gen_batch, args.max_new_tokens, args.top_k, args.seed)
        args.work.mkdir(parents=True, exist_ok=True)
        torch.save(data, data_file)
    vocab_ids = choose_vocabulary(data["mass"], args.draft_vocab, eos)
    covered = (data["mass"][vocab_ids].sum() / data["mass"].sum()).item()
    print(f"vocabulary: {len(vocab_ids)} tokens hold {covered:.4f} of the target's mass", file=sys.stderr)
    # [V] token id -> index in S, -1 off S
    compact = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    compact[vocab_ids] = torch.arange(len(vocab_ids))
    student = init_student(target, vocab_ids, [int(i) for i in args.init_layers.split(",")])
    del target
    train(student, data["samples"], compact, eos, args.epochs, args.batch, args.lr, args.seed)
    save_draft(student, vocab_ids, args.out)
    print(f"saved the draft to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
