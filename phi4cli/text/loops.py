"""Thinking that repeats itself with nothing new: a small reasoning model may write the same
block of text again and again until its token limit. :class:`LoopDetector` watches the streamed
text and says when it loops; the daemon (on its decoded pieces) and a remote engine (on a
server's stream) feed it the same text, and ``phi4cli.text.thinking`` decides what to do about it.

A loop is *no progress*, not repeated phrases. Reasoning that repeats its shape while it says new
things — matrices written out in full, case tables, sums written term by term, a formula checked
again for n = 1, 2, 3, ... in the same words — must run to its end; a block of text that recurs
verbatim, or nearly so, with nothing new between its copies must not.

The rule, over words (runs of non-space characters; a run longer than ``MAX_WORD`` characters
is cut into pieces of that size, so text without spaces is counted too):

- a word is *new* the first time it occurs in the text;
- a word *recurs* when the ``NGRAM`` words ending with it occurred before; the distance back to
  that occurrence is its *gap*, and the commonest gap over the last ``LOOKBACK`` words is the
  text's *period* (a paragraph written again and again recurs at its own length);
- the text *loops* once, over the last ``COPIES`` periods (and at least ``MIN_SPAN`` words),
  ``SHARE`` of the words recur within that span, at most ``NEW_PER_COPY`` new words came per
  period, and each of those periods holds ``max(MIN_DISTINCT, period // 4)`` distinct words
  with a letter in them or more: a block of text at least that rich, written ``COPIES`` times
  with (next to) nothing new;
- a repeating unit poorer than that (``1 + 1 + 1``, ``0 & 0 & 1``, ``2, 4, 8, 6,``, digits of
  1/7) is how structured progress looks for a while — a sum of hundreds of ones, a matrix, a
  cycle of residues — so it loops only after ``LONG_SPAN`` words, or ``LONG_CHARS`` characters
  (each word's and a space after it), in which no new word came at all and ``SHARE`` of the
  words recur (this holds whatever the unit).

The numbers were chosen on the progressing shapes of ``tests/shapes.py`` and the *dev* half of
the real-trace corpus (``tests/data/real_traces``); ``bench/loops.py`` reports both error kinds
on its *test* half and on synthetic loops. Constant work per word, and a look back over
``LOOKBACK`` words every ``CHECK_EVERY`` words while the recent words recur; memory, one entry
per distinct word and n-gram.
"""

from __future__ import annotations

from collections import Counter, deque
from itertools import islice, takewhile

NGRAM = 5  # words whose recurrence makes the last of them recur
COPIES = 4  # periods with nothing new, in a row
MIN_SPAN = 48  # words: the least span a loop is judged on
SHARE = 0.75  # of a span's words recurring within it
NEW_PER_COPY = 0.5  # new words per period, at most (fewer than one a copy)
MIN_DISTINCT = 4  # distinct words of one period for it to count as a block of text
LONG_SPAN = 1500  # words without one new word: a loop, whatever its period
LONG_CHARS = 6000  # or characters without one (text without spaces: pieces of MAX_WORD)
LOOKBACK = 1600  # words whose gaps say the period; a longer period is not looked for
CHECK_EVERY = 8  # words between two looks back
MAX_WORD = 16  # characters of a word; a longer run of non-space characters is several

# What phi4 does about a loop: end the thinking so the model answers (as --think-budget does),
# stop the request, or nothing.
POLICIES = ("answer", "stop", "off")


class LoopDetector:
    """Feed it text as it streams (``feed``); ``looped`` turns true, and stays, once it loops.

    ``words`` counts the words fed; ``looped_at`` is the word at which the loop was seen and
    ``period`` the loop's period in words.
    """

    def __init__(self) -> None:
        self._vocabulary: set[str] = set()
        self._seen_at: dict[int, int] = {}  # an n-gram's hash: the word it last ended at
        self._last: deque[str] = deque(maxlen=NGRAM)
        self._gaps: deque[int] = deque(maxlen=LOOKBACK)  # 0: the word did not recur
        self._gap_counts: Counter[int] = Counter()  # of the recurring words' gaps in _gaps
        self._recent: deque[str] = deque(maxlen=LOOKBACK)
        self._new: deque[int] = deque()  # where the new words of the last LOOKBACK words were
        self._partial = ""  # the end of the text fed, which may be the start of a longer word
        self._chars = 0  # characters of the words fed, a space after each
        self._quiet_since = (0, 0)  # (words, characters) fed when the last new word came
        self.words = 0
        self.looped_at: int | None = None
        self.period: int | None = None

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
        at = self.words
        self.words += 1
        self._chars += len(word) + 1
        if word not in self._vocabulary:
            self._vocabulary.add(word)
            self._new.append(at)
            self._quiet_since = (self.words, self._chars)
        while self._new and self._new[0] <= at - LOOKBACK:
            self._new.popleft()
        self._recent.append(word)
        self._last.append(word)
        gap = 0
        if len(self._last) == NGRAM:
            key = hash(tuple(self._last))
            before = self._seen_at.get(key)
            self._seen_at[key] = at
            gap = 0 if before is None else at - before
        if len(self._gaps) == LOOKBACK and self._gaps[0]:
            old = self._gaps[0]
            self._gap_counts[old] -= 1
            if not self._gap_counts[old]:
                del self._gap_counts[old]  # (the period is the commonest of those left)
        self._gaps.append(gap)
        if gap:
            self._gap_counts[gap] += 1
        if self.words % CHECK_EVERY or self.words < MIN_SPAN:
            return False
        period = self._loops()
        if period is None:
            return False
        self.looped_at, self.period = self.words, period
        return True

    def _quiet(self, span: int) -> int:
        """New words among the last ``span`` words."""
        start = self.words - span
        return sum(1 for _ in takewhile(lambda at: at >= start, reversed(self._new)))

    def _recurring(self, span: int, within: int | None = None) -> float:
        """The share of the last ``span`` words that recur within ``within`` words (by default,
        within those ``span`` words)."""
        limit = span if within is None else within
        gaps = islice(reversed(self._gaps), span)
        return sum(1 for gap in gaps if 0 < gap < limit) / span

    def _rich(self, period: int) -> bool:
        """Whether each of the last COPIES periods holds MIN_DISTINCT distinct words with a
        letter in them (and a quarter of its words) or more: a block of text, not a row of a
        table or a matrix, nor the digits of a fraction."""
        recent = list(islice(reversed(self._recent), COPIES * period))
        least = max(MIN_DISTINCT, period // 4)
        return all(
            len({w for w in recent[start : start + period] if _has_letter(w)}) >= least
            for start in range(0, len(recent), period)
        )

    def _loops(self) -> int | None:
        """The period of the loop the text has fallen into, or None."""
        # Cheap first: the last MIN_SPAN words must recur, or nothing here can loop.
        if self._recurring(MIN_SPAN, LOOKBACK) < SHARE:
            return None
        period = max(self._gap_counts.items(), key=lambda item: (item[1], item[0]))[0]
        span = max(MIN_SPAN, COPIES * period)
        if (
            span <= len(self._gaps)
            and self._recurring(span) >= SHARE
            and self._rich(period)
            and self._quiet(span) <= NEW_PER_COPY * span / period
        ):
            return period
        words, chars = self.words - self._quiet_since[0], self._chars - self._quiet_since[1]
        if (words >= LONG_SPAN or chars >= LONG_CHARS) and self._recurring(
            min(words, LOOKBACK), LOOKBACK
        ) >= SHARE:
            return period
        return None


def _has_letter(word: str) -> bool:
    return any(c.isalpha() for c in word)
