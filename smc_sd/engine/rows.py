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

    def rows_memory(self, rows: torch.Tensor, owners: torch.Tensor, count: int) -> list[dict] | None:
        """The KV each owner's rows hold (`Sequences.rows_memory`), or None when the backend
        cannot tell or no rows are held."""
        return None if self.rows is None else self.rows.rows_memory(rows, owners, count)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
            self.rows = None


def consecutive(index: torch.Tensor) -> bool:
    """Whether the [A] int64 index runs i, i + 1, ..., i + A - 1 (one host read)."""
    return bool((index[1:] - index[:-1] == 1).all())


def take_positions(packed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """packed[positions] ([A, V] from [T, V] and [A] int64), a view when the positions are
    consecutive (the rows of one request, or of requests seated in order): a pass's rows of
    49,152 logits cost a copy of 196 KB each otherwise."""
    if positions.numel() and consecutive(positions):
        first = int(positions[0])
        return packed[first : first + positions.numel()]
    return packed[positions]


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
    if rows.numel() and bool((counts == width).all()) and consecutive(rows):
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
    `SlotTable.length`); renumber the table's `target_row` and `draft_row` (a row of the
    group's draft) to match. Consecutive groups whose seats are their unfinished particles
    (`Group.plain_seats`) are reseated together in a fixed number of tensor operations, and so
    are consecutive groups without a draft LM whose seats come as lists (`seat_lists`).

    Args:
        table: the engine's `SlotTable`; its rows name each particle's row now held.
        draft_sets: the rows of each draft model the engine holds.
        groups: the running groups, in running order.
    """
    row_sets = [target_rows, *draft_sets]
    models = [rows.lm for rows in draft_sets]
    # per row set: the old rows the new ones copy and their lengths, piece after piece
    sources: list[list[torch.Tensor]] = [[] for _ in row_sets]
    lengths: list[list[torch.Tensor]] = [[] for _ in row_sets]
    offsets = [0] * len(row_sets)

    def place(k: int, row_of: torch.Tensor, live: torch.Tensor, seated: torch.Tensor, seat_of: torch.Tensor, length: torch.Tensor) -> None:
        sources[k].append(row_of[seated])
        lengths[k].append(length)
        row_of[live] = offsets[k] + seat_of
        offsets[k] += seated.numel()

    def flush_plain(run: list) -> None:
        # [N]: the run's slots, group after group; the draft set of each (0: none)
        slots = torch.cat([g.slots for g in run])
        sizes = torch.tensor([g.slots.numel() for g in run])
        prompt = torch.repeat_interleave(torch.tensor([len(g.prompt) for g in run]), sizes)
        draft = torch.repeat_interleave(torch.tensor([1 + models.index(g.plan.draft) if g.has_draft else 0 for g in run]), sizes)
        alive = ~table.finished[slots]
        live, held = slots[alive], prompt[alive] + table.length[slots[alive]]
        place(0, table.target_row, live, live, torch.arange(live.numel()), held - 1)
        for k in sorted({1 + models.index(g.plan.draft) for g in run if g.has_draft}):
            mine = draft[alive] == k
            place(k, table.draft_row, live[mine], live[mine], torch.arange(live[mine].numel()), held[mine] - 2)

    def flush_lists(run: list) -> None:
        # groups without a draft LM whose seats come as Python lists (`seat_lists`), merged
        live, seated, seat_of, held = [], [], [], []
        for g in run:
            l, s, o, h = g.seat_lists()
            seat_of += [len(seated) + x for x in o]
            live, seated, held = live + l, seated + s, held + h
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64)
        place(0, table.target_row, as_tensor(live), as_tensor(seated), as_tensor(seat_of), as_tensor(held))

    # consecutive groups of one kind are reseated together
    run: list = []
    kind = None
    for group in groups:
        this = "plain" if group.plain_seats else "lists" if not group.has_draft else None
        if run and this != kind:
            (flush_plain if kind == "plain" else flush_lists)(run)
            run = []
        kind = this
        if this is not None:
            run.append(group)
            continue
        live, seated, seat_of = group.seats()
        place(0, table.target_row, live, seated, seat_of, len(group.prompt) + table.length[seated] - 1)
        place(1 + models.index(group.plan.draft), table.draft_row, live, seated, seat_of, group.draft_lengths(seated))
    if run:
        (flush_plain if kind == "plain" else flush_lists)(run)
    empty = torch.empty(0, dtype=torch.int64)
    for k, rows in enumerate(row_sets):
        rows.reseat(torch.cat(sources[k] or [empty]), torch.cat(lengths[k] or [empty]))


def note_kv(table, target_rows: RowSet, draft_sets: list[RowSet], groups: list) -> None:
    """Each group's KV now, at the widest point of its cycle (`Group.note_kv`): the rows its
    particles hold in the target's rows and in its draft's, one `rows_memory` call per model
    for all groups.

    Args:
        table: the engine's `SlotTable`.
        groups: the groups whose KV to note, in any order.
    """
    groups = [g for g in groups if g.kv_peak is not None]
    held: list[list] = [[] for _ in groups]
    uses = [(target_rows, table.target_row, list(range(len(groups))))]
    uses += [(rows, table.draft_row, [i for i, g in enumerate(groups) if g.has_draft and g.plan.draft is rows.lm]) for rows in draft_sets]
    for rows, row_of, users in uses:
        if not users:
            continue
        slots = torch.cat([groups[i].slots for i in users])
        owner = torch.repeat_interleave(torch.arange(len(users)), torch.tensor([groups[i].slots.numel() for i in users]))
        row = row_of[slots]
        # particles holding equal tokens may share a row: each row once, with its owner
        distinct, where = torch.unique(row[row >= 0], return_inverse=True)
        owners = torch.zeros_like(distinct).scatter_(0, where, owner[row >= 0])
        memory = rows.rows_memory(distinct, owners, len(users))
        for j, i in enumerate(users):
            held[i].append(None if memory is None else memory[j])
    for g, h in zip(groups, held):
        g.note_kv(h)
