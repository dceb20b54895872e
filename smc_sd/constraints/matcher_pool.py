"""llguidance matcher states of many token prefixes of one grammar, shared by genealogy.

The engine asks for masks after prefixes that grow a token or a block at a time, fork at
resampling and roll back after a rejection. The pool keeps one matcher per *line*, a path of the
prefix tree that the matcher walks in place: the state of a new prefix whose longest pooled
prefix p is the tip of its line is that line's matcher advanced over the tokens in between (no
copy); any other new prefix (a sibling: a resampled copy's own continuation, or the prefix after
a rejection) starts a line of its own from a `deep_copy` of p's line, rolled back to p
(llguidance rolls back exactly, over any number of tokens). Resampling and forking therefore need
nothing from the engine: copies of a particle ask for the same prefix, and a rolled-back prefix
finds its state still pooled.

Invariants:
- every pooled prefix p maps to [line, len(p), the call that last asked for it], line None when
  the grammar refuses one of p's tokens (a dead prefix);
- a line is [matcher, depth]: the matcher holds the state after `depth` tokens of a path that
  extends every prefix pooled on the line, so rolling it back by depth - len(p) gives p's state;
- the empty prefix is always pooled.

Every `WINDOW` calls the prefixes not asked for in the last `WINDOW` calls leave the pool; a
prefix whose ancestors all left is rebuilt from the empty prefix, which costs time only.
"""

from __future__ import annotations

import llguidance

#: calls after which a prefix nobody asked for leaves the pool
WINDOW = 32


class MatcherPool:
    """The matcher states of one grammar's prefixes (module docstring).

    Args:
        root: the grammar's matcher before any token.
    """

    def __init__(self, root: llguidance.LLMatcher):
        self._pool: dict[tuple[int, ...], list] = {(): [[root, 0], 0, 0]}
        self.calls = 0

    def state(self, prefix: tuple[int, ...]) -> llguidance.LLMatcher | None:
        """The matcher after `prefix`, or None when the grammar refuses one of its tokens.

        The matcher stays the prefix's state until the pool is asked for another prefix (which
        may advance it in place): read it first.
        """
        entry = self._pool.get(prefix)
        if entry is None:
            # the longest pooled prefix (the empty one always is)
            known = len(prefix) - 1
            parent = self._pool.get(prefix[:known])
            while parent is None:
                known -= 1
                parent = self._pool.get(prefix[:known])
            parent[2] = self.calls
            entry = self._pool[prefix] = [self._advance(parent, prefix[known:]), len(prefix), self.calls]
        else:
            entry[2] = self.calls
        line = entry[0]
        if line is None:
            return None
        if line[1] != entry[1]:
            # the line walked past this prefix: a copy rolled back to it becomes its own line
            matcher = line[0].deep_copy()
            matcher.rollback(line[1] - entry[1])
            line = entry[0] = [matcher, entry[1]]
        return line[0]

    def _advance(self, parent: list, tokens: tuple[int, ...]) -> list | None:
        """The line of `parent`'s prefix + tokens: parent's line walked on in place if the
        parent is its tip, else a new line from a copy; None if a token is refused."""
        line = parent[0]
        if line is None:
            return None
        if line[1] != parent[1]:
            matcher = line[0].deep_copy()
            matcher.rollback(line[1] - parent[1])
            line = [matcher, parent[1]]
        consumed = line[0].try_consume_tokens(list(tokens))
        if consumed < len(tokens):
            # refused: the line goes back to where it was, the prefix is dead
            line[0].rollback(consumed)
            return None
        line[1] += consumed
        return line

    def tick(self) -> None:
        """Count a call; every WINDOW calls drop the prefixes not asked for in the last WINDOW,
        so a state lives between WINDOW and 2 WINDOW calls unasked."""
        self.calls += 1
        if self.calls % WINDOW:
            return
        stale = [p for p, (_, _, last) in self._pool.items() if p and last < self.calls - WINDOW]
        for prefix in stale:
            del self._pool[prefix]

    def check_invariants(self) -> None:
        """Raise AssertionError where a pooled prefix's line cannot give its state."""
        assert () in self._pool, "the empty prefix left the pool"
        for prefix, (line, depth, last) in self._pool.items():
            assert depth == len(prefix) and last <= self.calls, f"bad entry for {prefix}"
            assert line is None or line[1] >= depth, f"the line of {prefix} is behind it"
