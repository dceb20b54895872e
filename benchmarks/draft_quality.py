"""How well and how cheaply a draft predicts the default target, on prompts it was not trained on.

For each prompt (one instruction per line of --prompts, wrapped in the chat template) the target
samples a continuation at T = 1 (seeded); at every position t both models see the same prefix and

    acceptance_t = 1 - TV(p_t, q_t) = sum_v min(p_t(v), q_t(v)),

the probability that exact speculative decoding accepts a drafted token there (p, q at T = 1).
Reported: acceptance = mean over all positions of all prompts; cost_ratio = draft / target mean
wall time of one cached one-token forward at batch 1 (`extend`), measured alternately in the same
run so that load on the machine hits both alike.

Usage: python benchmarks/draft_quality.py [--prompts FILE] [--max-tokens 64] [--draft DIR] [--json]
"""

from __future__ import annotations

import argparse
import pathlib
import time

from _common import DRAFT_HELP, describe_draft, emit, environment, load_default_models

import torch

HELDOUT = pathlib.Path(__file__).resolve().parent / "prompts" / "heldout.txt"


def timed_extend(rows, token: int) -> tuple[torch.Tensor, float]:
    """Append one token to a batch-1 row; return its next-token logits [V] and the seconds taken."""
    started = time.perf_counter()
    logits = rows.extend(torch.tensor([[token]]))[0, -1]
    return logits, time.perf_counter() - started


def score_prompt(target, draft, prompt: list[int], max_tokens: int, generator) -> dict:
    """Per-position acceptance and per-token forward times along one target sample."""
    eos = target.vocabulary.eos_token_id
    target_rows, p_logits = target.open(prompt, 1)
    draft_rows, q_logits = draft.open(prompt, 1)
    accept, target_s, draft_s = [], [], []
    for _ in range(max_tokens):
        # [V] each, T = 1
        p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
        accept.append(torch.minimum(p, q).sum().item())
        token = int(torch.multinomial(p, 1, generator=generator))
        if token == eos or len(accept) == max_tokens:
            break
        p_logits, seconds = timed_extend(target_rows, token)
        target_s.append(seconds)
        q_logits, seconds = timed_extend(draft_rows, token)
        draft_s.append(seconds)
    target_rows.close()
    draft_rows.close()
    return {"acceptance": accept, "target_s": target_s, "draft_s": draft_s}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=pathlib.Path, default=HELDOUT, help="one instruction per line")
    parser.add_argument("--limit", type=int, default=None, help="use only the first LIMIT prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="positions scored per prompt")
    parser.add_argument("--draft", default=None, help=DRAFT_HELP)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON object only")
    parser.add_argument("--no-write", action="store_true", help="write no results file")
    args = parser.parse_args(argv)

    from smc_sd.backends.hf import chat_prompt

    target, draft = load_default_models(args.draft)
    texts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()][: args.limit]
    generator = torch.Generator().manual_seed(args.seed)
    per_prompt = [score_prompt(target, draft, chat_prompt(target.tokenizer, t), args.max_tokens, generator) for t in texts]
    accept = [a for r in per_prompt for a in r["acceptance"]]
    target_s = [s for r in per_prompt for s in r["target_s"]]
    draft_s = [s for r in per_prompt for s in r["draft_s"]]
    data = {
        "prompts": len(texts),
        "positions": len(accept),
        "acceptance": sum(accept) / len(accept),
        "cost_ratio": sum(draft_s) / sum(target_s),
        "target_ms_per_token": 1e3 * sum(target_s) / len(target_s),
        "draft_ms_per_token": 1e3 * sum(draft_s) / len(draft_s),
        "acceptance_per_prompt": [sum(r["acceptance"]) / len(r["acceptance"]) for r in per_prompt],
        "prompts_file": str(args.prompts),
        "draft": describe_draft(args.draft),
        "environment": environment(),
    }
    if not args.json:
        print(f"{len(texts)} prompts, {len(accept)} positions: acceptance {data['acceptance']:.3f}, "
              f"cost ratio {data['cost_ratio']:.3f} ({data['draft_ms_per_token']:.1f} / "
              f"{data['target_ms_per_token']:.1f} ms per token)")
    emit("draft_quality", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
