"""The program's parts as frozen dataclasses; `Program.run` runs them on the engine (`smc_sd.api`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import torch

from smc_sd.backends.base import LanguageModel
from smc_sd.compiler.free_draft import FreeDraft

if TYPE_CHECKING:
    from smc_sd.engine.result import CycleStats, Result


@dataclass(frozen=True)
class Target:
    """The distribution to sample: pi(x) ∝ p_T(x)^alpha · prod_c phi_c(x) over constraints and potentials.

    Attributes:
        lm: the target language model.
        temperature: T > 0; p_T = softmax(logits / T).
        alpha: power > 0 (1 = plain sampling at temperature T).
        constraints: boolean potentials phi_c in {0, 1}: `TokenConstraint`s, `Language`s
            (`smc_sd.constraints.languages`: a regex, Lark grammar or JSON schema), or genlm-control
            `Potential`s over bytes or over the LM's tokens (`Regex`, `Grammar`, `JsonSchema`
            from `smc_sd.constraints.grammars`, genlm-control's BoolFSA, BoolCFG, JsonSchema, user
            subclasses), lowered to token masks by the compiler (llguidance where it can). They
            mask the draft and the bonus token; their masked normalisers enter the weights, and a
            string the token budget leaves incomplete gets weight zero.
        potentials: positive potentials phi_c scored at block end on whole prefixes
            (`smc_sd.constraints.scores.BlockPotential`s, or genlm-control `Potential`s over bytes):
            log w += log phi(new prefix) - log phi(old prefix), complete scores at EOS.
    """

    lm: LanguageModel
    temperature: float = 1.0
    alpha: float = 1.0
    constraints: tuple = ()
    potentials: tuple = ()


@dataclass(frozen=True)
class Proposal:
    """Where tokens come from: a free draft where it proposes, a draft LM elsewhere.

    Attributes:
        lm: the draft language model (must share the target's tokenizer), or None with a free
            draft alone (a block with nothing proposed is one target token, as autoregressive).
        temperature: T_d > 0; q = softmax(draft logits / T_d).
        draft_len: K >= 1 tokens the draft LM proposes per particle per cycle.
        free: model-free sources whose tokens enter the block where they propose, or None.
    """

    lm: LanguageModel | None
    temperature: float = 1.0
    draft_len: int = 4
    free: FreeDraft | None = None


@dataclass(frozen=True)
class Schedule:
    """How the particles run.

    Attributes:
        particles: N >= 1.
        ess_threshold: tau in [0, 1]; resample when ESS < tau N (0 = never).
        resampling: "systematic", "multinomial", "stratified" or "residual".
        max_tokens: generated tokens per particle, at most.
    """

    particles: int = 4
    ess_threshold: float = 0.5
    resampling: str = "systematic"
    max_tokens: int = 128


Verification = Literal["importance", "accept-reject"]

#: log psi of a batch of generated prefixes: list of B token-id lists -> [B] float tensor
Twist = Callable[[list[list[int]]], torch.Tensor]


@dataclass(frozen=True)
class Program:
    """A decoding program.

    Attributes:
        name: what results call the method ("ar", "sd", "smc-sd", ...).
        target: the distribution to sample.
        proposal: the draft, or None to propose one token per cycle from the target (K = 0).
        verification: "importance" weights every particle by target / proposal and resamples
            (SMC-SD); "accept-reject" is exact speculative decoding (one particle, min(1, p/q)
            acceptance, residual resampling), whose output distribution is p_T exactly; with
            constraints both p and q are masked and renormalised per token (mask-at-verify), so
            it samples the locally projected distribution, not the conditional.
        twist: an optional critic log psi on generated prefixes, called with a batch of
            unfinished prefixes (lists of token ids) and returning [B] float log psi. It is
            added to the weights at every block end and removed at the next block end and at
            the end (log w += log psi(new prefix) - log psi(old prefix)); finished particles
            carry no twist. It changes when SMC resamples, not what it targets.
    """

    name: str
    target: Target
    proposal: Proposal | None = None
    verification: Verification = "importance"
    twist: Twist | None = None

    def run(
        self,
        prompt: str | list[int],
        schedule: Schedule = Schedule(),
        seed: int = 0,
        on_cycle: Callable[[CycleStats, list[list[int]]], None] | None = None,
        raw: bool = False,
    ) -> Result:
        """Run the program on one prompt (`smc_sd.api.run`: the batched engine with one request).

        Args:
            prompt: text, wrapped in the target's chat template as `smc-sd generate` wraps it
                (with `raw`, encoded as is), or prompt token ids (non-empty), used as given.
            schedule: particles, resampling and token budget.
            seed: seeds the run's own random generator; equal seeds give equal results.
            on_cycle: called after every cycle with its stats and the particles' token ids.
            raw: encode a text prompt without the chat template.

        Warns:
            IncompleteResultWarning: no particle completed a string the constraints accept
                within the budget (`Result.complete` False, ESS 0).
        """
        from smc_sd.api import run

        return run(self, prompt, schedule, seed=seed, on_cycle=on_cycle, raw=raw)

    def run_many(
        self,
        prompts: list[str | list[int]],
        schedule: Schedule = Schedule(),
        seeds: list[int] | None = None,
        max_running: int = 32,
        raw: bool = False,
        compile_step: bool = False,
    ) -> list[Result]:
        """Run the program on many prompts in one batch (`smc_sd.api.run_many`): the
        particles of up to `max_running` prompts share every target and draft pass, and
        result i is what `run(prompts[i], schedule, seed=seeds[i], raw=raw)` returns (seeds
        default to 0; prompts are text or token ids, as for `run`). `compile_step`: the
        engine's verification scores and draft draws run compiled (`smc_sd.engine.kernels`).
        """
        from smc_sd.api import run_many

        return run_many(self, prompts, schedule, seeds=seeds, max_running=max_running, raw=raw, compile_step=compile_step)

    def smc(
        self,
        prompt: str | list[int],
        n_particles: int,
        ess_threshold: float = 0.5,
        max_tokens: int = 128,
        resampling: str = "systematic",
        seed: int = 0,
        raw: bool = False,
    ) -> Result:
        """genlm-control style entry point: `run` with the schedule spelled out."""
        schedule = Schedule(n_particles, ess_threshold, resampling, max_tokens)
        return self.run(prompt, schedule, seed=seed, raw=raw)
