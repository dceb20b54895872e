"""The language-model interface every backend implements.

A backend owns one model. `LanguageModel.open(prompt, batch)` runs the prompt's forward once and
returns a `Sequences`: `batch` rows that all start with the prompt. Rows may come to differ in
length: `join` adds rows of another prompt (a request joining a batch) and `truncate_rows` rolls
each row back to its own length; `extend` then appends at each row's own positions. Backends
that keep rows of one length only (the copy and static HF caches, dry_run, feature drafts)
refuse both with NotImplementedError (`truncate_rows` to one common length still works there).

Dimension letters (see `smc_sd.engine`): B rows, L new tokens, V vocabulary.

The one primitive is `Sequences.extend(tokens)`: append `tokens` [B, L] to every row and return
the raw next-token logits after each appended token, [B, L, V] float32: never NaN or +inf, with a
finite entry in every row; -inf marks a token of probability zero. Temperatures, powers and
masks are applied by the caller, so a backend never needs to know about them. The caller reads
the logits and never edits them in place (the hf backend hands over its forward's inference
tensors, which refuse in-place edits outside `torch.inference_mode`). `select` reorders
rows (resampling, forking) and `truncate` rolls every row back to a length (exact speculative
decoding's rejection).

Invariants every implementation keeps (checked by `smc_sd.testing`):
- extend is the autoregressive factorisation: logits after token t equal those a fresh forward
  over the whole row would give at that position, whatever the other rows' lengths;
- select(a) then extend equals extending the rows a[i] of the old batch;
- truncate(n) (or truncate_rows(n)) then extend equals never having appended past n;
- join(prompt, c) returns the logits a fresh open(prompt, 1) returns and adds c rows that behave
  as that open's rows; join_many(prompts, counts) is the same as joining them one by one;
- extend_rows(tokens, counts) equals extending every row by all its tokens and then
  truncate_rows(lengths + counts), its logits those of the kept tokens, packed row after row.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from smc_sd.backends.pass_cost import CPU_FLOAT32, PassCost


class TokenizerMismatchError(ValueError):
    """Raised when a draft and a target do not share one vocabulary."""


class ContextOverflowError(ValueError):
    """Raised when a request needs more positions than the model's context window."""


@dataclass(frozen=True)
class Vocabulary:
    """What two models must agree on to be paired as draft and target.

    Attributes:
        size: V, the number of rows of the logits (may exceed the tokenizer's length).
        eos_token_id: the end-of-sequence token.
        fingerprint: a hash of the token-string to id map; equal maps give equal fingerprints.
    """

    size: int
    eos_token_id: int
    fingerprint: str


class Sequences(abc.ABC):
    """B token sequences held in one model's KV cache."""

    @property
    @abc.abstractmethod
    def batch_size(self) -> int:
        """B, the number of rows."""

    @property
    @abc.abstractmethod
    def length(self) -> int:
        """Tokens per row held in the cache (prompt included), when every row has that many.

        Raises:
            ValueError: when rows differ in length (read `lengths`).
        """

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64 (CPU) tokens held by each row (prompt included)."""
        return torch.full((self.batch_size,), self.length, dtype=torch.int64)

    @abc.abstractmethod
    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens to every row, row b at its own positions lengths[b] .. lengths[b] + L - 1.

        Args:
            tokens: [B, L] int64, L >= 1.

        Returns:
            [B, L, V] float32 logits; row b, column l is the next-token logits after tokens[b, l].
        """

    def extend_rows(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append to row b its first counts[b] tokens of tokens[b], at its own positions
        lengths[b] .. lengths[b] + counts[b] - 1 (rows that read blocks of different lengths).

        This default extends every row by all L tokens, then rolls each back to its own length;
        a backend overrides it to compute only the tokens the rows keep.

        Args:
            tokens: [B, L] int64, L >= 1; columns past counts[b] are filler.
            counts: [B] int64, 0 <= counts[b] <= L (0: the row reads nothing).

        Returns:
            [T, V] float32 logits packed row after row, T = sum(counts): entry
            counts[0] + ... + counts[b - 1] + l is the next-token logits after tokens[b, l].
        """
        counts = check_counts(counts, tokens)
        before = self.lengths
        logits = self.extend(tokens)
        if bool((counts == tokens.shape[1]).all()):
            return logits.flatten(0, 1)
        self.truncate_rows(before + counts)
        return logits[torch.arange(tokens.shape[1])[None, :] < counts[:, None]]

    def join(self, prompt: list[int], count: int) -> torch.Tensor:
        """Add `count` rows holding `prompt` after the current rows (a request joins the batch).

        Args:
            prompt: token ids, at least one.
            count: rows to add, >= 1; they become rows B .. B + count - 1.

        Returns:
            [V] float32 next-token logits after the prompt.

        Raises:
            NotImplementedError: for a backend whose rows keep one length.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps rows of one length only: it cannot join rows of another prompt")

    def join_many(self, prompts: list[list[int]], counts: list[int]) -> list[torch.Tensor]:
        """`join` every prompt in turn (prompts[j] gets counts[j] rows, in order); a backend
        overrides it to run their forwards as one.

        Returns:
            [V] float32 next-token logits after each prompt.
        """
        return [self.join(prompt, count) for prompt, count in zip(prompts, counts)]

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        """Roll row b back to its first lengths[b] tokens (0 <= lengths[b] <= self.lengths[b]).

        A row of length 0 holds nothing; its next `extend` starts at position 0. This default
        serves backends whose rows keep one length: equal lengths become one `truncate`.

        Args:
            lengths: [B] int64.

        Raises:
            NotImplementedError: for such a backend, when the lengths differ.
        """
        lengths = check_truncate_rows(lengths, self.lengths)
        if bool((lengths != lengths[0]).any()):
            raise NotImplementedError(f"{type(self).__name__} keeps rows of one length only: it cannot truncate rows to different lengths")
        if int(lengths[0]) != self.length:
            self.truncate(int(lengths[0]))

    @abc.abstractmethod
    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i].

        Args:
            rows: [B'] int64 indices into the current rows; B' may differ from B.
        """

    @abc.abstractmethod
    def truncate(self, length: int) -> None:
        """Drop every token past position `length` in every row."""

    def close(self) -> None:
        """Release the cache. Safe to call twice."""

    def memory(self) -> dict | None:
        """KV-cache statistics in bytes (`live_bytes`, `peak_bytes`, `naive_peak_bytes`, ...),
        or None for a backend that keeps no KV cache."""
        return None

    def rows_memory(self, rows: torch.Tensor, owners: torch.Tensor, count: int) -> list[dict] | None:
        """The KV bytes each of `count` owners' rows hold now: `live_bytes` (storage they use,
        counted once where they share it) and `naive_bytes` (what a full copy per row would
        take); None for a backend that cannot tell one row's KV from another's.

        Args:
            rows: [R] int64 distinct row indices.
            owners: [R] int64 in [0, count): whose each row is.

        Returns:
            one dict per owner.
        """
        return None


def check_open(prompt: list[int], batch_size: int, max_length: int) -> None:
    """Refuse an `open` with an empty prompt, B < 1 or a prompt longer than the context.

    Raises:
        ValueError: on an empty prompt or B < 1.
        ContextOverflowError: if the prompt is longer than `max_length`.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt must hold at least one token")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if len(prompt) > max_length:
        raise ContextOverflowError(f"the prompt has {len(prompt)} tokens; the model attends over {max_length}")


def check_extend(tokens: torch.Tensor, batch_size: int, length: int, max_length: int) -> None:
    """Refuse an `extend` argument that is not [B, L >= 1] integer ids fitting the context.

    Raises:
        ValueError: on a wrong shape or dtype.
        ContextOverflowError: if a row would exceed `max_length` positions.
    """
    if tokens.ndim != 2 or tokens.shape[0] != batch_size or tokens.shape[1] < 1:
        raise ValueError(f"tokens must have shape [{batch_size}, L] with L >= 1, got {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
    if length + tokens.shape[1] > max_length:
        raise ContextOverflowError(
            f"extending {length} positions by {tokens.shape[1]} exceeds the model's {max_length}"
        )


def check_counts(counts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Refuse `extend_rows` counts that are not [B] integers in 0 .. L for tokens [B, L];
    returns them as int64 on the CPU."""
    if counts.ndim != 1 or counts.shape[0] != tokens.shape[0] or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"counts must be [{tokens.shape[0]}] integers, got {tuple(counts.shape)} {counts.dtype}")
    counts = counts.to(torch.int64).cpu()
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > tokens.shape[1]):
        raise ValueError(f"counts must lie in 0 .. {tokens.shape[1]}, got {counts.tolist()}")
    return counts


def check_rows(rows: torch.Tensor, batch_size: int) -> None:
    """Refuse a `select` argument that is not a non-empty 1-D index into B rows.

    The range check reads rows' min and max: one host sync when rows live on a GPU.
    """
    if rows.ndim != 1 or rows.numel() == 0:
        raise ValueError(f"rows must be a non-empty 1-D index tensor, got {tuple(rows.shape)}")
    if int(rows.min()) < 0 or int(rows.max()) >= batch_size:
        raise ValueError(f"rows must index 0 .. {batch_size - 1}, got {rows.tolist()}")


def check_truncate(length: int, current: int) -> None:
    """Refuse a `truncate` length outside 1 .. current."""
    if not 1 <= length <= current:
        raise ValueError(f"truncate length must be in 1 .. {current}, got {length}")


def check_join(prompt: list[int], count: int, max_length: int) -> None:
    """Refuse a `join` with an empty prompt, count < 1 or a prompt longer than the context.

    Raises:
        ValueError: on an empty prompt or count < 1.
        ContextOverflowError: if the prompt is longer than `max_length`.
    """
    if count < 1:
        raise ValueError(f"a join adds at least one row, got count {count}")
    check_open(prompt, count, max_length)


def check_truncate_rows(lengths: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Refuse a `truncate_rows` argument that is not [B] integers in 0 .. current[b].

    Returns:
        The lengths as [B] int64 on the CPU.
    """
    lengths = torch.as_tensor(lengths)
    if lengths.shape != current.shape or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be {tuple(current.shape)} integers, got {tuple(lengths.shape)} {lengths.dtype}")
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    if bool(((lengths < 0) | (lengths > current)).any()):
        raise ValueError(f"truncate lengths must lie in 0 .. the rows' lengths {current.tolist()}, got {lengths.tolist()}")
    return lengths


class LanguageModel(abc.ABC):
    """One model behind a tokenizer; the factory of `Sequences`."""

    #: the tokenizer (a transformers tokenizer or anything with encode/decode), or None
    tokenizer = None

    @property
    @abc.abstractmethod
    def vocabulary(self) -> Vocabulary:
        """The vocabulary this model's logits index."""

    @property
    @abc.abstractmethod
    def max_length(self) -> int:
        """Positions the model can attend over (prompt plus generated tokens)."""

    @abc.abstractmethod
    def open(self, prompt: list[int], batch_size: int) -> tuple[Sequences, torch.Tensor]:
        """Run the prompt once and start `batch_size` rows from it.

        Args:
            prompt: the prompt token ids, at least one.
            batch_size: B >= 1.

        Returns:
            The rows, each holding the prompt, and the next-token logits after the prompt,
            [V] float32.
        """

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids (special tokens dropped)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def drop_prefix_cache(self) -> None:
        """Forget the KV kept from finished rows for later prompts (a prefix cache), so the next
        prompt is computed in full, as a benchmark's cold run needs; a backend without such a
        cache, or one that manages its own, keeps it."""

    @property
    def pass_cost(self) -> PassCost:
        """What a pass over n new positions costs here, in one-position passes
        (`smc_sd.backends.pass_cost`); a CPU in float32 unless the backend knows better."""
        return CPU_FLOAT32


def check_same_vocabulary(draft: LanguageModel, target: LanguageModel) -> None:
    """Refuse a draft whose logits do not index the target's tokens.

    Raises:
        TokenizerMismatchError: naming what differs.
    """
    d, t = draft.vocabulary, target.vocabulary
    if d.fingerprint != t.fingerprint:
        raise TokenizerMismatchError(
            "draft and target tokenizers differ (their token-to-id maps are not equal); "
            "SMC-SD and speculative decoding need a draft that shares the target's tokenizer"
        )
    if d.size != t.size or d.eos_token_id != t.eos_token_id:
        raise TokenizerMismatchError(
            f"draft vocabulary (size {d.size}, eos {d.eos_token_id}) differs from the "
            f"target's (size {t.size}, eos {t.eos_token_id})"
        )
