"""Write the generated section of docs/results.md from benchmarks/results/*.json.

The section lies between the markers below; everything between them is replaced, nothing else in
the page is touched (the markers are appended at the end if they are missing). Links in it are
relative to docs/.

Usage: python benchmarks/report.py [--page docs/results.md] [--check]
(--check exits 1 if the page's section differs from what the JSON gives.)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from _common import RESULTS, setting_label

ROOT = pathlib.Path(__file__).resolve().parent.parent
START, END = "<!-- results:start -->", "<!-- results:end -->"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def measured(data: dict) -> str:
    env = data["environment"]
    where = env.get("cuda") or f"{env['machine']}, {env['cpus']} cores, {env['torch_threads']} torch thread(s)"
    if "load_average" in env:
        where += f", load average {env['load_average']:.1f} at the end"
    return f"Measured {env['date']} on {where}, torch {env['torch']}: `python benchmarks/{env['command']}`."


def speed_section(data: dict, name: str = "speed") -> list[str]:
    has_logprob = "mean_target_logprob" in data["rows"][0]
    header = ["configuration", "tokens/s", "target passes / token", "x ar"]
    header += ["mean target log-prob / token"] if has_logprob else []
    rows = []
    for r in data["rows"]:
        row = [r["label"], f"{r['tokens_per_second']:.2f}", f"{r['target_passes_per_token']:.2f}", f"{r['speedup_vs_ar']:.2f}"]
        if has_logprob:
            row.append(f"{r['mean_target_logprob']:.2f} ± {r['mean_target_logprob_stderr']:.2f}")
        rows.append(row)
    heading = "### Speed (CPU, default model)" if name == "speed" else "#### The same benchmark with another draft"
    return [
        heading, "",
        f"{data['prompts']} chat prompt(s), {data['max_tokens']} new tokens each; draft: {data['draft']}. "
        + measured(data), "",
        *table(header, rows), "",
        "On this CPU a wide verify pass costs several times a one-token pass, so wall-clock ratios here "
        "are costs as measured, not GPU predictions; target passes per token is the hardware-independent "
        "part (1/(K+1) for smc-sd). The mean target log-probability per generated token is the fidelity "
        "check: a draft that agrees poorly with the target pulls SMC-SD's outputs below ar's. "
        "Timings on this 2-core machine vary by up to about 20% between runs.", "",
        f"![speed](../benchmarks/results/{name}.png)", "",
    ]


def fidelity_section(data: dict) -> list[str]:
    toy = data["toy"]
    ks = sorted({r["draft_len"] for r in toy["rows"]})
    ns = sorted({r["particles"] for r in toy["rows"] if r["method"] == "smc-sd"})
    rows = []
    for alpha in (1.0, 2.0):
        for k in ks:
            tvs = {r["particles"]: r["tv"] for r in toy["rows"]
                   if r["method"] == "smc-sd" and r["draft_len"] == k and r["alpha"] == alpha}
            rows.append([f"smc-sd K={k}, target p^{alpha:g}"] + [f"{tvs[n]:.3f}" for n in ns])
    for r in (r for r in toy["rows"] if r["method"] == "sd"):
        rows.append([f"exact sd K={r['draft_len']} (control)", f"{r['tv']:.3f}"] + [""] * (len(ns) - 1))
    for alpha, floor in toy["floor"].items():
        rows.append([f"floor: {toy['samples']} exact draws of p^{float(alpha):g}", f"{floor:.3f}"] + [""] * (len(ns) - 1))
    t = toy["toy"]
    lines = [
        "### Fidelity", "",
        f"Toy LM (vocabulary {t['vocab_size']} with EOS, random logits x {t['scale']}, draft = target + "
        f"N(0, {t['draft_noise']}²) logit noise, up to {t['max_tokens']} tokens, {toy['support']} possible "
        f"completions): total variation between the returned texts of {toy['samples']} seeded runs and the "
        "exact target, by particles N. " + measured(data), "",
        *table(["method"] + [f"N={n}" for n in ns], rows), "",
        "![fidelity on a toy LM](../benchmarks/results/fidelity_toy.png)", "",
    ]
    lm = data.get("lm")
    if lm:
        lm_rows = []
        for r in lm["rows"]:
            lm_rows.append([setting_label(r), f"{r['mean_logprob_per_token']:.3f}", f"{r['stderr']:.3f}", r["outputs"]])
        lines += [
            f"Default model: each method's outputs ({lm['prompts']} prompts x {lm['seeds']} seeds, up to "
            f"{lm['max_tokens']} tokens) scored by the target at T = 1"
            + (f"; draft: {lm['draft']}." if "draft" in lm else "."), "",
            *table(["method", "mean log p_T per token (nats)", "standard error", "outputs"], lm_rows), "",
            "![fidelity on the default model](../benchmarks/results/fidelity_lm.png)", "",
        ]
    return lines


def accuracy_section(data: dict, name: str = "accuracy") -> list[str]:
    """The accuracy table; results/accuracy_<x>.json are the same task measured with another draft."""
    rows = [[r["label"], f"{100 * r['accuracy']:.1f}%", f"{100 * r['ci95'][0]:.1f}-{100 * r['ci95'][1]:.1f}%",
             f"{r['correct']}/{r['items']}", f"{r['seconds_per_item']:.2f}"] for r in data["rows"]]
    timing = ""
    if "merged_from" in data:
        timing = (f"The settings ran as {len(data['merged_from'])} separate processes, partly at the same "
                  "time, on the shared CPU, so seconds per item are rough (the load differed between them).")
    heading = "### Accuracy" if name == "accuracy" else "#### The same task with another draft"
    return [
        heading, "",
        f"Task: {data['task']}; {data['model']}; draft: {data['draft']}. " + measured(data) + " " + timing, "",
        *table(["method", "accuracy", "95% interval (Wilson)", "correct", "seconds / item"], rows), "",
        "ar and sd sample p_T exactly, so they should agree (up to sampling noise). smc-sd with alpha = 1 "
        "targets the same p_T but is biased at finite N toward its draft's distribution (the reference "
        "row samples the draft alone), so where it departs from ar at small N that is the bias, which "
        "shrinks as N grows; alpha > 1 changes the target itself (p_T^alpha, which concentrates on "
        "likely answers).", "",
        f"![accuracy](../benchmarks/results/{name}.png)", "",
    ]


def gpu_section(data: dict | None) -> list[str]:
    lines = ["### GPU (the engine on the compiled static path and batched)", ""]
    if data is None:
        return lines + [
            "Not measured yet: no CUDA GPU was available to this project's sessions so far. "
            "`python benchmarks/gpu.py` on a CUDA GPU runs the engine end to end on 8B/1B-shaped random "
            "bf16 models and writes `benchmarks/results/gpu.json`; rerun this report to add its table "
            "here ([docs/gpu.md](gpu.md)).", "",
        ]
    rows = [[r["label"], f"{r['cycle_ms']:.2f}", f"{r['tokens_per_cycle']:.2f}", f"{r['tokens_per_second']:.1f}",
             f"{r['speedup_vs_ar']:.2f}", f"{r['roofline_fraction']:.2f}"] for r in data["rows"]]
    skipped = f" Not timed (the run's time budget ran out): {', '.join(data['skipped'])}." if data.get("skipped") else ""
    lines += [
        f"{data['device']}: {data['target']} target, {data['draft']} draft, random {data['dtype']} weights, batch 1, "
        f"{data['prompt_len']}-token prompt, {data['new_tokens']} new tokens, compiled static KV path; sd's tokens "
        f"per pass at acceptance {data['acceptance']:.3f} ({data['acceptance_source']}). " + measured(data) + skipped, "",
        *table(["method", "cycle ms", "tokens / cycle", "tokens/s", "x ar", "memory roofline fraction"], rows), "",
    ]
    batched = data.get("batched")
    if batched and "rows" in batched:
        rows = [[r["label"], r["requests"], r["generated"], f"{r['seconds']:.1f}", f"{r['tokens_per_second']:.1f}"] for r in batched["rows"]]
        lines += [
            f"The batched engine on the same models, paged KV, eager (`Program.run_many`, {batched['new_tokens']} new "
            f"tokens per request, wall time with prefill): {batched['batch']} requests at once give "
            f"{batched['ar_batched_over_alone']:.1f}x the output tokens/s of one alone; smc-sd N=4 K=4 gives "
            f"{batched['smc-sd_over_ar_batched']:.2f}x batched ar.", "",
            *table(["method", "requests", "tokens", "seconds", "output tokens/s"], rows), "",
        ]
    return lines


def render() -> str:
    lines = [START, "## Results", "",
             "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; do not edit by hand.", ""]
    # (name, its section, whether name_*.json files (runs with another draft) follow it)
    for name, section, variants in [
        ("speed", speed_section, True), ("fidelity", fidelity_section, False), ("accuracy", accuracy_section, True)
    ]:
        data = load(name)
        lines += section(data) if data else [f"### {name.capitalize()}", "", f"Not run yet: `python benchmarks/{name}.py`.", ""]
        if variants:
            lines += [line for extra in sorted(RESULTS.glob(f"{name}_*.json"))
                      for line in section(json.loads(extra.read_text()), extra.stem)]
    lines += gpu_section(load("gpu"))
    return "\n".join(lines + [END])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", default=str(ROOT / "docs" / "results.md"))
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page = pathlib.Path(args.page)
    text = page.read_text()
    section = render()
    if START in text and END in text:
        updated = text[: text.index(START)] + section + text[text.index(END) + len(END):]
    else:
        updated = text.rstrip("\n") + "\n\n" + section + "\n"
    if args.check:
        return 0 if updated == text else 1
    page.write_text(updated)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
