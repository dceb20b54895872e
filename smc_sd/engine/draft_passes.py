"""One draft model's passes of a cycle, over every row that drafts with it.

The rows that draft come in units: the rows of a batched step (`smc_sd.engine.step_rows.
StepRows`, many requests drawing together) or one request's rows (its `Group`, drawing with its
own masks). Each unit says which rows it holds in the draft's rows, what they read first, how
many tokens it drafts (K) and how it draws a token from its rows' logits.

The draft reads each unit's first tokens (the last two of its prefixes; more for an sd request
whose last blocks were its free draft's), then makes up to K_max passes of [B_d, 1] tokens (K_max
the largest K of the units): a unit's rows read and draw in the first K of them, other rows read
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from smc_sd.engine.rows import RowSet, take_positions


@dataclass
class DraftUnit:
    """Rows that draft together.

    Attributes:
        rows: [A] int64, the unit's rows in the draft's rows.
        draft_len: K, the tokens it drafts this cycle.
        feed: () -> ([A, n] int64 tokens, [A] int64 counts): what its rows read first, row a
            its first counts[a] tokens.
        draw: ([A, V] float32 draft logits) -> [A] int64, the next drafted token of each row.
        fail: called with the error when `feed` or `draw` raises (the unit's request fails);
            None lets the error through (a batched step's draws fail only with the engine).
    """

    rows: torch.Tensor
    draft_len: int
    feed: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    draw: Callable[[torch.Tensor], torch.Tensor]
    fail: Callable[[Exception], None] | None = None

    def attempt(self, call, *args):
        """call(*args), or None after a failure that fails the unit's request."""
        if self.fail is None:
            return call(*args)
        try:
            return call(*args)
        except Exception as error:
            self.fail(error)
            return None


def draft_passes(draft: RowSet, units: list[DraftUnit], eos: int) -> None:
    """Run one draft model's passes of the cycle for `units` (see the module docstring); a unit
    whose request fails stops reading and drawing."""
    units = [u for u in units if u.draft_len > 0]
    if not units:
        return
    feeds = [u.attempt(u.feed) for u in units]
    live = [u for u, f in zip(units, feeds) if f is not None]
    feeds = [f for f in feeds if f is not None]
    if not live:
        return
    width = max(tokens.shape[1] for tokens, _ in feeds)
    # [B_d, width]: the tokens every drafting row has not read, then EOS filler; [B_d]: how
    # many each row reads
    feed = torch.full((draft.size, width), eos, dtype=torch.int64)
    read = torch.zeros(draft.size, dtype=torch.int64)
    for unit, (tokens, counts) in zip(live, feeds):
        feed[unit.rows, : tokens.shape[1]] = tokens
        read[unit.rows] = counts
    for j in range(max(u.draft_len for u in live)):
        # [B_d]: where each reading row's last token lies in the packed pass (others: unused)
        last = read.cumsum(0) - 1
        logits = draft.extend(feed, read)
        feed, read = torch.full((draft.size, 1), eos, dtype=torch.int64), torch.zeros_like(read)
        drawing = [u for u in live if j < u.draft_len]
        live = []
        for unit in drawing:
            # [A, V]: the draft's logits after each of the unit's rows' last token
            tokens = unit.attempt(unit.draw, take_positions(logits, last[unit.rows]))
            if tokens is None:
                continue
            feed[unit.rows, 0] = tokens
            if j + 1 < unit.draft_len:
                read[unit.rows] = 1
                live.append(unit)
        if not live:
            return
