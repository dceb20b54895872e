"""Train the feature-reading draft for SmolLM2-135M-Instruct: `python -m smc_sd.models.feature_distill`.

The recipe, every step seeded and offline:
1. Data. The target (fp32) samples a reply at T = 1 to each instruction prompt of
   `instruction_prompts` (the held-out prompts excluded), as `smc_sd.models.distill` does
   (`sample_replies`). One teacher-forced target forward per batch of replies then records, at
   every position t, the features F_t (outputs of `--feature-layers`) and the last layer's output
   y_t, from which the target's full next-token distribution is p_t = softmax(head(norm(y_t))).
   Both are kept in fp16.
2. Draft. `FeatureDraft.from_target`: fc = [I, I], the decoder layer a copy of the target's last.
3. Loss, with the training-time test: `FeatureDraft.unroll` computes the draft at block
   positions s = 1..S (s = 1 reads the true features; s > 1 its own outputs for the s - 1 positions
   past the verified one). Block position s at draft position t predicts x_{t+2}; its loss is the
   forward KL from the target there,

       loss_s = mean_t [ - sum_v p_{t+1}(v) log q^(s)_t(v) ]   (= KL(p || q) + const),

   over the positions t the engines draft at block position s (the verified position t - s + 1
   at or after the prompt's last token), and the loss is mean_s loss_s.
   AdamW, linear warm-up then cosine decay, gradient norm clipped at 1. An optional second phase
   (`--tv-epochs`) minimises mean_s TV(p, q^(s)) = 1 - acceptance, as the distilled draft's
   recipe does.
4. Output: `FeatureDraft.save` (fp16 weights of fuse, fc and the layer; config) in `--out`.

Progress lines on stderr give the loss, the batch's acceptance and, every few steps, the
acceptance sum_v min(p, q) = 1 - TV by block position on replies held back from the optimiser.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from dataclasses import dataclass

import torch

from smc_sd.models.distill import HELDOUT, frozen_target, hold_back, sample_replies, warmup_cosine_adamw
from smc_sd.models.feature_draft import FEATURE_DRAFT_DIR, FeatureDraft, capture_layer_outputs
from smc_sd.models.instructions import instruction_prompts


@dataclass
class FeatureSample:
    """One reply and the target's view of it.

    Attributes:
        tokens: [n] int64 prompt then reply.
        start: index of the first reply token.
        features: [n - 1, m·D] float16 F_t at t = 0 .. n - 2.
        final: [n - 1, D] float16 y_t, the last layer's output, at t = 0 .. n - 2.
    """

    tokens: torch.Tensor
    start: int
    features: torch.Tensor
    final: torch.Tensor


def teacher_features(target, samples: list[tuple[list[int], int]], feature_layers: tuple[int, ...], batch: int = 16) -> list[FeatureSample]:
    """One teacher-forced forward of the target per batch of samples, recording F and y.

    Args:
        target: a transformers LlamaForCausalLM.
        samples: (prompt + reply token ids, index of the first reply token).
    """
    last = target.config.num_hidden_layers - 1
    layers = tuple(sorted(set(feature_layers) | {last}))
    width = target.config.hidden_size
    # column slices of the captured [.., len(layers)·D] for F and for y
    columns = [slice(layers.index(i) * width, (layers.index(i) + 1) * width) for i in feature_layers]
    final_columns = slice(layers.index(last) * width, (layers.index(last) + 1) * width)
    out = []
    for first in range(0, len(samples), batch):
        chunk = samples[first:first + batch]
        widest = max(len(tokens) for tokens, _ in chunk)
        # [b, widest] right-padded (causal attention keeps padding out of earlier positions)
        ids = torch.tensor([tokens + [tokens[-1]] * (widest - len(tokens)) for tokens, _ in chunk])
        with torch.inference_mode(), capture_layer_outputs(target, layers) as captured:
            target.model(input_ids=ids.to(target.device))
        for row, (tokens, start) in enumerate(chunk):
            n = len(tokens)
            outputs = captured[0][row, : n - 1].cpu()
            out.append(FeatureSample(
                torch.tensor(tokens), start,
                torch.cat([outputs[:, c] for c in columns], -1).half(), outputs[:, final_columns].half(),
            ))
    return out


def unrolled_loss(draft: FeatureDraft, samples: list[FeatureSample], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy from p and acceptance sum_v min(p, q) at block positions 1..steps.

    Returns:
        ([S] cross-entropy, [S] acceptance), means over each block position's scored positions;
        the cross-entropy carries gradients, the acceptance too (for the TV phase).
    """
    widest = max(len(s.tokens) for s in samples)
    # [b, n] tokens, [b, n - 1, m·D] features, [b, n - 1, D] last-layer outputs, right-padded
    tokens = torch.stack([torch.nn.functional.pad(s.tokens, (0, widest - len(s.tokens))) for s in samples])
    features = torch.stack([torch.nn.functional.pad(s.features.float(), (0, 0, 0, widest - len(s.tokens))) for s in samples])
    final = torch.stack([torch.nn.functional.pad(s.final.float(), (0, 0, 0, widest - len(s.tokens))) for s in samples])
    outputs = draft.unroll(tokens, features, steps)
    t = torch.arange(widest - 1)[None]
    lengths = torch.tensor([len(s.tokens) for s in samples])[:, None]
    starts = torch.tensor([s.start for s in samples])[:, None]
    cross_entropy, acceptance = [], []
    for s, out in enumerate(outputs, start=1):
        # draft position t predicts x_{t+2}, a token that exists, s - 1 steps past the verified
        # position t - s + 1, which the engines never place before the prompt's last token
        scored = (t - s + 1 >= starts - 1) & (t + 2 <= lengths - 1)
        rows, cols = scored.nonzero(as_tuple=True)
        with torch.no_grad():
            # [P, V] the target's distributions p_{t+1}
            p = torch.softmax(draft.logits(final[rows, cols + 1]), -1)
        # [P, V]
        logq = torch.log_softmax(draft.logits(out[rows, cols]), -1)
        cross_entropy.append(-(p * logq).sum(-1).mean())
        acceptance.append(torch.minimum(p, logq.exp()).sum(-1).mean())
    return torch.stack(cross_entropy), torch.stack(acceptance)


def held_back_acceptance(draft: FeatureDraft, samples: list[FeatureSample], steps: int, batch: int) -> list[float]:
    """Acceptance at block positions 1..steps on `samples`, averaged over batches."""
    totals = torch.zeros(steps)
    batches = range(0, len(samples), batch)
    with torch.no_grad():
        for first in batches:
            totals += unrolled_loss(draft, samples[first:first + batch], steps)[1]
    return (totals / len(batches)).tolist()


def train(draft: FeatureDraft, samples: list[FeatureSample], epochs: int, batch: int, lr: float, steps: int,
          seed: int, objective: str = "kl", check_every: int = 20, log=sys.stderr) -> list[float]:
    """AdamW over shuffled batches (the last 2% of samples held back for the acceptance lines).

    objective: "kl" minimises mean_s cross-entropy (forward KL), "tv" mean_s (1 - acceptance).

    Returns:
        The held-back acceptance by block position after training.
    """
    if objective not in ("kl", "tv"):
        raise ValueError(f"objective must be 'kl' or 'tv', not {objective!r}")
    generator = torch.Generator().manual_seed(seed)
    train_set, check_set = hold_back(samples)
    total = epochs * math.ceil(len(train_set) / batch)
    optimiser, schedule = warmup_cosine_adamw(draft, lr, total)

    def check() -> str:
        return " ".join(f"{a:.3f}" for a in held_back_acceptance(draft, check_set, steps, batch))

    print(f"train {objective}: {total} steps, held-back acceptance by block position before: {check()}", file=log, flush=True)
    started, step = time.perf_counter(), 0
    for epoch in range(epochs):
        order = torch.randperm(len(train_set), generator=generator).tolist()
        for first in range(0, len(order), batch):
            cross_entropy, acceptance = unrolled_loss(draft, [train_set[i] for i in order[first:first + batch]], steps)
            loss = cross_entropy.mean() if objective == "kl" else 1 - acceptance.mean()
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(optimiser.param_groups[0]["params"], 1.0)
            optimiser.step()
            schedule.step()
            step += 1
            if step % check_every == 0 or step == total:
                print(f"train {objective}: epoch {epoch} step {step}/{total} loss {loss.item():.3f} "
                      f"acceptance {' '.join(f'{a:.3f}' for a in acceptance.tolist())} held back {check()} "
                      f"{time.perf_counter() - started:.0f} s", file=log, flush=True)
    return held_back_acceptance(draft, check_set, steps, batch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="train the feature-reading draft of SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=256, help="generated training prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="reply length cap")
    parser.add_argument("--gen-batch", type=int, default=64, help="prompts per generate call")
    parser.add_argument("--feature-layers", default="29", help="target decoder layers whose outputs the draft reads")
    parser.add_argument("--steps", type=int, default=3, help="S, block positions unrolled in training")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="replies per optimiser step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tv-epochs", type=int, default=0, help="epochs of a second phase minimising TV")
    parser.add_argument("--tv-lr", type=float, default=2e-4, help="peak learning rate of the TV phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "smc-sd" / "feature-distill",
                        help="where the sampled replies and their features are kept (reused when present)")
    parser.add_argument("--out", type=pathlib.Path, default=FEATURE_DRAFT_DIR)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    feature_layers = tuple(int(i) for i in args.feature_layers.split(","))
    target, tokenizer = frozen_target()
    layers_key = "-".join(map(str, feature_layers))
    data_file = args.work / f"features-p{args.prompts}-m{args.max_new_tokens}-b{args.gen_batch}-l{layers_key}-s{args.seed}.pt"
    if data_file.exists():
        samples = torch.load(data_file, weights_only=False)
    else:
        prompts = instruction_prompts(args.prompts, args.seed, exclude=HELDOUT.read_text().splitlines())
        replies = sample_replies(target, tokenizer, prompts, args.gen_batch, args.max_new_tokens, args.seed)["samples"]
        started = time.perf_counter()
        samples = teacher_features(target, replies, feature_layers)
        print(f"features: {sum(len(s.tokens) - s.start for s in samples)} reply positions, "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        args.work.mkdir(parents=True, exist_ok=True)
        torch.save(samples, data_file)
    # shuffle once (seeded): the samples come sorted by prompt length, and the check slice is the tail
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(args.seed)).tolist()
    samples = [samples[i] for i in order]
    draft = FeatureDraft.from_target(target, feature_layers, init_layer=target.config.num_hidden_layers - 1)
    train(draft, samples, args.epochs, args.batch, args.lr, args.steps, args.seed)
    if args.tv_epochs:
        train(draft, samples, args.tv_epochs, args.batch, args.tv_lr, args.steps, args.seed + 1, objective="tv")
    draft.save(args.out)
    print(f"saved the draft to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
