"""Edge cases of the sampler: float32 round-off in exact SD, tokens of probability zero (-inf
logits), and greedy decoding (T = 0)."""

import math

import pytest
import torch

from smc_sd import AllParticlesDiedError
from smc_sd.backends.toy import ToyLM
from smc_sd.engine.sampling import EXP_FLOOR, FLOOR_WEIGHT, exp_floored, logsumexp_floored, sample_tokens, tempered_logprobs
from smc_sd.engine.accept_scores import emit_past_point_masses, emit_tokens, first_rejections
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import Schedule
from smc_sd.constraints.token_constraints import PredicateConstraint
from smc_sd.programs import autoregressive, mask_at_verify, smc_speculative, speculative
from smc_sd.testing import assert_logits_valid
from tests.toy_programs import PROMPT, sample_completions, target_and_draft


def accept_or_resample(drafted: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, u_accept: torch.Tensor, u_emit: float) -> tuple[int, int]:
    """The step's rule for one sequence, from the library's pieces: the first rejection among
    the K drafted tokens, then the emitted token (residual or bonus)."""
    k = drafted.numel()
    log_ratio = (logp[:k].gather(-1, drafted[:, None]) - logq.gather(-1, drafted[:, None])).T
    j = int(first_rejections(log_ratio, torch.tensor([k]), u_accept[None])[0])
    q = exp_floored(logq[j])[None] if j < k else torch.zeros(1, logp.shape[-1])
    return j, int(emit_tokens(logp[j][None], q, torch.tensor([u_emit], dtype=torch.float64))[0])


def test_rejection_with_a_residual_of_no_float32_mass_draws_from_p():
    # p and q agree to rounding: max(0, p - q) is all zero in float32 although p(0) < q(0)
    logp = tempered_logprobs(torch.tensor([-0.7228844165802002, 2.866340160369873, -0.5655086040496826]), 1.0)
    logq = tempered_logprobs(torch.tensor([-0.7228842377662659, 2.866340160369873, -0.5655086040496826]), 1.0)
    assert torch.clamp(logp.exp() - logq.exp(), min=0).sum() == 0 and logp[0] < logq[0]
    # an acceptance uniform at the top of [0, 1) forces the (rare) rejection of the drafted
    # token 0; the token draws stay random
    generator = torch.Generator().manual_seed(0)
    n = 4000
    emitted = []
    for u in torch.rand(n, generator=generator, dtype=torch.float64).tolist():
        accepted, token = accept_or_resample(torch.tensor([0]), logq[None], torch.stack([logp, logp]), torch.tensor([1 - 1e-8], dtype=torch.float64), u)
        assert accepted == 0
        emitted.append(token)
    exact = dict(enumerate(logp.exp().tolist()))
    assert total_variation(empirical(emitted), exact) < tv_tolerance(exact, n)


def test_point_mass_residuals_draw_the_tokens_of_the_dense_residual():
    # the free draft's path (no [G, V] q) against emit_tokens with q one-hot on the point rows:
    # rows that drew a bonus (no q), point rows where x has some, little or all of p's mass (the
    # last leaves no residual: x is drawn back), a point row at a token of probability zero,
    # and a flat row (a position without mass)
    generator = torch.Generator().manual_seed(0)
    v = 40
    logits = torch.randn(7, v, generator=generator) * 3
    logits[3] = -math.inf
    logits[3, 5] = 0.0
    logits[4, 9] = 30.0
    logits[5, 11] = -math.inf
    logp = torch.log_softmax(logits, -1)
    logp[6] = 0.0
    token = torch.tensor([0, 2, 7, 5, 9, 11, 3])
    point = torch.tensor([False, True, True, True, True, True, False])
    q = torch.zeros(7, v)
    q[point, token[point]] = 1.0
    for u in torch.rand(300, generator=generator, dtype=torch.float64).tolist() + [0.0, 1 - 2**-53]:
        uniforms = torch.full((7,), u, dtype=torch.float64)
        dense = emit_tokens(logp, q, uniforms)
        assert torch.equal(emit_past_point_masses(logp.clone(), token, point, uniforms), dense)
        # no point rows at all (no block drafted): every row draws from p~
        assert torch.equal(emit_past_point_masses(logp.clone(), token, None, uniforms), emit_tokens(logp, torch.zeros(7, v), uniforms))
        # the point row whose p is all on x draws x; no point row draws x otherwise
        assert dense[3] == 5 and dense[1] != 2 and dense[2] != 7 and dense[4] != 9


def test_sample_tokens_follows_the_softmax_and_never_draws_probability_zero(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    scores = torch.tensor([[1.0, -math.inf, 0.5, 2.0, -math.inf], [-math.inf, 0.0, -3.0, -math.inf, -math.inf]])
    n = 6000
    draws = torch.stack([sample_tokens(scores, generator) for _ in range(n)])
    for row in range(2):
        exact = dict(enumerate(torch.softmax(scores[row], -1).tolist()))
        assert total_variation(empirical(draws[:, row].tolist()), exact) < tv_tolerance(exact, n)
    # uniforms at the very top of [0, 1) still land on the last token of positive probability
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, 1 - 2**-53, dtype=torch.float64))
    assert sample_tokens(scores, generator).tolist() == [3, 2]


def test_floored_exp_is_zero_at_and_below_the_floor_and_within_its_weight_elsewhere():
    x = torch.tensor([-math.inf, -200.0, EXP_FLOOR - 1, EXP_FLOOR, EXP_FLOOR + 1e-3, -69.0, -50.0, -1.0, 0.0, 3.0])
    weights = exp_floored(x)
    assert weights.dtype == torch.float32 and bool((weights[x <= EXP_FLOOR] == 0).all())
    assert bool((weights[x > -60] > 0).all()) and bool((weights.diff() >= 0).all())
    # within C of exp(x), up to float32 rounding of exp(x) itself
    exact = x.double().exp()
    assert bool(((weights.double() - exact).abs() <= FLOOR_WEIGHT + 2**-23 * exact).all())


def test_floored_logsumexp_matches_the_exact_one_on_masked_and_low_temperature_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4000, generator=generator) * 8
    mask = torch.rand(3, 4000, generator=generator) < 0.01
    scores = torch.cat([tempered_logprobs(logits, 0.2), tempered_logprobs(logits, 1.0, mask), torch.full((1, 4000), -math.inf)])
    # most entries of the T = 0.2 rows lie below the floor
    assert float((scores[:3] < EXP_FLOOR).double().mean()) > 0.5
    exact = torch.logsumexp(scores.double(), -1)
    floored = logsumexp_floored(scores, -1)
    assert floored[-1] == -math.inf
    assert float((floored[:-1].double() - exact[:-1]).abs().max()) < 1e-5
    assert torch.equal(logsumexp_floored(scores[0], 0), floored[0])


def test_logits_contract_allows_minus_inf_but_not_nan():
    lm = ToyLM.random(4, seed=0, eos=False)
    rows, logits = lm.open(PROMPT, 2)
    assert_logits_valid(logits)
    assert_logits_valid(rows.extend(torch.tensor([[0, 1], [2, 2]])))
    assert logits[-1] == -math.inf
    with pytest.raises(AssertionError, match="NaN"):
        assert_logits_valid(torch.tensor([0.0, math.nan]))
    with pytest.raises(AssertionError, match="no finite entry"):
        assert_logits_valid(torch.full((2, 3), -math.inf))


def test_exact_sd_with_minus_inf_logits_matches_the_target():
    target = ToyLM.random(4, seed=5, eos=False)
    draft = ToyLM.perturbed(target, 1.5)
    exact, _ = target.completion_distribution(PROMPT, 3)
    n = 4000
    samples = sample_completions(speculative.program(target, draft, draft_len=2), Schedule(1, max_tokens=3), n)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


def only_zero_probability_completions():
    """A toy LM whose EOS has probability zero, and the language {"ab"} that needs EOS after "ab"."""
    lm = ToyLM(lambda context: torch.tensor([0.0, 0.0, -math.inf]), 3)
    language = {(0, 1)}
    constraint = PredicateConstraint(
        lambda x: any(w[: len(x)] == tuple(x) for w in language), lambda x: tuple(x) in language, 3, 2
    )
    return lm, constraint


@pytest.mark.parametrize("module", [smc_speculative, mask_at_verify], ids=["smc-sd", "mask-at-verify"])
def test_a_mask_whose_tokens_all_have_probability_zero(module):
    lm, constraint = only_zero_probability_completions()
    program = module.program(lm, lm, draft_len=2, constraints=(constraint,))
    # past the budget the all-zero position is never reached: the cut string comes back
    result = program.run([0], Schedule(1, max_tokens=2), seed=0)
    assert result.tokens == [0, 1] and torch.isfinite(result.log_weights).all()
    # within the budget, EOS after "ab" is the only valid token and it has probability zero
    with pytest.raises(AllParticlesDiedError):
        program.run([0], Schedule(1, max_tokens=3), seed=0)


def test_a_first_mask_of_zero_probability_is_a_clear_error():
    lm = ToyLM(lambda context: torch.tensor([-math.inf, 0.0, 0.0]), 3)
    only_a = PredicateConstraint(lambda x: all(t == 0 for t in x), lambda x: len(x) > 0, 3, 2)
    for program in (smc_speculative.program(lm, lm, constraints=(only_a,)), mask_at_verify.program(lm, lm, constraints=(only_a,))):
        with pytest.raises(AllParticlesDiedError, match="first token"):
            program.run([0], Schedule(1, max_tokens=3), seed=0)


def greedy_completion(lm: ToyLM, max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens and (not out or out[-1] != lm.vocabulary.eos_token_id):
        out.append(int(lm.logits(tuple(PROMPT + out)).argmax()))
    return out


def test_temperature_zero_is_greedy_for_ar_and_sd():
    target, draft = target_and_draft(noise=2.0)
    greedy = greedy_completion(target, 6)
    assert len(greedy) > 2
    ar = autoregressive.program(target, temperature=0.0)
    sd = speculative.program(target, draft, temperature=0.0, draft_len=3)
    greedy_draft_sd = speculative.program(target, draft, temperature=0.0, draft_temperature=0.0, draft_len=3)
    for seed in range(20):
        assert ar.run(PROMPT, Schedule(1, max_tokens=6), seed=seed).tokens == greedy
        assert sd.run(PROMPT, Schedule(1, max_tokens=6), seed=seed).tokens == greedy
        assert greedy_draft_sd.run(PROMPT, Schedule(1, max_tokens=6), seed=seed).tokens == greedy


def test_sd_at_temperature_zero_accepts_a_draft_iff_it_is_the_argmax():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = torch.randn(4, 5, generator=generator)
        # [4, V]: the greedy target at 3 drafted positions and after them
        logp = tempered_logprobs(logits, 0.0)
        logq = tempered_logprobs(torch.randn(3, 5, generator=generator), 1.0)
        drafted = torch.where(torch.rand(3, generator=generator) < 0.6, logits[:3].argmax(-1), torch.randint(5, (3,), generator=generator))
        hits = (drafted == logits[:3].argmax(-1)).tolist() + [False]
        u = torch.rand(4, generator=generator, dtype=torch.float64)
        accepted, token = accept_or_resample(drafted, logq, logp, u[:3], float(u[3]))
        assert accepted == hits.index(False)
        assert token == int(logits[accepted].argmax())


def test_smc_sd_refuses_temperature_zero():
    target, draft = target_and_draft()
    with pytest.raises(ValueError, match="temperature > 0"):
        smc_speculative.program(target, draft, temperature=0.0).run(PROMPT, Schedule())
    with pytest.raises(ValueError, match="draft temperature > 0"):
        smc_speculative.program(target, draft, draft_temperature=0.0).run(PROMPT, Schedule())


def masked_greedy_completion(lm: ToyLM, allowed, max_tokens: int) -> list[int]:
    """The argmax over the allowed tokens at every step (allowed(prefix) -> [V] bool)."""
    out: list[int] = []
    while len(out) < max_tokens and (not out or out[-1] != lm.vocabulary.eos_token_id):
        logits = lm.logits(tuple(PROMPT + out)).masked_fill(~allowed(tuple(out)), -math.inf)
        out.append(int(logits.argmax()))
    return out


def test_temperature_zero_under_a_constraint_is_the_masked_argmax_chain():
    target, draft = target_and_draft(noise=2.0)
    v, eos = target.vocabulary.size, target.vocabulary.eos_token_id
    # forbid the token the unconstrained greedy chain starts with, everywhere
    banned = int(target.logits(tuple(PROMPT)).argmax())
    assert banned != eos
    no_banned = PredicateConstraint(lambda x: banned not in x, lambda x: banned not in x, v, eos)

    def allowed(prefix):
        return torch.tensor([t != banned for t in range(v)])

    greedy = masked_greedy_completion(target, allowed, 6)
    assert banned not in greedy and greedy != greedy_completion(target, 6)
    programs = [
        autoregressive.program(target, temperature=0.0, constraints=(no_banned,)),
        mask_at_verify.program(target, draft, constraints=(no_banned,), temperature=0.0, draft_len=3),
        mask_at_verify.program(target, draft, constraints=(no_banned,), temperature=0.0, draft_temperature=0.0, draft_len=3),
    ]
    for program in programs:
        for seed in range(10):
            assert program.run(PROMPT, Schedule(1, max_tokens=6), seed=seed).tokens == greedy, program.name
