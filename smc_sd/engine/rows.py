"""One model's rows for every running request of the batched engine.

A `RowSet` holds a backend's `Sequences` while any row is held and none otherwise: the first
request to join opens them (`LanguageModel.open`), later ones `join`, and the rows close when a
reseat leaves none. The engine numbers rows itself (`SlotTable.target_row`, `draft_row`), so
the only operations are: join rows at the end, extend every row, and `reseat`, which makes the
rows a chosen list of old rows at chosen lengths.
"""

from __future__ import annotations

import torch

from smc_sd.backends.base import LanguageModel


class RowSet:
    """The rows of one model, or none.

    Args:
        lm: the model.
    """

    def __init__(self, lm: LanguageModel):
        self.lm = lm
        self.rows = None

    @property
    def size(self) -> int:
        """B, the rows held."""
        return 0 if self.rows is None else self.rows.batch_size

    def join_many(self, prompts: list[list[int]], counts: list[int]) -> list[torch.Tensor]:
        """Add counts[j] rows holding prompts[j], in order, after the rows held.

        Returns:
            [V] float32 next-token logits after each prompt.

        Raises:
            NotImplementedError: when the backend cannot hold rows of several prompts (its rows
                keep one length); the rows held are then as before.
        """
        if not prompts:
            return []
        if self.rows is not None:
            return self.rows.join_many(prompts, counts)
        self.rows, first = self.lm.open(prompts[0], counts[0])
        try:
            return [first] + self.rows.join_many(prompts[1:], counts[1:])
        except NotImplementedError:
            self.close()
            raise

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """`Sequences.extend` over every row: tokens [B, L] -> logits [B, L, V] float32."""
        return self.rows.extend(tokens)

    def keep_first(self, count: int) -> None:
        """Drop every row from `count` on (undo a join)."""
        self.reseat(torch.arange(count), self.rows.lengths[:count])

    def reseat(self, sources: torch.Tensor, lengths: torch.Tensor) -> None:
        """Row i becomes old row sources[i] rolled back to lengths[i].

        Args:
            sources: [B'] int64 rows held now; B' = 0 closes the rows.
            lengths: [B'] int64, each at most its source row's length.
        """
        if self.rows is None:
            return
        if sources.numel() == 0:
            self.close()
            return
        if sources.numel() != self.rows.batch_size or bool((sources != torch.arange(sources.numel())).any()):
            self.rows.select(sources)
        if bool((self.rows.lengths != lengths).any()):
            self.rows.truncate_rows(lengths)

    def memory(self) -> dict | None:
        """The rows' KV statistics (`Sequences.memory`), or None when none are held."""
        return None if self.rows is None else self.rows.memory()

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
            self.rows = None
