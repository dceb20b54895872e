"""What a run returns: every particle, its weight, log Z_hat, and a per-cycle diagnostics trace.

The interface follows genlm-control's `Sequences`: `posterior` and `decoded_posterior` map
outputs to normalised weights, `log_ml` is the log marginal-likelihood estimate log Z_hat and
`ess` the final effective sample size. The speculative diagnostics ride along in `cycles`.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from smc_sd.engine.resampling import effective_sample_size, normalised_weights

#: an ESS at or below this means the weights sit on about one particle
COLLAPSED_ESS = 1.5
#: a run whose weights collapsed in at least this fraction of its cycles is flagged unreliable
UNRELIABLE_FRACTION = 0.5


@dataclass(frozen=True)
class CycleStats:
    """Diagnostics of one cycle (one target pass).

    Attributes:
        ess: effective sample size after the cycle's weight update, before any resampling.
        resampled: whether the cycle resampled.
        log_z: log Z_hat accumulated up to and including this cycle's resampling.
        tokens: positions each particle advanced (K + 1, fewer when the token budget cut in).
        particles: N.
        accepted: for exact speculative decoding, draft tokens accepted (else None).
        proposed: for exact speculative decoding, draft tokens the pass verified (K for a draft
            LM's block, the proposal's length for a free draft's, 0 for a plain target step).
        rows: for SMC-SD, the particles that cost a forward in this cycle (the unfinished ones).
    """

    ess: float
    resampled: bool
    log_z: float
    tokens: int
    particles: int
    accepted: int | None = None
    rows: int | None = None
    proposed: int | None = None

    @property
    def chi_square(self) -> float:
        """N / ESS - 1, an estimate of the chi-square divergence of target from proposal."""
        return math.inf if self.ess == 0 else self.particles / self.ess - 1


@dataclass
class Result:
    """The outcome of one run.

    Attributes:
        method: the program's name.
        prompt: prompt token ids.
        particles: N lists of generated token ids (each ends at its EOS, if any).
        finished: N flags, True where the particle produced EOS.
        log_weights: [N] float64 final log weights, relative to the last resampling; all -inf
            (every weight zero) when no particle completed (`complete` False).
        log_ml: log Z_hat, the log of SMC's unbiased estimate of the target's normaliser.
        chosen: index of the returned particle, drawn ∝ final weights.
        cycles: one CycleStats per target pass after the prompt's.
        target_passes: target forward calls after the prompt's.
        draft_passes: draft forward calls.
        seconds: wall time of the run.
        decode: token ids to text.
        kv: KV-cache bytes of target and draft together, or None without a KV cache:
            `peak_bytes` (the most storage at once, shared blocks counted once) and
            `naive_peak_bytes` (what full copies per row would have taken), of this request's
            own rows (`scope` "request", the hf backend), or of the engine's rows at the
            request's end where a backend cannot attribute KV to rows (`scope` "engine", with
            `kv_memory`'s other fields).
        mask_seconds: wall time spent computing constraint masks (0 when unconstrained).
        mask_row_seconds: per mask call, its wall time over its live rows: seconds per
            particle-position, drafted positions included (empty when unconstrained).
        complete: whether the returned particle's string satisfies the constraints (it ended
            with EOS or its string is complete); False only when no particle was complete at
            the token budget. Always True without constraints.
        free_draft: with a free draft, what its block-length choice did
            (`FreeDrafter.report`: block lengths chosen, the pass cost used, the running
            acceptance); None otherwise.
    """

    method: str
    prompt: list[int]
    particles: list[list[int]]
    finished: list[bool]
    log_weights: torch.Tensor
    log_ml: float
    chosen: int
    cycles: list[CycleStats]
    target_passes: int
    draft_passes: int
    seconds: float
    decode: Callable[[list[int]], str] = field(repr=False, default=str)
    kv: dict | None = None
    mask_seconds: float = 0.0
    mask_row_seconds: tuple[float, ...] = ()
    complete: bool = True
    free_draft: dict | None = None

    @property
    def tokens(self) -> list[int]:
        """The returned particle's generated token ids."""
        return self.particles[self.chosen]

    @property
    def text(self) -> str:
        """The returned particle's text."""
        return self.decode(self.tokens)

    @property
    def ess(self) -> float:
        """Effective sample size of the final weights: 0 when every weight is zero."""
        return effective_sample_size(self.log_weights)

    @property
    def weights(self) -> list[float]:
        """The final weights normalised to sum 1; all 0.0 when every weight is zero."""
        if not torch.isfinite(self.log_weights).any():
            return [0.0] * len(self.particles)
        return normalised_weights(self.log_weights).tolist()

    @property
    def positions(self) -> int:
        """Positions every particle slot advanced: the first token plus each cycle's tokens.

        Particles run in lockstep until all have finished, so a returned particle that ended
        early still cost the passes of the longest one: target_passes = ceil((positions - 1) /
        (K + 1)) for SMC-SD.
        """
        return 1 + sum(c.tokens for c in self.cycles)

    @property
    def resamples(self) -> int:
        """Number of cycles that resampled."""
        return sum(c.resampled for c in self.cycles)

    @property
    def acceptance(self) -> float | None:
        """Draft tokens accepted over draft tokens verified (exact speculative decoding), or
        None when no cycle verified a draft token."""
        proposed = sum(c.proposed or 0 for c in self.cycles)
        if proposed == 0:
            return None
        return sum(c.accepted or 0 for c in self.cycles) / proposed

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens of the returned particle per second of wall time."""
        return len(self.tokens) / self.seconds if self.seconds > 0 else math.inf

    @property
    def posterior(self) -> dict[tuple[int, ...], float]:
        """Token sequences to normalised weight (particles with equal tokens merged)."""
        return self._aggregate(lambda ids: tuple(ids), only_finished=False)

    @property
    def decoded_posterior(self) -> dict[str, float]:
        """Text of finished particles to normalised weight (renormalised over finished ones)."""
        return self._aggregate(self.decode, only_finished=True)

    def _aggregate(self, key, only_finished: bool) -> dict:
        logw = self.log_weights.clone()
        if only_finished:
            logw[~torch.tensor(self.finished, dtype=torch.bool)] = -math.inf
        if not torch.isfinite(logw).any():
            return {}
        weights = normalised_weights(logw)
        out: dict = defaultdict(float)
        for ids, w in zip(self.particles, weights.tolist()):
            if w > 0:
                out[key(ids)] += w
        return dict(out)

    @property
    def collapsed_fraction(self) -> float:
        """The fraction of cycles whose ESS after reweighting was at most `COLLAPSED_ESS`.

        With N >= 2 particles, an ESS of about one means one particle carried the weight: the
        cycle's proposal was far from the target, and a run that collapses in most cycles
        returns text that follows the draft more than the target. 0 for one particle or no cycle.
        """
        counted = [c for c in self.cycles if c.particles >= 2]
        if not counted:
            return 0.0
        return sum(c.ess <= COLLAPSED_ESS for c in counted) / len(counted)

    @property
    def reliability_warning(self) -> str | None:
        """One line saying the sample is unreliable when the weights collapsed in at least
        `UNRELIABLE_FRACTION` of the cycles, with what to do; None otherwise."""
        fraction = self.collapsed_fraction
        if fraction < UNRELIABLE_FRACTION:
            return None
        counted = sum(c.particles >= 2 for c in self.cycles)
        return (
            f"the weights collapsed to about one particle (ESS <= {COLLAPSED_ESS} of {len(self.particles)}) in "
            f"{round(fraction * counted)} of {counted} cycles, so this sample follows the draft more than the "
            "target; use more particles, a draft closer to the target, or exact speculative decoding (--method sd)"
        )

    def to_json(self) -> dict:
        """The machine-readable summary `smc-sd generate --json` prints."""
        return {
            "method": self.method,
            "text": self.text,
            "new_tokens": len(self.tokens),
            "positions": self.positions,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "target_passes": self.target_passes,
            "draft_passes": self.draft_passes,
            "particles": len(self.particles),
            "resamples": self.resamples,
            "ess": [c.ess for c in self.cycles],
            "log_z": self.log_ml,
            "finished": self.finished[self.chosen],
            "complete": self.complete,
            "kv_peak_bytes": None if self.kv is None else self.kv["peak_bytes"],
            "kv_naive_bytes": None if self.kv is None else self.kv["naive_peak_bytes"],
            "mask_seconds": self.mask_seconds,
            "collapsed_fraction": self.collapsed_fraction,
            "acceptance": self.acceptance,
            "block_lengths": None if self.free_draft is None else self.free_draft["block_lengths"],
            "pass_cost": None if self.free_draft is None else self.free_draft["pass_cost"],
        }


def mask_stats(masker) -> dict:
    """The `mask_seconds` and `mask_row_seconds` of a run whose masks came from `masker` (or None)."""
    if masker is None:
        return {"mask_seconds": 0.0, "mask_row_seconds": ()}
    return {"mask_seconds": masker.seconds, "mask_row_seconds": tuple(masker.row_seconds)}


def kv_memory(*rows) -> dict | None:
    """The KV-cache statistics of several models' rows (target, draft), summed field by field.

    Each peak is the largest value one model's rows reached; their sum bounds the peak of both
    together. `naive_peak_bytes` is what a cache giving every row a full copy would have needed.

    Args:
        rows: `Sequences` (or None, for an absent draft).

    Returns:
        {field: sum} over the rows' `memory()` dicts, or None when none reports one.
    """
    stats = [r.memory() for r in rows if r is not None]
    stats = [s for s in stats if s is not None]
    if not stats:
        return None
    fields = set.intersection(*(set(s) for s in stats)) - {"block_size"}
    return {name: sum(s[name] for s in stats) for name in sorted(fields)}


class IncompleteResultWarning(UserWarning):
    """No particle completed a string the constraints accept within the token budget: the
    returned text is cut off (`Result.complete` is False), every final weight is zero (`ess` 0,
    `log_ml` -inf). Filter it as any warning category, e.g.
    `warnings.simplefilter("error", smc_sd.IncompleteResultWarning)`."""


def incomplete_message(max_tokens: int, budget: str) -> str:
    """What `IncompleteResultWarning` says; `budget` names the setting to raise."""
    return (f"no particle completed a string the constraints accept within {max_tokens} tokens; "
            f"the output is cut off (raise {budget})")


def warn_if_incomplete(result: Result, max_tokens: int) -> Result:
    """`result`, after an `IncompleteResultWarning` if it is incomplete, attributed to the first
    caller outside smc_sd (the user's line)."""
    if not result.complete:
        warnings.warn(incomplete_message(max_tokens, "the schedule's max_tokens"), IncompleteResultWarning, stacklevel=_outside_stacklevel())
    return result


def _outside_stacklevel() -> int:
    """The `stacklevel` that names the first frame outside smc_sd, for a warning issued by the
    function calling this one."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("smc_sd"):
        frame, level = frame.f_back, level + 1
    return level


class AllParticlesDiedError(RuntimeError):
    """Every particle reached weight zero; `partial` holds the run up to that point."""

    def __init__(self, message: str, partial: Result):
        super().__init__(message)
        self.partial = partial
