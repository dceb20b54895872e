"""How well and how cheaply a draft predicts the default target, on prompts it was not trained on.

For each prompt (one instruction per line of --prompts, wrapped in the chat template) the target
samples a continuation x_P, x_{P+1}, ... at T = 1 (seeded). At block position k = 1..K and every
continuation position j >= k, the draft is asked for x_{P+j} as the engines ask it: the target has
read everything up to x_{P+j-k-1} (the last verified token), the draft reads the emitted
x_{P+j-k} and the k - 1 tokens it drafted since (a feature draft on its own predicted features
there), and

    acceptance = 1 - TV(p, q) = sum_v min(p(v), q(v)),   p, q at T = 1,

the probability that exact speculative decoding accepts a drafted token there. A draft that reads
no features sees only tokens, so its q does not depend on k: every block position is the same
measurement, made once (`reads_features` false).

cost_ratio = draft time per drafted token / target time per token at batch 1, in the same run,
measured alternately along the same continuations: a draft cycle as the engines run it (read the
last drafted and the bonus token, then K - 1 single tokens; a feature draft also re-reads the K - 1
positions the target verified since), divided by K, against the target's one-token `extend`.

Usage: python benchmarks/draft_quality.py [--prompts FILE] [--max-tokens 64] [--draft-len 4] [--draft NAME] [--json]
"""

from __future__ import annotations

import argparse
import pathlib
import time

from _common import DRAFT_HELP, describe_draft, emit, environment, load_default_models

import torch

HELDOUT = pathlib.Path(__file__).resolve().parent / "prompts" / "heldout.txt"


def reads_features(draft) -> bool:
    from smc_sd.backends.feature_draft import FeatureDraftLM

    return isinstance(draft, FeatureDraftLM)


def sample_continuation(target, prompt: list[int], max_tokens: int, generator) -> tuple[list[int], torch.Tensor]:
    """The target's continuation at T = 1 (up to EOS or max_tokens) and its distributions.

    Returns:
        (tokens, p): M tokens and [M, V] float32 p(. | prompt, x_P .. x_{P+j-1}) for each j.
    """
    eos = target.vocabulary.eos_token_id
    rows, logits = target.open(prompt, 1)
    tokens, p = [], []
    while len(tokens) < max_tokens:
        p.append(torch.softmax(logits, -1))
        tokens.append(int(torch.multinomial(p[-1], 1, generator=generator)))
        if tokens[-1] == eos or len(tokens) == max_tokens:
            break
        logits = rows.extend(torch.tensor([[tokens[-1]]]))[0, -1]
    rows.close()
    return tokens, torch.stack(p)


def block_acceptance(target, draft, prompt: list[int], tokens: list[int], p: torch.Tensor, k: int) -> list[float]:
    """Acceptance at block position k for continuation positions j = k .. M - 1.

    The target rows the draft pairs with lag k tokens behind it: when the draft reads x_{P+j-1},
    the target has read x_P .. x_{P+j-k-1}, the last verified token.

    Args:
        tokens: the M continuation tokens; p: [M, V] the target's distributions before each.
    """
    target_rows, _ = target.open(prompt, 1)
    draft_rows, _ = draft.open(prompt, 1)
    accept = []
    for j in range(1, len(tokens)):
        if j - k - 1 >= 0:
            # the target verifies x_{P+j-k-1}
            target_rows.extend(torch.tensor([[tokens[j - k - 1]]]))
        # [V]: q of x_{P+j}
        q = torch.softmax(draft_rows.extend(torch.tensor([[tokens[j - 1]]]))[0, -1], -1)
        if j >= k:
            accept.append(torch.minimum(p[j], q).sum().item())
    target_rows.close()
    draft_rows.close()
    return accept


def cycle_costs(target, draft, prompt: list[int], tokens: list[int], draft_len: int) -> tuple[float, float, int, int]:
    """Seconds of draft cycles and of target one-token extends along the continuation, alternately.

    Returns:
        (draft seconds, target seconds, drafted tokens, target tokens).
    """
    timed_rows, _ = target.open(prompt, 1)
    # the rows a feature draft pairs with: they verify each block, as the engines' target does
    target_rows, _ = target.open(prompt, 1)
    draft_rows, _ = draft.open(prompt, 1)
    draft_s = target_s = 0.0
    drafted = timed = 0
    unseen = tokens[:1]
    for first in range(0, len(tokens) - draft_len - 1, draft_len + 1):
        block = tokens[first + 1 : first + 1 + draft_len]
        started = time.perf_counter()
        draft_rows.extend(torch.tensor([unseen]))
        for token in block[:-1]:
            draft_rows.extend(torch.tensor([[token]]))
        draft_s += time.perf_counter() - started
        drafted += draft_len
        for token in [tokens[first]] + block:
            started = time.perf_counter()
            timed_rows.extend(torch.tensor([[token]]))
            target_s += time.perf_counter() - started
            timed += 1
        # verify: the target reads the block's first token and its drafts; the bonus comes next
        target_rows.extend(torch.tensor([[tokens[first]] + block]))
        unseen = [block[-1], tokens[first + draft_len + 1]]
    for rows in (timed_rows, target_rows, draft_rows):
        rows.close()
    return draft_s, target_s, drafted, timed


def processor() -> str:
    """The CPU's model name, as lscpu names it."""
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=pathlib.Path, default=HELDOUT, help="one instruction per line")
    parser.add_argument("--limit", type=int, default=None, help="use only the first LIMIT prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="continuation tokens per prompt")
    parser.add_argument("--draft-len", type=int, default=4, help="K, block positions measured")
    parser.add_argument("--draft", default=None, help=DRAFT_HELP)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON object only")
    parser.add_argument("--no-write", action="store_true", help="write no results file")
    args = parser.parse_args(argv)

    from smc_sd.backends.hf import chat_prompt

    target, draft = load_default_models(args.draft)
    features = reads_features(draft)
    texts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()][: args.limit]
    generator = torch.Generator().manual_seed(args.seed)
    # [K] lists of acceptances, pooled over prompts
    by_position = [[] for _ in range(args.draft_len)]
    per_prompt, draft_s, target_s, drafted, timed = [], 0.0, 0.0, 0, 0
    for text in texts:
        prompt = chat_prompt(target.tokenizer, text)
        tokens, p = sample_continuation(target, prompt, args.max_tokens, generator)
        for k in range(1, args.draft_len + 1 if features else 2):
            accept = block_acceptance(target, draft, prompt, tokens, p, k)
            by_position[k - 1] += accept
            if k == 1 and accept:
                per_prompt.append(sum(accept) / len(accept))
        costs = cycle_costs(target, draft, prompt, tokens, args.draft_len)
        draft_s, target_s, drafted, timed = draft_s + costs[0], target_s + costs[1], drafted + costs[2], timed + costs[3]
    if not features:
        by_position = [by_position[0]] * args.draft_len
    acceptance = [sum(a) / len(a) for a in by_position]
    data = {
        "prompts": len(texts),
        "positions": len(by_position[0]),
        "acceptance": acceptance[0],
        "acceptance_by_position": acceptance,
        "reads_features": features,
        "cost_ratio": (draft_s / drafted) / (target_s / timed),
        "target_ms_per_token": 1e3 * target_s / timed,
        "draft_ms_per_drafted_token": 1e3 * draft_s / drafted,
        "draft_len": args.draft_len,
        "acceptance_per_prompt": per_prompt,
        "prompts_file": str(args.prompts),
        "draft": describe_draft(args.draft),
        "processor": processor(),
        "environment": environment(),
    }
    if not args.json:
        print(f"{len(texts)} prompts, {len(by_position[0])} positions: acceptance by block position "
              f"{' '.join(f'{a:.3f}' for a in acceptance)}{'' if features else ' (reads no features: one measurement)'}, "
              f"cost ratio {data['cost_ratio']:.3f} ({data['draft_ms_per_drafted_token']:.1f} / "
              f"{data['target_ms_per_token']:.1f} ms per token)")
    # the shipped feature draft's figures go to their own file; draft_quality.json holds the
    # distilled draft's, which benchmarks/gpu.py reads
    emit("draft_quality_feature" if args.draft == "feature" else "draft_quality", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
