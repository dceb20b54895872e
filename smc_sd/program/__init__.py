"""The decoding-program DSL: what a user writes.

A `Program` names its target (LM, temperature T, power alpha), its proposal (a draft LM, its
temperature and the block length K, or None to propose from the target itself) and how drafts are
verified (importance weights, i.e. SMC-SD, or exact accept/reject). A `Schedule` says how many
particles run, when they resample and for how long. The target distribution over completions x is

    pi(x) ∝ p_T(x)^alpha,   p_T = softmax(logits / T) token by token.

    >>> program = Program("smc-sd", Target(target_lm), Proposal(draft_lm, draft_len=4))
    >>> result = program.smc(prompt_ids, n_particles=8, ess_threshold=0.5, max_tokens=64)
    >>> result.text, result.log_ml, [c.ess for c in result.cycles]
"""

from smc_sd.program.spec import FreeDraft, Program, Proposal, Schedule, Target

__all__ = ["FreeDraft", "Program", "Proposal", "Schedule", "Target"]
