"""Prompt lookup: the continuation of a sequence's last tokens at an earlier occurrence in its text.

The text of a particle is T = prompt + generated (token ids), of length L. For an n-gram length n,
the suffix of T is T[L-n:L]; an earlier occurrence of it is a start j < L-n with
T[j:j+n] == T[L-n:L] (it may overlap the suffix itself, as in a run "a a a"). The lookup answer is

    n*  = the largest n in [min_ngram, max_ngram] whose suffix has an earlier occurrence  ("longest")
    j*  = the largest such start j for n*                                                ("most recent")
    proposal = T[j*+n* : min(j*+n*+max_len, L)]

and [] when no n in range has an earlier occurrence. The proposal is never empty otherwise, since
j* + n* < L. It may begin in the prompt and run on into the generated tokens; it stops at the end
of the known text T, so it can be shorter than max_len. Longer suffixes are preferred before more
recent occurrences: a 3-token match in the prompt wins over a 2-token match in the generated text.

Cost. The prompt's n-grams are hashed once: a dict from each n-gram (a tuple; lengths 1..max_ngram
share one dict, tuples of different lengths never compare equal) to the continuation start j+n of
its last occurrence ending before the prompt's final token, P * max_ngram entries for a prompt of P
tokens. Occurrences ending at the prompt's final token or later (they involve the generated
tokens) are found by scanning the generated text directly on each call, so nothing per particle is
stored: particles fork and resample freely, and one index serves them all. A call costs
O(G) list work in C plus, in Python, max_ngram comparisons for each position of the generated
text holding the last token (from the latest back, until a full max_ngram match), plus at most
max_ngram dict look-ups.
"""

from __future__ import annotations


class LookupIndex:
    """Longest-match continuation lookup over a prompt's tokens, extended by a sequence's own text.

    Args:
        prompt: the prompt's token ids.
        max_ngram: the longest suffix matched (n-gram length), >= min_ngram.
        min_ngram: the shortest suffix that counts as a match, >= 1.

    Raises:
        ValueError: if the n-gram bounds are not 1 <= min_ngram <= max_ngram.
    """

    def __init__(self, prompt: list[int], max_ngram: int = 8, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup n-gram lengths need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.prompt = [int(token) for token in prompt]
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # the last max_ngram prompt tokens: every occurrence the per-call scan checks starts here or later
        self._prompt_tail = self.prompt[-max_ngram:]
        # n-gram tuple -> continuation start j + n of its last occurrence T[j:j+n] with j + n <= P - 1,
        # i.e. ending before the prompt's final token (later ends are the scan's)
        self._next_after: dict[tuple[int, ...], int] = {}
        size = len(self.prompt)
        for n in range(1, max_ngram + 1):
            for start in range(size - n):
                self._next_after[tuple(self.prompt[start : start + n])] = start + n

    def propose(self, generated: list[int], max_len: int) -> list[int]:
        """The tokens that followed the longest suffix of (prompt + generated) at its most recent
        earlier occurrence in prompt + generated (module docstring: n*, j*), at most max_len of
        them and never past the end of prompt + generated; [] if no suffix of length
        min_ngram..max_ngram occurs earlier.

        Args:
            generated: the sequence's token ids after the prompt (a list of ints).
            max_len: the most tokens proposed, >= 0.

        Raises:
            ValueError: if generated is not a list or max_len is negative.
        """
        if type(generated) is not list:
            raise ValueError(f"lookup needs the generated tokens as a list of ints, got {type(generated).__name__}")
        if max_len < 0:
            raise ValueError(f"lookup max_len must be >= 0, got {max_len}")
        if max_len == 0:
            return []
        tail = self._prompt_tail + generated
        size = len(tail)
        if size < self.min_ngram:
            return []
        scanned = self._scan_tail(tail)
        if scanned is not None:
            matched, end = scanned
            # tail index -> continuation start in T, then in generated (may be 0: right after the prompt)
            continuation = end + 1 - len(self._prompt_tail)
            if matched >= self.max_ngram:
                return self._continuation(continuation, generated, max_len)
        else:
            matched, continuation = 0, None
        # prompt occurrences ending before its final token: only a strictly longer match beats the
        # scan's (which is more recent); a suffix without one has no longer one either (same end)
        prompt_next = None
        for n in range(max(matched + 1, self.min_ngram), min(self.max_ngram, size) + 1):
            found = self._next_after.get(tuple(tail[size - n :]))
            if found is None:
                break
            prompt_next = found
        if prompt_next is not None:
            return self._continuation(prompt_next - len(self.prompt), generated, max_len)
        if continuation is not None and matched >= self.min_ngram:
            return self._continuation(continuation, generated, max_len)
        return []

    def _scan_tail(self, tail: list[int]) -> tuple[int, int] | None:
        """(match length, end index in tail) of the longest, then latest, earlier occurrence of a
        suffix of tail that ends at the prompt's final token or later; None if there is none.

        Ends e run over tail indices len(tail) - 2 down to len(prompt_tail) - 1 with tail[e] equal
        to the last token (found by list.index over the reversed tail); the match length is the
        count of equal tokens backwards, capped at max_ngram. Going from the latest end, a match
        replaces the best only when strictly longer, and a full-length one ends the scan.
        """
        size = len(tail)
        backwards = tail[::-1]
        last = backwards[0]
        # reversed index i = size - 1 - e; the scanned ends are i = 1 .. size - len(prompt_tail)
        stop = size - max(len(self._prompt_tail) - 1, 0)
        best = None
        best_len = 0
        at = 0
        while True:
            try:
                at = backwards.index(last, at + 1, stop)
            except ValueError:
                return best
            length = 1
            while length < self.max_ngram and at + length < size and backwards[at + length] == backwards[length]:
                length += 1
            if length > best_len:
                best, best_len = (length, size - 1 - at), length
                if length == self.max_ngram:
                    return best

    def _continuation(self, start: int, generated: list[int], max_len: int) -> list[int]:
        """T[start : start + max_len], capped at the end of T, with start counted from the first
        generated token (negative: inside the prompt)."""
        if start >= 0:
            return generated[start : start + max_len]
        from_prompt = self.prompt[len(self.prompt) + start : len(self.prompt) + start + max_len]
        return from_prompt + generated[: max_len - len(from_prompt)]
