"""What a caller of the batched engine holds: a Request to submit, the Handle it gets back, and
the Events its listener receives (`smc_sd.engine.batch`).

A request's listener is called in the engine's thread, once per cycle at most: "tokens" when the
tokens every particle agrees on grew, then exactly one "done" (with the Result) or "error"
(with what failed it: a CancelledError after `Handle.cancel`). The agreed tokens only grow, and
the Result's tokens continue them, so a stream of "tokens" events followed by the rest of the
returned particle at "done" spells the returned particle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from smc_sd.engine.result import Result


class QueueFullError(RuntimeError):
    """`submit` found `max_waiting` requests waiting."""


@dataclass(frozen=True)
class Request:
    """One request.

    Attributes:
        prompt: prompt token ids (non-empty).
        program: the `smc_sd.program.Program`; its target.lm and proposal.lm are the engine's.
        schedule: particles N, ess_threshold, resampling, max_tokens.
        seed: keys the request's draws (`smc_sd.engine.keyed_random`) and seeds its own generator (equal seeds, equal results).
        stop: stop strings; a particle whose generated text contains one finishes at the token
            that completed it.
    """

    prompt: list[int]
    program: object
    schedule: object
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Event:
    """What a request's `on_event` receives, in the engine's thread.

    Attributes:
        kind: "tokens" (the agreed tokens grew), "done" or "error".
        stable_tokens: the generated tokens every particle agrees on so far (only grows); at
            "done" the returned particle's tokens.
        result: the Result, at "done".
        error: what failed the request, at "error" (CancelledError after `cancel`).
    """

    kind: Literal["tokens", "done", "error"]
    stable_tokens: list[int]
    result: Result | None = None
    error: BaseException | None = None


class Handle:
    """A submitted request: cancel it, or wait for its Result."""

    def __init__(self):
        self._finished = threading.Event()
        self._result: Result | None = None
        self._error: BaseException | None = None
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def cancel(self) -> None:
        """Ask the engine to drop the request (thread-safe); its rows and KV are freed at the
        next cycle and `result` raises CancelledError."""
        self.cancelled = True

    def result(self, timeout: float | None = None) -> Result:
        """The Result, once the request is done; raises what failed it.

        Raises:
            TimeoutError: if it is not done within `timeout` seconds.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the request is not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _settle(self, result: Result | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._finished.set()
