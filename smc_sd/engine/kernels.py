"""The tensor cores of an engine cycle, run eagerly or compiled by `torch.compile`.

Most of a cycle's work over the vocabulary sits in three pure functions of tensors:
`block_scores.score_rows` (an importance verification's log-softmax over [A, K + 1, V], the
drafted tokens' scores, the bonus draws and the weight increments),
`accept_scores.accept_scores` (an accept/reject verification's log-softmax over the P positions
its rows read, their normalisers, the first rejections and the emitted tokens) and
`sampling.tokens_and_logprobs` (a draft step's draws over [A, V] and their log q). A fourth,
`keyed_random.keyed_uniforms`, hashes every draw's key into its uniforms: about 70 integer
operators on a few rows, eagerly. Run eagerly, each is a sequence of torch operators, every one
a pass over memory (on a GPU, a kernel launch). Compiled by inductor, each becomes a few fused
loops (the hash one: integer operations are exact, so its uniforms are the eager ones bit for
bit).

An engine built with `compile_step=True` lends the compiled functions to its cycles
(`smc_sd.engine.cycle_locals`); everywhere else the eager ones run. They are compiled with symbolic
sizes (`dynamic=True`): a graph per combination of the arguments that are None or not and of
the flags, whatever the number of rows, K or V (dynamo compiles sizes 0 and 1 apart: the
accept/reject rows and columns, which move with what free drafts propose, are padded to at
least 2 by `speculative_step.accept_rows`), so no shape the engine meets compiles again, and
a row's results do not depend on the rows beside it (`tests/test_kernels.py`). Compiled
and eager results have the same tokens and agree within float32 rounding in the increments
and log q: inductor sums in another order (`tests/test_compiled_step.py`). Each graph compiles
at its first call, seconds on a CPU, once per process; on a CPU inductor needs a C++ compiler,
and where it cannot compile, the call raises one line naming `compile_step` and the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from smc_sd.engine.accept_scores import accept_scores
from smc_sd.engine.block_scores import score_rows
from smc_sd.engine.cycle_locals import lent
from smc_sd.engine.keyed_random import counter, keyed_uniform, keyed_uniforms
from smc_sd.engine.sampling import tokens_and_logprobs

_COMPILED: list[StepKernels] = []


@dataclass(frozen=True)
class StepKernels:
    """The functions a cycle calls for its verification scores, its draft draws and their
    uniforms."""

    score_rows: Callable
    tokens_and_logprobs: Callable
    keyed_uniforms: Callable
    accept_scores: Callable

    @staticmethod
    def of(compiled: bool) -> StepKernels:
        """The eager functions, or the process's compiled ones (made once)."""
        if not compiled:
            return EAGER
        if not _COMPILED:
            _COMPILED.append(StepKernels(compile_kernel(score_rows, masks=(3,)), compile_kernel(tokens_and_logprobs), flat_uniforms(compile_kernel(keyed_uniform)), compile_kernel(accept_scores, moving_sizes=True, masks=(4,))))
        return _COMPILED[0]


EAGER = StepKernels(score_rows, tokens_and_logprobs, keyed_uniforms, accept_scores)


def flat_uniforms(hash_: Callable) -> Callable:
    """`keyed_uniforms` whose hash is `hash_` applied to the keys and counters flattened to one
    contiguous axis: two graphs of the hash (one uniform, and more) serve every shape of draw.
    Dynamo specialises sizes of 0 and 1 and zero strides, so [A] uniforms, [G, N] and [U, M] in
    their own shapes would compile a graph for every pattern of those among them."""

    def uniforms(key: torch.Tensor, cycle, particle, position, stream: int) -> torch.Tensor:
        keys, count = torch.broadcast_tensors(key, counter(cycle, particle, position, stream))
        if count.numel() == 0:
            return torch.empty(count.shape, dtype=torch.float64, device=count.device)
        return hash_(keys.reshape(-1).contiguous(), count.reshape(-1).contiguous()).view(count.shape)

    return uniforms


def compile_kernel(function: Callable, moving_sizes: bool = False, masks: tuple[int, ...] = ()) -> Callable:
    """`function` compiled with symbolic sizes; a failure to compile it raises a RuntimeError of
    one line that names `compile_step` and the compiler's first line.

    The arguments at `masks` (vocabulary masks, bool or None) reach the compiled function as
    their uint8 views (the same bytes; `sampling.allowed` reads them back): inductor's CPU loops
    load a bool tensor into vector masks slowly, a masked logsumexp over [66, 49,152] 8.7 ms
    against 1.8 ms from the bytes (one thread).

    With `moving_sizes` (a kernel whose sizes change from one cycle to the next), sizes equal
    at the first call are not assumed equal after it: dynamo would otherwise compile a graph
    for each pattern of equal sizes (duck sizing), inside the cycles that meet them."""
    graph = torch.compile(function, dynamic=True)
    sizes = {"use_duck_shape": False} if moving_sizes else {}

    def call(*args):
        args = tuple(a.view(torch.uint8) if i in masks and a is not None else a for i, a in enumerate(args))
        try:
            with torch.fx.experimental._config.patch(**sizes):
                return graph(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            cause = str(error).strip().splitlines()[0]
            raise RuntimeError(f"compile_step: torch.compile could not compile {function.__name__} ({cause}); run without compile_step") from error

    return call


def current() -> StepKernels:
    """The running engine's kernels, or the eager ones outside an engine cycle."""
    return lent("kernels") or EAGER
