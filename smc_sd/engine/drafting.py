"""Drafting: K tokens per particle from the (masked) draft, and the masks of one cycle.

Both loops (SMC-SD in `smc_sd.engine.smc`, exact speculative decoding in
`smc_sd.engine.speculative`) draft the same way: the draft reads the tokens it has not seen,
then proposes x_1..x_K ~ q~(. | prefix) one [N, 1] forward at a time, recording log q~ of every
position, so the q in every weight and acceptance test is exactly the distribution sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smc_sd.constraints.token_constraints import UnsatisfiableConstraintError
from smc_sd.engine import kernels
from smc_sd.engine.keyed_random import DRAFT
from smc_sd.engine.masking import masked_logprobs
from smc_sd.engine.sampling import gather_last, scaling, tempered_logprobs_rows, tokens_from_uniforms


@dataclass
class DraftBlock:
    """K drafted tokens per particle and the distributions they were drawn from.

    Attributes:
        tokens: [N, K] int64.
        drawn_logq: [N, K] float32 log q~(x_k) of each drafted token: what an importance weight
            reads.
        logq: [N, K, V] float32 log q~ at each drafted position: the draft at temperature T_d,
            masked by the constraints and renormalised (q itself when unconstrained); None
            unless the drafter keeps it (`BlockDrafter` keep_logq: exact acceptance reads q~
            whole, importance weights `drawn_logq` alone).
        masks: [N, K, V] bool constraint masks at each position, or None when unconstrained.
        dead: [N, K] bool, positions where q~ does not exist (the mask allowed no token, or only
            tokens of draft probability zero), or None. Their tokens were drawn unmasked and the
            particle must get weight zero.
    """

    tokens: torch.Tensor
    drawn_logq: torch.Tensor
    logq: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    dead: torch.Tensor | None = None

    @staticmethod
    def empty(rows: int, vocab_size: int) -> "DraftBlock":
        """No drafted token (K = 0) for `rows` rows."""
        return DraftBlock(torch.empty(rows, 0, dtype=torch.long), torch.empty(rows, 0), torch.empty(rows, 0, vocab_size))


@dataclass(frozen=True)
class DrawKeys:
    """What keys each row's draws (`smc_sd.engine.keyed_random`): the uniform of row a's j-th
    drafted token is keyed_uniform(request_key[a], counter(cycle[a], particle[a], j, DRAFT)), so
    a row draws the same tokens alone or among any others.

    Attributes:
        request_key, cycle, particle: [N] int64: each row's request key (`Group.key`: `seed_key`
            of its seed), the request's cycle and the row's particle index within its request.
    """

    request_key: torch.Tensor
    cycle: torch.Tensor
    particle: torch.Tensor

    @staticmethod
    def of(request_key: int, cycle: int, particles: torch.Tensor) -> "DrawKeys":
        """The keys of one request's rows: its particles [N] int64 at one cycle."""
        n = particles.numel()
        return DrawKeys(torch.full((n,), request_key, dtype=torch.int64), torch.full((n,), cycle, dtype=torch.int64), particles)


class BlockDrafter:
    """One cycle's draft draws for N rows, one position at a time.

    `draw` turns the draft's next-token logits into q~ = softmax(logits / T_d) · m / Z_q (the
    constraint mask m of the tokens drafted so far, when there is one), draws a token per row
    from it with keyed uniforms and records log q~; the engine batches the draft's forwards over
    every request and hands each drafter its rows' logits. One drafter serves the unconstrained
    rows of many requests at once (a temperature per row), or one request's constrained rows.

    Args:
        temperature: [N] float32, T_d of each row.
        greedy: whether some row's T_d is 0 (known from the plans without reading the tensor).
        keys: the rows' `DrawKeys`.
        mask_at: maps the tokens drafted so far, [N, j] int64, to the constraint mask before
            position j + 1 ([N, V] bool) and its dead rows ([N] bool); None when unconstrained.
        scaled: whether some row's T_d is neither 0 nor 1 (`sampling.scaling`).
        keep_logq: whether the block keeps log q~ whole at every position (`DraftBlock.logq`).
    """

    def __init__(self, temperature: torch.Tensor, greedy: bool, keys: DrawKeys, mask_at=None, scaled: bool = True, keep_logq: bool = False):
        self.n, self.temperature, self.greedy, self.keys, self.mask_at = temperature.numel(), temperature, greedy, keys, mask_at
        self.scaled, self.keep_logq = scaled, keep_logq
        self.drafted, self.drawn_logq, self.logq, self.masks, self.dead = [], [], [], [], []
        # the block of the draws so far, stacked once however often it is asked for
        self._block: DraftBlock | None = None

    @staticmethod
    def for_request(temperature: float, key: int, cycle: int, particles: torch.Tensor, mask_at=None, keep_logq: bool = False) -> "BlockDrafter":
        """The drafter of one request's rows: its particles [N] int64 at one cycle, all at T_d."""
        keys = DrawKeys.of(key, cycle, particles)
        return BlockDrafter(torch.full(particles.shape, temperature), temperature == 0, keys, mask_at, scaling([temperature]), keep_logq)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """Draw the next drafted token of every row.

        Without a mask, at T_d > 0 and when log q~ is not kept whole, the token is drawn from
        the weights exp(z - max z), z = logits / T_d (`sampling.tokens_and_logprobs`), and its
        log q is read off their total: no log-softmax over the vocabulary.

        Args:
            logits: [N, V] float32 draft logits after the last token fed.

        Returns:
            [N] int64 tokens.
        """
        keys = self.keys
        cores = kernels.current()
        u = cores.keyed_uniforms(keys.request_key, keys.cycle, keys.particle, len(self.drafted), DRAFT)
        if self.mask_at is None and not self.greedy and not self.keep_logq:
            z = logits / self.temperature[:, None] if self.scaled else logits
            token, drawn = cores.tokens_and_logprobs(z, u)
        else:
            if self.mask_at is None:
                # [N, V]: next-token distribution after the last fed token
                logq_next = tempered_logprobs_rows(logits, self.temperature, greedy=self.greedy, scaled=self.scaled)
            else:
                # [N, j]: the tokens drafted so far
                so_far = torch.stack(self.drafted, 1) if self.drafted else torch.empty(self.n, 0, dtype=torch.long)
                mask, _ = self.mask_at(so_far)
                # [N, V] q~; rows that are not live have all-one masks, so only live rows can lack mass
                logq_next, no_mass = masked_logprobs(logits, self.temperature, mask, self.greedy)
                self.masks.append(mask)
                self.dead.append(no_mass)
            token = tokens_from_uniforms(logq_next, u)
            drawn = gather_last(logq_next, token)
            if self.keep_logq:
                self.logq.append(logq_next)
        self._block = None
        self.drafted.append(token)
        self.drawn_logq.append(drawn)
        return token

    def block(self, vocab_size: int) -> DraftBlock:
        """The tokens drawn so far (K = the number of `draw` calls, possibly 0) as a DraftBlock."""
        if self._block is not None:
            return self._block
        if not self.drafted:
            self._block = DraftBlock.empty(self.n, vocab_size)
        else:
            logq = torch.stack(self.logq, 1) if self.keep_logq else None
            self._block = DraftBlock(torch.stack(self.drafted, 1), torch.stack(self.drawn_logq, 1), logq)
            if self.mask_at is not None:
                self._block.masks, self._block.dead = torch.stack(self.masks, 1), torch.stack(self.dead, 1)
        return self._block


def block_masks(masker, prefixes: list[list[int]], live: torch.Tensor | list[bool], eos: int):
    """The `mask_at` of one cycle: masks after each particle's prefix plus the block so far.

    Args:
        masker: a `Masker`.
        prefixes: N lists of generated tokens before the cycle.
        live: [N] bool (a tensor or a list), particles that are unfinished and have nonzero weight.

    Returns:
        mask_at(drafted [N, j] int64) -> (mask [N, V] bool, dead [N] bool); rows with an EOS
        among the drafted tokens are no longer live.
    """
    # in Python lists: a torch call costs tens of microseconds right after a model pass
    flags = live.tolist() if isinstance(live, torch.Tensor) else live

    def mask_at(drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = drafted.tolist()
        rows = [prefix + block for prefix, block in zip(prefixes, blocks)]
        return masker(rows, [alive and eos not in block for alive, block in zip(flags, blocks)])

    return mask_at


def trim_at_eos(ids: list[int], eos: int) -> list[int]:
    """Token ids up to and including the first EOS."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def first_token_mask(masker) -> torch.Tensor | None:
    """[V] bool mask of the first generated token, or None when unconstrained.

    Raises:
        UnsatisfiableConstraintError: if the constraints allow no first token (not even EOS).
    """
    if masker is None:
        return None
    mask, dead = masker([[]], torch.ones(1, dtype=torch.bool))
    if bool(dead[0]):
        raise UnsatisfiableConstraintError("the constraints admit no string: no first token satisfies them")
    return mask[0]
