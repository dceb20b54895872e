"""The step plan: the fixed-shape description of one cycle that the engine executes.

Every cycle of an importance-verified plan drafts K tokens for each of N particles (K draft
forwards of [N, 1] tokens after the first, which also feeds the tokens the draft has not seen),
verifies them in ONE target forward of [N, K + 1] tokens, and advances every particle by exactly
K + 1 positions. An accept/reject plan has N = 1 and advances by 1 to K + 1 positions.

All validation happens here, before any model runs, so bad input fails fast with a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from smc_sd.backends.base import ContextOverflowError, LanguageModel, check_same_vocabulary
from smc_sd.compiler.free_draft import FreeDraft
from smc_sd.compiler.masks import Masker
from smc_sd.constraints.scores import BlockPotential, ProductPotential, as_block_potential

#: the resampling schemes a plan may name (`smc_sd.engine.resampling.RESAMPLERS` runs them)
RESAMPLING_SCHEMES = ("systematic", "multinomial", "stratified", "residual")


@dataclass(frozen=True)
class StepPlan:
    """A compiled program.

    Attributes:
        name: the program's name.
        verification: "importance" (SMC-SD) or "accept-reject" (exact speculative decoding).
        target: target LM; target_temperature T; alpha the power.
        draft: draft LM or None (K = 0: the target proposes its own next token, or the free
            draft proposes alone).
        draft_temperature: T_d.
        particles: N.
        draft_len: K.
        ess_threshold: tau.
        resampling: the resampling scheme's name.
        max_tokens: generated tokens per particle, at most.
        masker: the conjunction of the target's boolean constraints as batched next-token
            masks, or None when unconstrained.
        twist: the program's twist (log psi of prefixes), or None.
        potential: the product of the target's block-end potentials, or None.
        free: the proposal's model-free draft sources, or None.
    """

    name: str
    verification: str
    target: LanguageModel
    target_temperature: float
    alpha: float
    draft: LanguageModel | None
    draft_temperature: float
    particles: int
    draft_len: int
    ess_threshold: float
    resampling: str
    max_tokens: int
    masker: Masker | None = None
    twist: Callable | None = None
    potential: BlockPotential | None = None
    free: FreeDraft | None = None

    @property
    def tokens_per_pass(self) -> int:
        """K + 1: positions every particle advances per target pass (importance plans)."""
        return self.draft_len + 1


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_settings(program, schedule) -> None:
    """Refuse every invalid setting of a program and a schedule that is judged without a model.

    Reads numbers, names and which parts are present, never a model (`target.lm`, `proposal.lm`
    may still be None), so the CLI runs it on the program it is about to build before any weights
    load. `compile_program` runs it first.

    Raises:
        ValueError: naming the setting.
    """
    target, proposal = program.target, program.proposal
    _require(schedule.particles >= 1, f"particles must be >= 1, got {schedule.particles}")
    _require(schedule.max_tokens >= 1, f"max tokens must be >= 1, got {schedule.max_tokens}")
    _require(0.0 <= schedule.ess_threshold <= 1.0, f"ESS threshold must lie in [0, 1], got {schedule.ess_threshold}")
    _require(0 <= target.temperature < math.inf, f"target temperature must be >= 0 and finite, got {target.temperature}")
    _require(
        target.temperature > 0 or program.verification == "accept-reject" or proposal is None,
        "smc-sd needs a target temperature > 0 (at T = 0 the target is the single greedy string, which "
        "sampled drafts almost never hit, so every particle would die); use ar or sd for greedy decoding",
    )
    _require(0 < target.alpha < math.inf, f"alpha must be > 0 and finite, got {target.alpha}")
    _require(
        schedule.resampling in RESAMPLING_SCHEMES,
        f"unknown resampling scheme {schedule.resampling!r}; choose one of {sorted(RESAMPLING_SCHEMES)}",
    )
    if proposal is not None:
        free = proposal.free
        if free is not None:
            _require(free.max_len >= 1, f"a free draft's block length must be >= 1, got {free.max_len}")
            _require(free.min_match >= 1, f"a free draft's lookup match must be >= 1 token, got {free.min_match}")
            _require(free.forced or free.lookup, "a free draft needs at least one source (forced tokens or lookup)")
        _require(proposal.draft_len >= 1, f"draft length K must be >= 1, got {proposal.draft_len}")
        _require(0 <= proposal.temperature < math.inf, f"draft temperature must be >= 0 and finite, got {proposal.temperature}")
        _require(
            proposal.temperature > 0 or program.verification == "accept-reject",
            "smc-sd needs a draft temperature > 0: a greedy draft (T_d = 0) proposes one token, "
            "so its importance weights cannot reach the rest of the target",
        )
    if program.verification == "accept-reject":
        _require(proposal is not None, "exact speculative decoding needs a draft model")
        _require(schedule.particles == 1, "exact speculative decoding runs one sequence; set particles to 1")
        _require(target.alpha == 1.0, "exact speculative decoding samples p_T (alpha = 1); use smc-sd for alpha != 1")
    else:
        _require(program.verification == "importance", f"unknown verification {program.verification!r}; choose 'importance' or 'accept-reject'")
    _require(
        not target.potentials or program.verification == "importance",
        "potentials reweight particles; exact speculative decoding has none to reweight, use smc-sd",
    )
    _require(
        program.twist is None or program.verification == "importance",
        "a twist reweights particles; exact speculative decoding has none to reweight, use smc-sd",
    )


def compile_program(program, schedule, prompt_length: int) -> StepPlan:
    """Check a program and a schedule and lower them to a StepPlan.

    Args:
        program: a `smc_sd.program.Program`.
        schedule: a `smc_sd.program.Schedule`.
        prompt_length: tokens in the prompt (for the context-window check).

    Raises:
        ValueError: on any invalid setting, naming it.
        TokenizerMismatchError: when draft and target do not share a tokenizer.
        ContextOverflowError: when prompt + generation cannot fit the models' context windows.
    """
    from smc_sd.constraints.potentials import as_token_constraint, completion_checks

    target, proposal = program.target, program.proposal
    _require(prompt_length >= 1, "the prompt is empty; give at least one token")
    check_settings(program, schedule)
    _require(
        proposal is None or proposal.lm is not None or proposal.free is not None,
        "the proposal has neither a draft model nor a free draft",
    )
    draft_len = 0
    if proposal is not None and proposal.lm is not None:
        check_same_vocabulary(proposal.lm, target.lm)
        draft_len = proposal.draft_len
    # the longest block: the draft LM's K, or a free draft's longest proposal
    block = max(draft_len, proposal.free.max_len if proposal is not None and proposal.free is not None else 0)
    # The last cycle may run past the budget by up to one block + 1 positions before truncation.
    needed = prompt_length + schedule.max_tokens + block + 1
    models = [target.lm] + ([proposal.lm] if proposal is not None and proposal.lm is not None else [])
    for lm in models:
        if needed > lm.max_length:
            raise ContextOverflowError(
                f"prompt ({prompt_length} tokens) + max tokens ({schedule.max_tokens}) + one block "
                f"({block + 1}) needs {needed} positions, but the model's context window is "
                f"{lm.max_length}"
            )
    constraints = tuple(as_token_constraint(c, target.lm) for c in target.constraints)
    potentials = tuple(as_block_potential(p, target.lm) for p in target.potentials)
    # the exact test of what llguidance only over-approximates is phi at completion
    checks = completion_checks(constraints, target.lm)
    _require(
        not checks or program.verification == "importance",
        "this JSON schema is only over-approximated by its masks and checked at completion, which "
        "reweights particles; exact speculative decoding (mask-at-verify) cannot, use smc-sd",
    )
    potentials += checks
    return StepPlan(
        name=program.name,
        verification=program.verification,
        target=target.lm,
        target_temperature=target.temperature,
        alpha=target.alpha,
        draft=proposal.lm if proposal is not None else None,
        free=proposal.free if proposal is not None else None,
        draft_temperature=proposal.temperature if proposal is not None else 1.0,
        particles=schedule.particles,
        draft_len=draft_len,
        ess_threshold=schedule.ess_threshold,
        resampling=schedule.resampling,
        max_tokens=schedule.max_tokens,
        masker=Masker(constraints, target.lm.vocabulary.size, target.lm.vocabulary.eos_token_id) if constraints else None,
        twist=program.twist,
        potential=ProductPotential(potentials) if potentials else None,
    )
