"""Exact tabular language models over tiny vocabularies, for tests and tutorials.

A `ToyLM` gives next-token logits as a deterministic function of the whole context, so the
distribution of every completion can be enumerated: `completion_distribution` returns
pi(x) ∝ prod_t p_T(x_t | x_<t)^alpha over completions that end in EOS or reach the token budget,
with its normaliser Z. Token 0..V-2 are letters "a", "b", ...; token V-1 is EOS.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

from smc_sd.backends.base import LanguageModel, Sequences, Vocabulary, check_join, check_truncate_rows

LogitsFn = Callable[[tuple[int, ...]], torch.Tensor]


class ToyLM(LanguageModel):
    """A language model given by a function from context to next-token logits.

    Args:
        next_logits: maps a context (prompt + generated ids) to [V] float32 logits.
        vocab_size: V >= 2; the last id is EOS.
        max_length: the context window.
        name: a label; models with equal vocab_size share a vocabulary fingerprint.
    """

    def __init__(self, next_logits: LogitsFn, vocab_size: int, max_length: int = 256, name: str = "toy"):
        if vocab_size < 2:
            raise ValueError(f"a toy vocabulary needs at least one letter and EOS, got size {vocab_size}")
        self._next_logits = next_logits
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._vocabulary = Vocabulary(vocab_size, vocab_size - 1, f"toy-{vocab_size}")
        self._max_length = max_length
        self.name = name
        self.forward_calls = 0

    @classmethod
    def random(cls, vocab_size: int = 4, seed: int = 0, scale: float = 1.5, eos: bool = True, **kwargs) -> "ToyLM":
        """Logits ~ scale · N(0, 1), drawn afresh (and reproducibly) for every context; with
        eos=False the EOS logit is -inf, so every completion runs to the token budget."""

        def next_logits(context: tuple[int, ...]) -> torch.Tensor:
            key = zlib.crc32(repr((seed, context)).encode())
            logits = scale * torch.randn(vocab_size, generator=torch.Generator().manual_seed(key))
            if not eos:
                logits[-1] = -math.inf
            return logits

        return cls(next_logits, vocab_size, name=f"random(seed={seed})", **kwargs)

    @classmethod
    def perturbed(cls, base: "ToyLM", noise: float, seed: int = 1) -> "ToyLM":
        """A draft near `base`: its logits plus noise · N(0, 1), fixed per context."""
        v = base.vocabulary.size

        def next_logits(context: tuple[int, ...]) -> torch.Tensor:
            key = zlib.crc32(repr((seed, "noise", context)).encode())
            return base.logits(context) + noise * torch.randn(v, generator=torch.Generator().manual_seed(key))

        return cls(next_logits, v, max_length=base.max_length, name=f"{base.name}+noise({noise})")

    @property
    def vocabulary(self) -> Vocabulary:
        return self._vocabulary

    @property
    def max_length(self) -> int:
        return self._max_length

    def logits(self, context: tuple[int, ...]) -> torch.Tensor:
        """[V] float32 next-token logits after `context` (memoised)."""
        if context not in self._cache:
            self._cache[context] = self._next_logits(context).float()
        return self._cache[context]

    def open(self, prompt: list[int], batch_size: int) -> tuple["ToySequences", torch.Tensor]:
        if len(prompt) == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.forward_calls += 1
        return ToySequences(self, [list(prompt) for _ in range(batch_size)]), self.logits(tuple(prompt))

    def decode(self, token_ids: list[int]) -> str:
        eos = self._vocabulary.eos_token_id
        return "".join(chr(ord("a") + t) for t in token_ids if t != eos)

    def completion_distribution(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 1.0,
        alpha: float = 1.0,
        constraint=None,
        local: bool = False,
    ) -> tuple[dict[tuple[int, ...], float], float]:
        """The exact target over completions by enumeration.

        Args:
            constraint: an optional `TokenConstraint` phi; tokens its mask forbids are skipped.
            local: with a constraint, renormalise p_T^alpha · m over the allowed tokens at every
                step (the locally projected distribution that masking at verification samples).

        Returns:
            ({completion: pi(completion)}, log Z) with pi ∝ prod_t p_T(x_t | x_<t)^alpha · phi(x)
            over completions ending in EOS or of length max_tokens, and Z the sum of the
            unnormalised weights. phi of a completion cut by max_tokens is 1 iff it is itself a
            complete string (the constraint allows EOS after it); with `local`, cut completions
            keep their locally projected probability (mask-at-verify returns them as they are).
        """
        eos = self._vocabulary.eos_token_id
        log_weights: dict[tuple[int, ...], float] = {}
        frontier = [((), 0.0)]
        while frontier:
            completion, logw = frontier.pop()
            logp = alpha * torch.log_softmax(self.logits(tuple(prompt) + completion) / temperature, -1)
            if constraint is not None:
                logp = logp.masked_fill(~constraint.mask([list(completion)])[0], -math.inf)
                if local:
                    logp = logp - torch.logsumexp(logp, -1)
            for token, lp in enumerate(logp.tolist()):
                if lp == -math.inf:
                    continue
                extended, w = completion + (token,), logw + lp
                if token == eos:
                    log_weights[extended] = w
                elif len(extended) == max_tokens:
                    if constraint is None or local or bool(constraint.mask([list(extended)])[0, eos]):
                        log_weights[extended] = w
                else:
                    frontier.append((extended, w))
        log_z = math.log(sum(math.exp(w) for w in log_weights.values()))
        return {x: math.exp(w - log_z) for x, w in log_weights.items()}, log_z


class ToySequences(Sequences):
    """Rows of a ToyLM: plain token lists, of any lengths (logits are looked up, nothing is cached)."""

    def __init__(self, lm: ToyLM, rows: list[list[int]]):
        self._lm = lm
        self._rows = rows

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def length(self) -> int:
        if len({len(row) for row in self._rows}) > 1:
            raise ValueError("these rows differ in length; read lengths")
        return len(self._rows[0])

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(row) for row in self._rows], dtype=torch.int64)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != len(self._rows) or tokens.shape[1] < 1:
            raise ValueError(f"expected tokens of shape [{len(self._rows)}, L >= 1], got {tuple(tokens.shape)}")
        self._lm.forward_calls += 1
        out = []
        for row, new in zip(self._rows, tokens.tolist()):
            row_logits = []
            for t in new:
                row.append(t)
                row_logits.append(self._lm.logits(tuple(row)))
            out.append(torch.stack(row_logits))
        # [B, L, V]
        return torch.stack(out)

    def select(self, rows: torch.Tensor) -> None:
        self._rows = [list(self._rows[i]) for i in rows.tolist()]

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot truncate rows of length {self.length} to {length}")
        self._rows = [row[:length] for row in self._rows]

    def join(self, prompt: list[int], count: int) -> torch.Tensor:
        check_join(prompt, count, self._lm.max_length)
        self._lm.forward_calls += 1
        self._rows += [list(prompt) for _ in range(count)]
        return self._lm.logits(tuple(prompt))

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        lengths = check_truncate_rows(lengths, self.lengths)
        self._rows = [row[:n] for row, n in zip(self._rows, lengths.tolist())]
