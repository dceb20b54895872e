"""OpenAI response shapes: chat.completion and text_completion answers, their streamed chunks, the
usage counts, and the `smc` object every choice carries.

The smc object of a choice (non-finite numbers become null, as JSON has no infinities):

    method, seed            the program and the choice's own seed
    log_z                   log Z_hat, SMC's estimate of the log normaliser of the target
    complete                whether the text satisfies the request's constraints (False only when
                            no particle completed one within max_tokens)
    n_particles, resamples, target_passes, draft_passes
    ess                     the effective sample size after every cycle's weight update
    tokens_per_pass         positions every particle advanced per target pass
    acceptance              sd, and any method with the free draft: proposed tokens accepted /
                            proposed; smc-sd with a draft model: mean ESS / N over the cycles
                            (the share of the draws the weights keep); ar: null
    draft                   the draft the choice ran with ("free" or a loaded draft's name;
                            null for ar)
    block_lengths           with the free draft: {L: blocks} the block lengths its cost-aware choice
                            verified (0: a plain decode); null otherwise
    pass_cost               with the free draft: the pass-cost table the choice used (null when the
                            block length was fixed)
    particles               with return_particles: every particle's text and normalised weight
                            (every weight 0 when no particle completed)
"""

from __future__ import annotations

import math
import time
import uuid

from smc_sd.engine.result import Result
from smc_sd.serve.text import cut_at_stop


def finite(value: float) -> float | None:
    """The number, or None when it is infinite or NaN."""
    return value if math.isfinite(value) else None


def acceptance(result: Result, draft_len: int) -> float | None:
    """sd and free drafts: accepted / proposed tokens; smc-sd: mean ESS / N; ar: None (module
    docstring)."""
    proposed = sum(c.proposed for c in result.cycles if c.proposed is not None)
    if proposed:
        return sum(c.accepted or 0 for c in result.cycles) / proposed
    if not result.cycles or draft_len == 0 or any(c.proposed is not None for c in result.cycles):
        return None
    return finite(sum(c.ess / c.particles for c in result.cycles) / len(result.cycles))


def choice_text(result: Result, stop: tuple[str, ...]) -> tuple[str, str]:
    """(the chosen particle's text cut before any of the stop strings `stop`, OpenAI's
    finish_reason: "stop" when its string ended, at EOS or a stop string, complete under the
    request's constraints; else "length")."""
    text, stopped = cut_at_stop(result.text, stop)
    return text, "stop" if (stopped or result.finished[result.chosen]) and result.complete else "length"


def smc_object(result: Result, seed: int, draft_len: int, stop: tuple[str, ...], return_particles: bool) -> dict:
    """The `smc` object of one choice (module docstring)."""
    out = {
        "method": result.method,
        "seed": seed,
        "log_z": finite(result.log_ml),
        "complete": result.complete,
        "n_particles": len(result.particles),
        "resamples": result.resamples,
        "target_passes": result.target_passes,
        "draft_passes": result.draft_passes,
        "ess": [finite(c.ess) for c in result.cycles],
        "tokens_per_pass": (result.positions - 1) / result.target_passes if result.target_passes else None,
        "acceptance": acceptance(result, draft_len),
        "block_lengths": None if result.free_draft is None else result.free_draft["block_lengths"],
        "pass_cost": None if result.free_draft is None else result.free_draft["pass_cost"],
    }
    if return_particles:
        out["particles"] = [{"text": cut_at_stop(result.decode(ids), stop)[0], "weight": w, "finished": f}
                            for ids, w, f in zip(result.particles, result.weights, result.finished)]
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shapes:
    """The answer and chunk objects of one request to `endpoint` ("chat" or "completion")."""

    def __init__(self, endpoint: str, model: str):
        self.endpoint, self.model = endpoint, model
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def answer(self, choices: list[dict], counts: dict) -> dict:
        """The whole non-streamed answer."""
        kind = "chat.completion" if self.endpoint == "chat" else "text_completion"
        return self._envelope(kind, choices) | {"usage": counts}

    def choice(self, index: int, text: str, finish_reason: str, smc: dict) -> dict:
        """One choice of the non-streamed answer."""
        body = {"message": {"role": "assistant", "content": text}} if self.endpoint == "chat" else {"text": text}
        return {"index": index, **body, "logprobs": None, "finish_reason": finish_reason, "smc": smc}

    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None, smc: dict | None = None,
              first: bool = False, with_usage: bool = False) -> dict:
        """One streamed chunk of choice `index`: a text delta, or the end (finish_reason and smc);
        a chat stream's first chunk of a choice carries the assistant role."""
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            kind = "text_completion"
        if smc is not None:
            choice["smc"] = smc
        out = self._envelope(kind, [choice])
        return out | {"usage": None} if with_usage else out

    def usage_chunk(self, counts: dict) -> dict:
        """The last chunk of a stream with stream_options.include_usage: no choices, the counts."""
        kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return self._envelope(kind, []) | {"usage": counts}
