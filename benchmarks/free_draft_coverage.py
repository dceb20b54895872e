"""How much of a correct extraction answer model-free drafts propose: forced tokens and prompt lookup.

For each item of `extraction_items.json` the answer is serialised compactly
(`json.dumps(answer, separators=(",", ":"))`) and tokenized with SmolLM2's tokenizer (its own
encoding, a_1..a_T, EOS not counted). A source proposes a block d(i) at every position i, from the
state after a_1..a_i:
- forced: llguidance's `compute_ff_tokens()` under the schema's grammar with the fixed compact
  layout (`whitespace_flexible: false`, separators "," and ":");
- forced (flexible): the same under llguidance's default JSON grammar (free whitespace), on the
  same compact answer;
- forced bytes: the tokenizer's encoding of all of `compute_ff_bytes()`, the last tokens included
  that `compute_ff_tokens()` drops because they could merge with the text after them (a verify
  pass accepts or rejects them like any drafted token);
- lookup n=2 / lookup n=1..8: `LookupIndex(prompt).propose(a_1..a_i, block)` over the chat prompt's
  tokens, matching the last 2 tokens only, or the longest of the last 1 to 8;
- forced, else lookup n=2 (forced bytes, else lookup n=2 / n=1..8): the forced source's proposal
  where it has one, the lookup's elsewhere.

Each d(i) is cut to --block tokens. Per source:
- covered: the fraction of answer tokens a_j that some proposal predicts, i.e. d(i) agrees with
  a_(i+1)..a_j for some i < j (proposals made after every token);
- drafted: the fraction of answer tokens accepted in a verify walk against a target that emits the
  answer: from position i the block d(i) is accepted up to its first disagreement (k tokens), the
  pass adds the target's own next token, and the walk resumes at i + k + 1;
- tokens_per_pass: T / (passes of that walk), the tokens one verify pass yields at best
  (a sampling target accepts less);
- us_per_call: mean time of one proposal (matcher state advance excluded for the forced sources).

The request is `REQUEST` (the schema and the document) in SmolLM2's chat template. Only the
tokenizer loads.

    OMP_NUM_THREADS=1 python benchmarks/free_draft_coverage.py [--block 8] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from _common import emit, environment

ITEMS = pathlib.Path(__file__).resolve().parent / "extraction_items.json"
REQUEST = "Extract the data in this JSON schema from the text and answer with one JSON object.\nSchema: {schema}\nText:\n{document}"
# llguidance's fixed JSON layout: no free whitespace, separators without spaces
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def forced_proposals(lltokenizer, grammar: str, answer: list[int], whole: bool) -> tuple[list[list[int]], float]:
    """At every position 0..T-1 of the answer, compute_ff_tokens() (whole: the encoding of all of
    compute_ff_bytes()), and the mean cost of one in µs."""
    import llguidance

    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    proposals, seconds = [], 0.0
    for token in answer:
        start = time.perf_counter()
        if whole:
            proposals.append(lltokenizer.tokenize_bytes(matcher.compute_ff_bytes()))
        else:
            proposals.append(matcher.compute_ff_tokens())
        seconds += time.perf_counter() - start
        if not matcher.consume_token(token):
            raise ValueError(f"the grammar rejects the answer: {matcher.get_error()}")
    return proposals, 1e6 * seconds / len(answer)


def lookup_proposals(index, answer: list[int], block: int) -> tuple[list[list[int]], float]:
    """LookupIndex.propose at every position 0..T-1 of the answer, and its mean cost in µs."""
    proposals, seconds = [], 0.0
    for i in range(len(answer)):
        generated = answer[:i]
        start = time.perf_counter()
        proposals.append(index.propose(generated, block))
        seconds += time.perf_counter() - start
    return proposals, 1e6 * seconds / len(answer)


def agreement(proposal: list[int], answer: list[int], i: int) -> int:
    """The number of leading tokens of proposal equal to answer[i:]."""
    k = 0
    while k < len(proposal) and i + k < len(answer) and proposal[k] == answer[i + k]:
        k += 1
    return k


def measure(proposals: list[list[int]], answer: list[int], block: int) -> dict:
    """covered, drafted and tokens_per_pass (module docstring) of one source on one answer."""
    size = len(answer)
    covered = [False] * size
    for i, proposal in enumerate(proposals):
        for j in range(i, i + agreement(proposal[:block], answer, i)):
            covered[j] = True
    drafted = passes = i = 0
    while i < size:
        k = agreement(proposals[i][:block], answer, i)
        drafted += k
        passes += 1
        i += k + 1
    return {"covered": sum(covered), "drafted": drafted, "passes": passes}


def fractions(counts: dict, tokens: int) -> dict:
    return {
        "covered": round(counts["covered"] / tokens, 3),
        "drafted": round(counts["drafted"] / tokens, 3),
        "tokens_per_pass": round(tokens / counts["passes"], 2),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=8, help="the most tokens a proposal holds")
    parser.add_argument("--no-write", action="store_true", help="do not save results/free_draft_coverage.json")
    args = parser.parse_args(argv)
    if args.block < 1:
        parser.error(f"--block must be >= 1, got {args.block}")

    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from smc_sd.backends.hf import chat_prompt
    from smc_sd.engine.lookup import LookupIndex
    from smc_sd.models.smollm2 import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer)
    lookups = {"lookup n=2": dict(max_ngram=2, min_ngram=2), "lookup n=1..8": dict(max_ngram=8, min_ngram=1)}
    either = {"forced, else lookup n=2": ("forced", "lookup n=2"), "forced bytes, else lookup n=2": ("forced bytes", "lookup n=2"), "forced bytes, else lookup n=1..8": ("forced bytes", "lookup n=1..8")}
    sources = ["forced", "forced (flexible)", "forced bytes", *lookups, *either]
    totals = {name: {"covered": 0, "drafted": 0, "passes": 0} for name in sources}
    micros = {name: 0.0 for name in sources}
    rows, tokens_total = [], 0
    for item in json.loads(ITEMS.read_text()):
        schema = item["schema"]
        answer = tokenizer.encode(json.dumps(item["answer"], separators=(",", ":")), add_special_tokens=False)
        request = REQUEST.format(schema=json.dumps(schema, separators=(",", ":")), document=item["document"])
        prompt = chat_prompt(tokenizer, request)
        proposals, cost = {}, {}
        compact = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
        flexible = llguidance.LLMatcher.grammar_from_json_schema(schema)
        for name, grammar, whole in [("forced", compact, False), ("forced (flexible)", flexible, False), ("forced bytes", compact, True)]:
            proposals[name], cost[name] = forced_proposals(lltokenizer, grammar, answer, whole)
        for name, options in lookups.items():
            proposals[name], cost[name] = lookup_proposals(LookupIndex(prompt, **options), answer, args.block)
        for name, (first, second) in either.items():
            proposals[name] = [f or g for f, g in zip(proposals[first], proposals[second])]
            cost[name] = cost[first] + cost[second]
        row = {"name": item["name"], "prompt_tokens": len(prompt), "answer_tokens": len(answer)}
        for name in sources:
            counts = measure(proposals[name], answer, args.block)
            row[name] = fractions(counts, len(answer))
            for key in counts:
                totals[name][key] += counts[key]
            micros[name] += cost[name] * len(answer)
        rows.append(row)
        tokens_total += len(answer)
    total = {name: {**fractions(totals[name], tokens_total), "us_per_call": round(micros[name] / tokens_total, 2)} for name in sources}
    data = {
        "environment": environment(),
        "tokenizer": "SmolLM2-135M-Instruct",
        "block": args.block,
        "request": REQUEST,
        "items": len(rows),
        "answer_tokens": tokens_total,
        "total": total,
        "rows": rows,
    }
    emit("free_draft_coverage", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
