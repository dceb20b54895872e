"""A choice's text: the chosen particle's tokens decoded and cut before the first stop string, and
the deltas a stream sends of it.

Streaming sends only text that can no longer change: the decoded tokens every particle agrees on
(`Event.stable_tokens`, which only grow), less an incomplete UTF-8 character at the end (U+FFFD)
and less any tail that could still become a stop string. At the end the rest of the final text
is sent, so the deltas join to exactly the text of the non-streamed answer for the same seed.
"""

from __future__ import annotations

from typing import Callable


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """(text before the first occurrence of any stop string, whether one occurred)."""
    found = [text.find(s) for s in stop if s in text]
    return (text[: min(found)], True) if found else (text, False)


def stop_prefix_length(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stop for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)


class TextDeltas:
    """The text one streamed choice has sent, and what to send next."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.sent = ""

    def delta(self, stable_tokens: list[int]) -> str:
        """New final text after an update of the tokens every particle shares ("" if none)."""
        text, stopped = cut_at_stop(self.decode(stable_tokens), self.stop)
        if not stopped:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - stop_prefix_length(text, self.stop)]
        return self._advance(text)

    def rest(self, final_text: str) -> str:
        """The rest of the choice's final text."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
