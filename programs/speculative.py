"""Exact speculative decoding: K sampled draft tokens, min(1, p/q) acceptance, residual
max(0, p - q) on rejection, a bonus token on full acceptance. The output is distributed as p_T.

With a free draft (`smc_sd.program.FreeDraft`: tokens found by lookup in the prompt and the
text so far) its proposals are verified where it proposes, a point mass q accepted with
probability p; elsewhere the draft LM drafts, or, without one, the target emits one token."""

from smc_sd.backends.base import LanguageModel
from smc_sd.program import FreeDraft, Program, Proposal, Target

DEFAULT_PARTICLES = 1


def program(
    target: LanguageModel,
    draft: LanguageModel | None,
    *,
    temperature: float = 1.0,
    draft_temperature: float = 1.0,
    draft_len: int = 4,
    free_draft: FreeDraft | None = None,
) -> Program:
    return Program(
        "sd",
        Target(target, temperature=temperature),
        Proposal(draft, temperature=draft_temperature, draft_len=draft_len, free=free_draft),
        verification="accept-reject",
    )
