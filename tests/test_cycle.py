"""A cycle without waste: finished particles keep their tokens and weights but cost no forward."""

import torch

from smc_sd.backends.toy import ToyLM, ToySequences
from smc_sd.program import Schedule
from smc_sd.programs import smc_speculative
from tests.toy_programs import PROMPT


class CountingLM(ToyLM):
    """A ToyLM that records the batch size of every extend and the tokens each row was fed."""

    def open(self, prompt, batch_size):
        rows, logits = super().open(prompt, batch_size)
        return CountingRows(self, rows._rows), logits


class CountingRows(ToySequences):
    def extend(self, tokens):
        self._lm.extends.append(tokens.shape[0])
        return super().extend(tokens)


def counting(seed: int) -> CountingLM:
    base = ToyLM.random(4, seed=seed)
    lm = CountingLM(base.logits, 4)
    lm.extends = []
    return lm


def test_only_unfinished_particles_are_extended():
    eos = 3
    for seed in range(20):
        target, draft = counting(seed), counting(seed + 100)
        unfinished_after = []
        program = smc_speculative.program(target, draft, draft_len=2)
        result = program.run(
            PROMPT, Schedule(8, max_tokens=12), seed=seed,
            on_cycle=lambda stats, rows: unfinished_after.append(sum(eos not in row for row in rows)),
        )
        rows = [c.rows for c in result.cycles]
        # one target extend per cycle, over the particles unfinished when it starts
        assert target.extends == rows
        assert rows[1:] == unfinished_after[:-1]
        # after the draft first reads the prompt's first token, K extends per cycle over the same rows
        assert draft.extends == [r for r in rows for _ in range(2)]


def test_finished_particles_keep_their_text_and_stay_resamplable():
    target, draft = counting(1), counting(51)
    result = smc_speculative.program(target, draft, draft_len=3).run(PROMPT, Schedule(16, max_tokens=10), seed=9)
    eos = target.vocabulary.eos_token_id
    for tokens, finished in zip(result.particles, result.finished):
        assert (tokens[-1] == eos) == finished and eos not in tokens[:-1]
    assert any(c.rows < 16 for c in result.cycles) and not all(result.finished), "nothing to show: pick another seed"
    assert torch.isfinite(result.log_weights).any()
