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

- a word is *new* when the ``SEQUENCE`` words ending with it did not occur, in that order,
  among the ``LOOKBACK`` words before it (where the period below is shorter than ``SEQUENCE``
  words, the ``SHORT_SEQUENCE`` words ending with it). Novelty is measured on word sequences,
  not words: a table whose rows put old words in a new order ("x = 3, y = 5: ... ≡ 6 (mod 7)"
  for every pair, a truth table in sentences) brings new sequences with each row, while a
  paragraph written again brings none from its second copy on;
- a word *recurs* when the ``NGRAM`` words ending with it occurred among the ``LOOKBACK``
  words before it; the distance back to that occurrence is its *gap*, and the commonest gap
  over the last ``LOOKBACK`` words is the text's *period* (a paragraph written again and again
  recurs at its own length);
- the text *loops* once, over the last ``COPIES`` periods (and at least ``MIN_SPAN`` words),
  ``SHARE`` of the words recur within that span, at most ``NEW_PER_COPY`` new words came per
  period, and each of those periods holds ``max(MIN_DISTINCT, period // 4)`` distinct words
  with a letter in them or more: a block of text at least that rich, written ``COPIES`` times
  with (next to) nothing new;
- or the text *loops near verbatim*: each of the last ``COPIES`` periods is the one before it
  again — ``ALIGNED`` of its words end an ``NGRAM``-word run that ended a period (or a word
  either side of a period) before them — and no word of the last period (and a word) changed
  at every one of ``COPIES`` steps back, each word followed from copy to copy at the lag at
  which the text around it lines up; each period holds ``max(MIN_DISTINCT, period //
  NEAR_DISTINCT)`` distinct words with a letter in them. A table whose rows reuse each other's
  words is as aligned as a paragraph written again with a few words swapped, but it counts:
  its row number, or a value that changes with every row (``y = 3,`` after ``y = 2,``, the
  last column of a truth table), differs from the copy before at every step, while the words a
  loop swaps among variants (So/Thus/Hence, is/equals) change now and then, not at every copy;
- a repeating unit poorer than that (``1 + 1 + 1``, ``0 & 0 & 1``, ``2, 4, 8, 6,``, digits of
  1/7) is how structured progress looks for a while — a sum of hundreds of ones, a matrix, a
  cycle of residues — so it loops only after ``LONG_SPAN`` words, or ``LONG_CHARS`` characters
  (each word's and a space after it), in which no new word came at all and ``SHARE`` of the
  words recur (this holds whatever the unit).

So a verbatim loop, or one that swaps a few of its words among variants each time round, is
caught in its 5th copy or so, from the end of its 4th: the test on sequences waits for the
sequences that cross from a loop's first copy into its second, the test on alignment for
``COPIES`` steps back from the last copy. Copies that each swap many words (30% of those that
have variants) are caught later where some word happened to change at every step, as a counter
does; and a word followed across a stretch of more than ``CHANGED`` changed words, or where the
text on its two sides lines up at different lags, cannot be followed: those copies wait for
the next period (``bench/loops.py`` measures how late).

The numbers were chosen on the progressing shapes of ``tests/shapes.py``, the *dev* set of the
enumerations of ``tests/enumerations.py``, the *dev* half of the real-trace corpus
(``tests/data/real_traces``) and synthetic loops; ``bench/loops.py`` reports both error kinds
on the enumerations' *hold-out* set, the corpus's *test* half and on synthetic loops. Constant
work per word (a hash of the last ``SEQUENCE`` and ``NGRAM`` words), and a look back over at
most ``NEAR_LOOKBACK`` words every ``CHECK_EVERY`` words while the recent words recur; memory,
a few entries for each of the last ``LOOKBACK`` words and a word and a hash for each of the
last ``NEAR_LOOKBACK``, however long the text.
"""

from __future__ import annotations

from collections import Counter, deque
from itertools import islice, takewhile

NGRAM = 5  # words whose recurrence makes the last of them recur
SEQUENCE = 24  # words whose first occurrence (in LOOKBACK words) makes the last of them new
SHORT_SEQUENCE = 8  # the same, for a period shorter than SEQUENCE words
COPIES = 4  # periods with nothing new, in a row
MIN_SPAN = 48  # words: the least span a loop is judged on
SHARE = 0.75  # of a span's words recurring within it
NEW_PER_COPY = 0.5  # new words per period, at most (fewer than one a copy)
MIN_DISTINCT = 4  # distinct words of one period for it to count as a block of text
LONG_SPAN = 1500  # words without one new word: a loop, whatever its period
LONG_CHARS = 6000  # or characters without one (text without spaces: pieces of MAX_WORD)
LOOKBACK = 1600  # words looked back over, for a recurrence, a new sequence and the period
ALIGNED = 0.5  # of a near-verbatim period's words: their NGRAM words ended a period (±1) before
NEAR_DISTINCT = 8  # a near-verbatim period's distinct lettered words: 1/8 of its words, or more
CHANGED = 4 * NGRAM  # words: the longest change across which a word is followed a period back
NEAR_LOOKBACK = 3000  # words kept to follow a word back COPIES periods: periods up to 498 words
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
        self._runs = _Window()  # of the SEQUENCE-word runs ending at the last LOOKBACK words
        self._short_runs = _Window()  # of the SHORT_SEQUENCE-word runs
        self._ngrams = _Window()  # of the NGRAM-word runs
        self._last: deque[str] = deque(maxlen=SEQUENCE)
        self._gaps: deque[int] = deque(maxlen=LOOKBACK)  # 0: the word did not recur
        self._gap_counts: Counter[int] = Counter()  # of the recurring words' gaps in _gaps
        self._recent: deque[str] = deque(maxlen=NEAR_LOOKBACK)
        self._keys: deque[int] = deque(maxlen=NEAR_LOOKBACK)  # each word's NGRAM-word run's hash
        self._new: deque[int] = deque()  # where the new words of the last LOOKBACK words were
        self._new_short: deque[int] = deque()  # the same, by SHORT_SEQUENCE-word runs
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
        self._last.append(word)
        last = tuple(self._last)
        # (The first SEQUENCE - 1 words end shorter runs, each new.)
        if self._runs.seen(hash(last), at) is None:
            self._new.append(at)
            self._quiet_since = (self.words, self._chars)
        if self._short_runs.seen(hash(last[-SHORT_SEQUENCE:]), at) is None:
            self._new_short.append(at)
        for new in (self._new, self._new_short):
            while new and new[0] <= at - LOOKBACK:
                new.popleft()
        self._recent.append(word)
        key = hash(last[-NGRAM:])
        self._keys.append(key)
        gap = 0
        if len(last) >= NGRAM:
            before = self._ngrams.seen(key, at)
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

    def _quiet(self, span: int, period: int) -> int:
        """New words among the last ``span`` words, by runs of SEQUENCE words, or of
        SHORT_SEQUENCE for a ``period`` shorter than SEQUENCE (a loop's runs repeat from
        ``period`` + their length on: a run longer than the unit only waits longer to)."""
        new = self._new if period >= SEQUENCE else self._new_short
        start = self.words - span
        return sum(1 for _ in takewhile(lambda at: at >= start, reversed(new)))

    def _recurring(self, span: int, within: int | None = None) -> float:
        """The share of the last ``span`` words that recur within ``within`` words (by default,
        within those ``span`` words)."""
        limit = span if within is None else within
        gaps = islice(reversed(self._gaps), span)
        return sum(1 for gap in gaps if 0 < gap < limit) / span

    def _rich(self, period: int, share: int = 4) -> bool:
        """Whether each of the last COPIES periods holds MIN_DISTINCT distinct words with a
        letter in them (and a ``share``-th of its words) or more: a block of text, not a row of
        a table or a matrix, nor the digits of a fraction."""
        recent = list(islice(reversed(self._recent), COPIES * period))
        least = max(MIN_DISTINCT, period // share)
        return all(
            sum(1 for w in set(recent[start : start + period]) if _has_letter(w)) >= least
            for start in range(0, len(recent), period)
        )

    def _near_verbatim(self, period: int) -> bool:
        """Whether each of the last COPIES periods is the period before it again, nearly word
        for word, and nothing in it counts: ALIGNED of each period's words end an NGRAM-word run
        that ended a period before (or a word either side: a copy may be a word longer or
        shorter than the last), and each word of the last period (and a word) is the word a
        period before it, or was so at one of COPIES steps back, followed from copy to copy at
        the lag at which the text around it lines up. A table's counter — the row's number, a
        value that changes with every row — changes at every step; a word a loop swaps for a
        variant now and then does not. Each period a block of text (NEAR_DISTINCT)."""
        # The words followed back, and the steps they take (as far back as the text goes).
        reach = min(COPIES * (period + 1) + period, len(self._keys) - period - 2)
        if reach < COPIES * period:
            return False
        size = reach + period + 2
        keys = list(islice(reversed(self._keys), size))  # the last word first

        def lag(at: int) -> int | None:
            """How far back, a period or a word either side of it, the run ending at the word
            ``at`` ended before; None where it did not (within NGRAM words of a change)."""
            key, back = keys[at], at + period
            return (
                period
                if keys[back] == key
                else period - 1
                if keys[back - 1] == key
                else period + 1
                if keys[back + 1] == key
                else None
            )

        lags: list[int | None] = []
        for start in range(0, COPIES * period, period):
            lags += map(lag, range(start, start + period))
            if sum(found is not None for found in lags[start:]) < ALIGNED * period:
                return False
        lags += map(lag, range(COPIES * period, reach))
        if not self._rich(period, NEAR_DISTINCT):
            return False
        words = list(islice(reversed(self._recent), size))
        # Across a change the words are followed back at the lag of the runs on both sides of
        # it, where they agree and the change is at most CHANGED words long; elsewhere (the text
        # shifted there, changed for longer, or a run a word off matched by chance, "H T H" in
        # "H H T H T") a word cannot be followed (0), and the copies are not judged.
        steps = [found or 0 for found in lags]
        at = 0
        while at < reach:
            end = at
            while end < reach and lags[end] is None:
                end += 1
            if end > at:
                newer, older = lags[at - 1] if at else None, lags[end] if end < reach else None
                if end - at <= CHANGED and not (newer and older and newer != older):
                    steps[at:end] = [newer or older or 0] * (end - at)
            at = end + 1
        for offset in range(period + 1):
            at = offset
            for _ in range(COPIES):
                step = steps[at] if at < reach else 0
                if not step:
                    return False
                if words[at + step] == words[at]:
                    break
                at += step
            else:
                return False  # a counter
        return True

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
            and self._quiet(span, period) <= NEW_PER_COPY * span / period
        ):
            return period
        if self._near_verbatim(period):
            return period
        words, chars = self.words - self._quiet_since[0], self._chars - self._quiet_since[1]
        if (words >= LONG_SPAN or chars >= LONG_CHARS) and self._recurring(
            min(words, LOOKBACK), LOOKBACK
        ) >= SHARE:
            return period
        return None


def _has_letter(word: str) -> bool:
    return any(c.isalpha() for c in word)


class _Window:
    """Where each of the hashed runs ending at the last ``LOOKBACK`` words last ended: memory
    for ``LOOKBACK`` runs, whatever the length of the text."""

    def __init__(self) -> None:
        self._at: dict[int, int] = {}
        self._keys: deque[int] = deque()

    def seen(self, key: int, at: int) -> int | None:
        """Where the run ``key`` last ended within ``LOOKBACK`` words before ``at`` (or None);
        remember it as ending at ``at``."""
        if len(self._keys) == LOOKBACK:
            old = self._keys.popleft()
            if self._at[old] == at - LOOKBACK:
                del self._at[old]
        before = self._at.get(key)
        self._at[key] = at
        self._keys.append(key)
        return before
