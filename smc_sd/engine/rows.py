"""One model's rows for every running request of the batched engine.

A `RowSet` holds a backend's `Sequences` while any row is held and none otherwise: the first
request to join opens them (`LanguageModel.open`), later ones `join`, and the rows close when a
reseat leaves none. The engine numbers rows itself (`SlotTable.target_row`, `draft_row`), so
the only operations are: join rows at the end, extend every row (each by its own count of tokens), and `reseat`, which makes the
rows a chosen list of old rows at chosen lengths.

Logits reach the engine on the host: the engine draws with CPU generators (a seed gives the
same random stream on every device), so a model on a GPU costs one device-to-host copy of each
pass's logits, and one on the CPU costs nothing.
"""

from __future__ import annotations

import torch

from smc_sd.backends.base import LanguageModel, Sequences


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

    @property
    def ragged(self) -> bool:
        """Whether the rows held may differ in length: the backend rolls rows back to
        lengths of their own (`Sequences.truncate_rows` overridden), not to one length only."""
        return self.rows is not None and type(self.rows).truncate_rows is not Sequences.truncate_rows

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
            joined = self.rows.join_many(prompts, counts)
        else:
            self.rows, first = self.lm.open(prompts[0], counts[0])
            try:
                joined = [first] + self.rows.join_many(prompts[1:], counts[1:])
            except NotImplementedError:
                self.close()
                raise
        return [logits.cpu() for logits in joined]

    def extend(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`Sequences.extend_rows` over every row: row b reads its first counts[b] of tokens
        [B, L]; logits [sum(counts), V] float32, packed row after row (`row_logits` reads them)."""
        return self.rows.extend_rows(tokens, counts).cpu()

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

    def rows_memory(self, rows: torch.Tensor) -> dict | None:
        """The KV some rows hold (`Sequences.rows_memory`), or None when the backend cannot tell."""
        return None if self.rows is None else self.rows.rows_memory(rows)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
            self.rows = None


def row_logits(packed: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """Some rows' logits out of a packed pass (`RowSet.extend`), as [A, width, V]: each row's
    first `width` columns, zero past the tokens it read.

    A view into `packed` when the rows are consecutive and each read `width` tokens (every
    request's rows are consecutive, and all but a free draft's read blocks of one length).

    Args:
        packed: [T, V] float32, the pass's logits row after row.
        starts: [B + 1] int64: row b's logits are packed[starts[b] : starts[b + 1]].
        rows: [A] int64 rows.
        width: columns wanted, at least every row's count.
    """
    begin, counts = starts[rows], starts[rows + 1] - starts[rows]
    if rows.numel() and bool((counts == width).all()) and bool((rows[1:] - rows[:-1] == 1).all()):
        first = int(begin[0])
        return packed[first : first + rows.numel() * width].view(rows.numel(), width, -1)
    columns = torch.arange(width)[None, :]
    # [A, width]: the columns each row read
    kept = columns < counts[:, None]
    out = packed.new_zeros(rows.numel(), width, packed.shape[-1])
    out[kept] = packed[(begin[:, None] + columns)[kept]]
    return out


def join_groups(target_rows: RowSet, draft_sets: list[RowSet], groups: list) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """Add every joining group's N rows after the rows held, to the target's rows and (for a
    group with a draft) its draft's, the prompts of all groups in one `join_many` per model.

    Args:
        draft_sets: the rows of each draft model the engine holds.
        groups: the joining `smc_sd.engine.groups.Group`s, in running order.

    Returns:
        per group ((its first target row, its first row in its draft's rows), [V] target
        logits after its prompt).

    Raises:
        NotImplementedError: when a backend keeps rows of one length (nothing changed then).
    """
    counts = [g.plan.particles for g in groups]
    target_base = target_rows.size
    logits = target_rows.join_many([g.prompt for g in groups], counts)
    # [G]: each group's first row: the rows held, then the groups before it
    target_bases = (target_base + torch.cumsum(torch.tensor([0] + counts[:-1]), 0)).tolist()
    draft_bases = [0] * len(groups)
    joined: list[tuple[RowSet, int]] = []
    for rows in draft_sets:
        drafting = [i for i, g in enumerate(groups) if g.plan.draft is rows.lm]
        if not drafting:
            continue
        draft_base = rows.size
        try:
            rows.join_many([groups[i].prompt for i in drafting], [counts[i] for i in drafting])
        except NotImplementedError:
            target_rows.keep_first(target_base)
            for earlier, size in joined:
                earlier.keep_first(size)
            raise
        joined.append((rows, draft_base))
        offsets = torch.cumsum(torch.tensor([0] + [counts[i] for i in drafting][:-1]), 0).tolist()
        for i, offset in zip(drafting, offsets):
            draft_bases[i] = draft_base + offset
    return [((t, d), l) for t, d, l in zip(target_bases, draft_bases, logits)]


def reseat_groups(table, target_rows: RowSet, draft_sets: list[RowSet], groups: list) -> None:
    """Make the rows, group after group, those of each group's seated particles (`Group.seats`:
    its unfinished particles in particle order, copies holding equal tokens sharing one row), a
    target row holding its prompt and generated tokens but the last, a row of the group's draft
    what `Group.draft_lengths` says (all but the last two; lengths per slot,
    `SlotTable.length`); renumber the table's
    `target_row` and `draft_row` (a row of the group's draft) to match.

    Args:
        table: the engine's `SlotTable`; its rows name each particle's row now held.
        draft_sets: the rows of each draft model the engine holds.
        groups: the running groups, in running order.
    """
    row_sets = [target_rows, *draft_sets]
    sources: list[list[torch.Tensor]] = [[] for _ in row_sets]
    lengths: list[list[torch.Tensor]] = [[] for _ in row_sets]
    offsets = [0] * len(row_sets)
    for group in groups:
        live, seated, seat_of = group.seats()
        uses = [(0, table.target_row, len(group.prompt) + table.length[seated] - 1)]
        if group.has_draft:
            uses.append((1 + [rows.lm for rows in draft_sets].index(group.plan.draft), table.draft_row, group.draft_lengths(seated)))
        for k, row_of, length in uses:
            sources[k].append(row_of[seated])
            lengths[k].append(length)
            row_of[live] = offsets[k] + seat_of
            offsets[k] += seated.numel()
    empty = torch.empty(0, dtype=torch.int64)
    for k, rows in enumerate(row_sets):
        rows.reseat(torch.cat(sources[k] or [empty]), torch.cat(lengths[k] or [empty]))
