"""Thinking that repeats itself: a small reasoning model may write the same sentences again and
again until its token limit. :class:`LoopDetector` watches the streamed text and says when it
loops; the daemon (on its decoded pieces) and a remote engine (on a server's stream) feed it the
same text, so one rule serves both.

The rule, over words (runs of non-space characters, a long run cut into pieces of
``MAX_WORD`` characters, so text without spaces is counted too): a word *repeats* when the
``NGRAM`` words ending with it have already occurred ``SEEN_BEFORE`` times in the text fed so
far. The text *loops* once at least ``SHARE`` of the last ``WINDOW`` words repeat.

A loop of any period is caught no earlier than its fourth time round (``SEEN_BEFORE`` earlier
occurrences), once ``SHARE`` of a window repeat, while what reasoning does repeat — a checked
equation, a restated step, "Wait, let me check that again." — repeats in spans shorter than the
window or fewer times: ``bench/loops.py`` measures both on thousands of synthetic traces in
the style of the notation corpus (no false positive; every loop caught). Constant work per
word; memory, one counter per distinct n-gram.
"""

from __future__ import annotations

from collections import deque

NGRAM = 6  # words per n-gram
SEEN_BEFORE = 3  # earlier occurrences that make an n-gram's word a repeat
WINDOW = 160  # words looked back over
SHARE = 0.7  # of them repeating: a loop
MAX_WORD = 16  # characters of a word; a longer run of non-space characters is several

# What phi4 does about a loop: end the thinking so the model answers (as --think-budget does),
# stop the request, or nothing.
POLICIES = ("answer", "stop", "off")


class LoopDetector:
    """Feed it text as it streams (``feed``); ``looped`` turns true, and stays, once it loops.

    ``words`` counts the words fed; ``looped_at`` is the word at which the loop was seen.
    """

    def __init__(
        self,
        ngram: int = NGRAM,
        seen_before: int = SEEN_BEFORE,
        window: int = WINDOW,
        share: float = SHARE,
    ) -> None:
        self.ngram, self.seen_before, self.window = ngram, seen_before, window
        self._needed = int(share * window + 0.999999)
        self._counts: dict[int, int] = {}
        self._last: deque[str] = deque(maxlen=ngram)
        self._recent: deque[bool] = deque(maxlen=window)
        self._repeats = 0  # repeats among _recent
        self._partial = ""  # the end of the text fed, which may be the start of a longer word
        self.words = 0
        self.looped_at: int | None = None

    @property
    def looped(self) -> bool:
        return self.looped_at is not None

    def feed(self, text: str) -> bool:
        """Take more of the text; return True once it loops."""
        if self.looped_at is not None:
            return True
        text = self._partial + text
        parts = text.split()
        # The last run may go on in the next piece, unless the text ends in a space.
        self._partial = parts.pop() if parts and not text[-1].isspace() else ""
        if len(self._partial) > MAX_WORD:
            whole = len(self._partial) - len(self._partial) % MAX_WORD
            parts.append(self._partial[:whole])
            self._partial = self._partial[whole:]
        for part in parts:
            for start in range(0, len(part), MAX_WORD):
                if self._word(part[start : start + MAX_WORD]):
                    return True
        return False

    def finish(self) -> bool:
        """The text has ended: count its last word."""
        partial, self._partial = self._partial, ""
        return self.feed(partial + " ") if partial else self.looped

    def _word(self, word: str) -> bool:
        self.words += 1
        self._last.append(word)
        if len(self._last) < self.ngram:
            return False
        key = hash(tuple(self._last))
        seen = self._counts.get(key, 0)
        self._counts[key] = seen + 1
        repeat = seen >= self.seen_before
        if len(self._recent) == self.window:
            self._repeats -= self._recent[0]
        self._recent.append(repeat)
        self._repeats += repeat
        if len(self._recent) == self.window and self._repeats >= self._needed:
            self.looped_at = self.words
            return True
        return False
