"""Shared toy models and a sampler for the exact tests."""

from __future__ import annotations

from smc_sd.backends.toy import ToyLM
from smc_sd.program import Program, Schedule

PROMPT = [0]


def target_and_draft(noise: float = 1.5) -> tuple[ToyLM, ToyLM]:
    """A 3-letter + EOS toy target and a draft that differs from it."""
    target = ToyLM.random(4, seed=3)
    return target, ToyLM.perturbed(target, noise)


class WordLM(ToyLM):
    """A random toy LM whose tokens are the given strings (multi-byte tokens included), then EOS."""

    def __init__(self, words: list[str], seed: int = 0):
        base = ToyLM.random(len(words) + 1, seed=seed)
        super().__init__(base.logits, len(words) + 1, name=f"words(seed={seed})")
        self.words = words

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.words[t] for t in token_ids if t != self.vocabulary.eos_token_id)


def sample_completions(program: Program, schedule: Schedule, runs: int) -> list[tuple[int, ...]]:
    """The returned completion of `runs` independent runs (seeds 0..runs-1)."""
    return [tuple(program.run(PROMPT, schedule, seed=s).tokens) for s in range(runs)]
