"""The matcher pool and the mask-row table behind llguidance masks: whatever the order of the
requests (growing blocks, resampled copies, rollbacks, refused tokens, pruning), every mask equals
the brute-force mask of its prefix."""

import random

import pytest
import torch

import smc_sd.constraints.llguidance_masks as llguidance_masks
import smc_sd.constraints.matcher_pool as matcher_pool
from smc_sd.compiler.masks import Masker
from smc_sd.constraints.grammars import Regex
from smc_sd.constraints.potentials import as_token_constraint
from tests.test_llguidance import REGEX, REGEX_WORDS, WordLM, brute_force_masks, regex_oracle


def engine_like_batches(rng: random.Random, letters: int, steps: int) -> list[list[list[int]]]:
    """Batches of prefixes as the engine asks for them: particles grow by a token or a block
    (each position asked), are resampled (copies), roll back (a rejection) or take a random,
    possibly refused, token."""
    particles = [[] for _ in range(3)]
    batches = []
    for _ in range(steps):
        move = rng.choice(["grow", "block", "resample", "rollback"])
        if move == "resample":
            particles = [list(rng.choice(particles)) for _ in particles]
        elif move == "rollback":
            particles = [p[: rng.randint(0, len(p))] for p in particles]
        if move == "block":
            block = [rng.randrange(letters) for _ in range(rng.randint(1, 4))]
            batches.append([particles[0] + block[:j] for j in range(len(block) + 1)])
            particles[0] = particles[0] + block
        else:
            particles = [p + [rng.randrange(letters)] for p in particles]
            batches.append([list(p) for p in particles])
    return batches


@pytest.mark.parametrize(
    "window,max_rows,parallel",
    [(32, 256, False), (2, 3, False), (32, 256, True)],
    ids=["defaults", "tiny pool and table", "llguidance's thread pool"],
)
def test_masks_equal_brute_force_along_engine_like_requests(monkeypatch, window, max_rows, parallel):
    monkeypatch.setattr(matcher_pool, "WINDOW", window)
    monkeypatch.setattr(llguidance_masks, "MAX_ROWS", max_rows)
    monkeypatch.setattr(llguidance_masks, "_PARALLEL", parallel)
    lm = WordLM(REGEX_WORDS)
    constraint = as_token_constraint(Regex(REGEX), lm)
    viable, complete = regex_oracle(REGEX)
    rng = random.Random(0)
    dead_seen = 0
    for batch in engine_like_batches(rng, lm.vocabulary.size - 1, 300):
        rows, dead = constraint.mask_rows(batch)
        expected = brute_force_masks(lm, batch, viable, complete)
        assert torch.equal(torch.cat(rows), expected)
        assert dead == (~expected.any(1)).tolist()
        dead_seen += sum(dead)
        constraint._states.check_invariants()
    # the walk reached dead prefixes (refused tokens) as well as live ones
    assert dead_seen > 0


def test_masker_marks_rows_that_are_not_live_and_dead_rows():
    lm = WordLM(REGEX_WORDS)
    masker = Masker((as_token_constraint(Regex(REGEX), lm),), lm.vocabulary.size, lm.vocabulary.eos_token_id)
    viable, complete = regex_oracle(REGEX)
    a, b, c = (REGEX_WORDS.index(w) for w in "abc")
    # "ab": viable; "ca" then "b": refused after the complete "ca" (dead); "cc": refused
    prefixes = [[a, b], [c, a, b], [c, c], [b]]
    mask, dead = masker(prefixes, torch.tensor([True, True, True, False]))
    expected = brute_force_masks(lm, prefixes, viable, complete)
    assert torch.equal(mask[:3], expected[:3]) and mask[3].all()
    assert dead.tolist() == [False, True, True, False]
    assert masker.complete([[c, a], [a, b]]).tolist() == [True, False]
