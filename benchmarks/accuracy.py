"""Accuracy of ar, sd and smc-sd settings on a verifiable task, with 95% confidence intervals.

The task: single-digit additions "a + b =" (a, b drawn uniformly from 0..9 with a fixed seed),
asked as a raw few-shot completion, which the default 135M model answers far better than a chat
question (measured: about 45% with ar at T = 1 few-shot, 0% as a chat question). An answer is
correct when the first integer in the completion equals a + b. Every method samples at T = 1;
ar and sd sample p_T exactly, smc-sd samples p_T^alpha approximately (alpha > 1 sharpens it);
the reference row samples the draft alone, the distribution smc-sd leans toward at small N.

Reported per setting: accuracy with a Wilson 95% interval, tokens/s and seconds per item; the
plot puts accuracy against speed, the knob the settings turn.

Usage: python benchmarks/accuracy.py [--items 100] [--seed 0]
Settings can run in separate processes and be merged:
  accuracy.py --settings 0,1 --name part1; accuracy.py --settings 2,3,4 --name part2
  accuracy.py --merge results/part1.json results/part2.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import time

from _common import DRAFT_HELP, build_program, describe_draft, emit, environment, load_default_models, pyplot, save_figure, setting_label, wilson_interval

SHOTS = "3 + 4 = 7\n8 + 1 = 9\n2 + 6 = 8\n5 + 5 = 10\n"

SETTINGS = [
    {"method": "ar"},
    {"method": "sd", "draft_len": 2},
    {"method": "smc-sd", "particles": 2, "draft_len": 2},
    {"method": "smc-sd", "particles": 4, "draft_len": 2},
    {"method": "smc-sd", "particles": 4, "draft_len": 2, "alpha": 4.0},
    # reference: the draft sampled on its own; smc-sd's finite-N bias leans toward it
    {"method": "ar", "lm": "draft"},
]


def items(count: int, seed: int) -> list[tuple[int, int]]:
    """`count` pairs (a, b) of digits, reproducible from `seed`."""
    rng = random.Random(seed)
    return [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]


def prompt_text(a: int, b: int) -> str:
    return SHOTS + f"{a} + {b} ="


def is_correct(completion: str, a: int, b: int) -> bool:
    """The first integer in the completion equals a + b."""
    found = re.search(r"-?\d+", completion)
    return found is not None and int(found.group()) == a + b


def label(setting: dict) -> str:
    if setting.get("lm") == "draft":
        return f"{setting['method']} on the draft (reference)"
    return setting_label(setting)


def evaluate(setting: dict, target, draft, pairs, max_tokens: int, seed: int) -> dict:
    from smc_sd import Schedule

    options = {k: v for k, v in setting.items() if k not in ("method", "particles", "lm")}
    if setting.get("lm") == "draft":
        target = draft
    program = build_program(setting["method"], target, draft, **options)
    schedule = Schedule(setting.get("particles", 1), max_tokens=max_tokens)
    correct = tokens = 0
    seconds = 0.0
    for i, (a, b) in enumerate(pairs):
        prompt = target.tokenizer.encode(prompt_text(a, b), add_special_tokens=False)
        result = program.run(prompt, schedule, seed=seed + i)
        correct += is_correct(result.text, a, b)
        tokens += len(result.tokens)
        seconds += result.seconds
    low, high = wilson_interval(correct, len(pairs))
    return {
        "label": label(setting),
        **setting,
        "items": len(pairs),
        "correct": correct,
        "accuracy": correct / len(pairs),
        "ci95": [low, high],
        "tokens_per_second": tokens / seconds,
        "seconds_per_item": seconds / len(pairs),
    }


def plot(rows: list[dict], name: str = "accuracy") -> list[str]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    labels = [r["label"] for r in rows]
    acc = [100 * r["accuracy"] for r in rows]
    err = [[100 * (r["accuracy"] - r["ci95"][0]) for r in rows], [100 * (r["ci95"][1] - r["accuracy"]) for r in rows]]
    axes[0].barh(labels, acc, xerr=err, capsize=4, color="tab:green")
    axes[0].invert_yaxis()
    axes[0].set_xlabel("accuracy (%), 95% Wilson interval")
    axes[0].set_title(f"Single-digit addition, {rows[0]['items']} items")
    axes[0].grid(axis="x", alpha=0.3)
    for r, a in zip(rows, acc):
        axes[1].errorbar(r["seconds_per_item"], a, yerr=[[100 * (r["accuracy"] - r["ci95"][0])], [100 * (r["ci95"][1] - r["accuracy"])]],
                         fmt="o", capsize=4)
        axes[1].annotate(r["label"], (r["seconds_per_item"], a), textcoords="offset points", xytext=(5, 5), fontsize=8)
    axes[1].set_xlabel("seconds per item (CPU, wall clock)")
    axes[1].set_ylabel("accuracy (%)")
    axes[1].set_title("Accuracy against cost")
    axes[1].grid(alpha=0.3)
    return [save_figure(fig, name)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100, help="items (the committed results use 200)")
    parser.add_argument("--max-tokens", type=int, default=3, help="new tokens per answer (' ', '1', '4' for 14)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the items and the runs")
    parser.add_argument("--draft", default=None, help=DRAFT_HELP)
    parser.add_argument("--settings", default=None, help="comma-separated indices into SETTINGS (default: all)")
    parser.add_argument("--name", default="accuracy", help="results/<name>.json and .png")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="combine the rows of runs over disjoint --settings into one result")
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)
    if args.merge:
        return merge([json.loads(pathlib.Path(p).read_text()) for p in args.merge], args.name, not args.no_write)

    target, draft = load_default_models(args.draft)
    pairs = items(args.items, args.seed)
    chosen = SETTINGS if args.settings is None else [SETTINGS[int(i)] for i in args.settings.split(",")]
    started = time.perf_counter()
    rows = [evaluate(s, target, draft, pairs, args.max_tokens, args.seed) for s in chosen]
    data = {
        "benchmark": "accuracy",
        "task": "single-digit addition, 4-shot raw completion, exact match of the first integer",
        "model": "SmolLM2-135M-Instruct (fp32, CPU), T = 1",
        "draft": describe_draft(args.draft),
        "items": args.items,
        "max_tokens": args.max_tokens,
        "environment": environment(),
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
    }
    if not args.no_write:
        data["plots"] = plot(rows, args.name)
    emit(args.name, data, write=not args.no_write)
    return data


def merge(parts: list[dict], name: str, write: bool) -> dict:
    """One result from runs of the same task over disjoint settings (rows in SETTINGS order)."""
    keys = ("task", "model", "draft", "items", "max_tokens")
    if any(part[k] != parts[0][k] for part in parts for k in keys):
        raise SystemExit(f"accuracy.py --merge: the parts differ in one of {keys}")
    order = [label(s) for s in SETTINGS]
    rows = sorted((r for part in parts for r in part["rows"]), key=lambda r: order.index(r["label"]))
    data = {**parts[0], "rows": rows, "wall_seconds": max(part["wall_seconds"] for part in parts),
            "merged_from": [part["environment"]["command"] for part in parts]}
    data["environment"] = {**parts[0]["environment"],
                           "command": f"accuracy.py --items {data['items']} (settings in parallel processes, then --merge)"}
    data.pop("plots", None)
    if write:
        data["plots"] = plot(rows, name)
    emit(name, data, write=write)
    return data


if __name__ == "__main__":
    main()
