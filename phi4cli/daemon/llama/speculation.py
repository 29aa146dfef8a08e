"""Exact self-speculation: drafts from text already seen, and a gate that drafts only where it
pays on this machine and model.

A **draft** is a guess at the next few tokens of an answer: what followed the last place its
last few tokens occurred, in text the daemon already holds: the request's own prompt and answer
so far, its sibling samples (the same prompt: ``--samples K``, ``eval -k K``, serve's ``n``),
and a small pool of answers that finished lately. The engine (batch.py) feeds the answer's next
token with the draft behind it in the step's one batch, then samples each position with the
request's own sampler, in order, keeping the drafted tokens only while each matches the token
drawn: every emitted token is drawn from the same distribution, with the same draws of the
seed's generator, as without a draft (the logits of a larger batch may round differently, so
the same text is the rule, not a bitwise promise). The cells of rejected draft tokens are removed.

Verifying costs: one ``llama_decode`` of k more tokens of a sequence costs, on a CPU, about as
much as k more steps (a 2-core Zen 4: 1.7x for 2 tokens, 5.9-6.5x for 8), while a GPU verifies 8
for about the price of one. So the **gate** measures both sides where they happen: how long a
decode of n tokens takes (every step the engine runs, and a few drafted steps when a draft
length looks worth trying), and how many tokens the drafts of each source would have saved
(every answering step drafts in the shadow, at no decode cost, and the next tokens tell how much
of it was right). It picks the draft length that maximises tokens per second, and none where no
length beats plain decoding.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phi4cli.daemon.llama.prompt_cache import common_prefix

# A draft copies what followed the most recent earlier occurrence of the longest ending of the
# sequence it finds, the last NGRAM_MAX tokens down to NGRAM_MIN. (Chosen on the dev half of the
# real-trace corpus, over a most-frequent-next-token chain and shorter endings:
# bench/speculation.py.)
NGRAM_MAX = 5
NGRAM_MIN = 1
DRAFT_MAX = 8  # the longest draft the gate weighs
ON_DRAFT = 4  # draft length with speculate = on (drafting always, for measuring)
SOURCES = ("own", "siblings", "pool")
POOL_RUNS = 4  # finished answers kept for drafting from (the most recent)
POOL_TOKENS = 8192  # (a longer one is not kept)
GAIN_MIN = 1.05  # drafting must promise this many more tokens/s than plain decoding
# Drafts weighed: a request's own last this many (acceptance drifts along an answer: a loop
# begins, a table is written), and the daemon's, for a request with fewer than OWN_MIN judged.
HISTORY = 32
DAEMON_HISTORY = 512
OWN_MIN = 8


class NgramIndex:
    """Where each 1..5-token run of a token sequence last occurred, grown as the sequence grows.

    A run is indexed once the token after it is known (so the sequence's own end is never found
    in it). Keys are the runs' hashes: a collision only makes a draft that verifying rejects."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self.last: dict[int, int] = {}  # hash of a run -> the position after its latest end
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq = self.tokens
        last = self.last
        for token in tokens:
            end = len(seq)
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                last[hash((n, *seq[end - n :]))] = end
            seq.append(token)

    def find(self, context: Sequence[int]) -> tuple[int, int] | None:
        """The most recent occurrence of the longest ending of ``context`` found: (where what
        followed it begins, the ending's length), or None."""
        for n in range(min(NGRAM_MAX, len(context)), NGRAM_MIN - 1, -1):
            at = self.last.get(hash((n, *context[len(context) - n :])))
            if at is not None:
                return at, n
        return None


class Acceptance:
    """Shadow and real drafts: (drafted, right) for the most recent ``size``, counted so that
    the expectation for any length is a few additions (the gate asks each step)."""

    def __init__(self, size: int = DAEMON_HISTORY) -> None:
        self.judged: deque[tuple[int, int]] = deque(maxlen=size)
        # [j]: how many of them drafted (right) at least j tokens, j = 1..DRAFT_MAX
        self._drafted = [0] * (DRAFT_MAX + 1)
        self._right = [0] * (DRAFT_MAX + 1)

    def add(self, drafted: int, right: int) -> None:
        if len(self.judged) == self.judged.maxlen:
            self._count(*self.judged[0], -1)
        self.judged.append((drafted, right))
        self._count(drafted, right, 1)

    def _count(self, drafted: int, right: int, by: int) -> None:
        for j in range(1, min(drafted, DRAFT_MAX) + 1):
            self._drafted[j] += by
        for j in range(1, min(right, DRAFT_MAX) + 1):
            self._right[j] += by

    def totals(self) -> tuple[int, int]:
        """Tokens drafted and right, over the window (drafts are at most DRAFT_MAX long)."""
        return sum(self._drafted), sum(self._right)

    def expected(self, k: int) -> tuple[float, float]:
        """Per answering step with drafts of at most k: tokens drafted, tokens kept."""
        if not self.judged:
            return 0.0, 0.0
        k = min(k, DRAFT_MAX)
        return sum(self._drafted[1 : k + 1]) / len(self.judged), sum(self._right[1 : k + 1]) / len(
            self.judged
        )


@dataclass(eq=False)
class Drafter:
    """One request's drafting: its own index, and its siblings' and the pool's to fall back on.

    The engine keeps ``own`` in step with the request's sequence (``follow``), and judges one
    shadow draft at a time against the tokens the request then emits (``shadow_judged``): a
    draft proposed, then its outcome known, as if each had been verified."""

    own: NgramIndex = field(default_factory=NgramIndex)
    siblings: list[NgramIndex] = field(default_factory=list)
    pool: Sequence[NgramIndex] = ()
    shadow: list[int] = field(default_factory=list)  # the shadow draft not yet judged
    shadow_at: int = 0  # the sequence's length when it was drafted
    shadow_source: str = ""
    # A draft verified right as far as it was verified: its length and those tokens, added to
    # the judgement of its unverified rest (the shadow), so that a length's worth is not capped
    # by the length drafted.
    shadow_prior: tuple[int, int] = (0, 0)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, kept
    record: Acceptance = field(default_factory=lambda: Acceptance(HISTORY))

    def follow(self, sequence: Sequence[int]) -> None:
        """Index what the sequence gained since last time (after tokens taken back, from where
        it now ends: their counts stay, a little stale)."""
        own = self.own.tokens
        if len(own) > len(sequence):
            del own[len(sequence) :]
        self.own.extend(sequence[len(own) :])

    def draft(self, context: Sequence[int], limit: int) -> tuple[list[int], str]:
        """Up to ``limit`` tokens likely to follow ``context`` (the sequence's end), and where
        they came from ("own", "siblings" or "pool"; "" with no draft): what followed the most
        recent occurrence of the longest ending of it found, the request's own text first."""
        best: tuple[int, int] | None = None
        chosen, source = self.own, ""
        for name, indexes in (
            ("own", (self.own,)),
            ("siblings", self.siblings),
            ("pool", self.pool),
        ):
            for index in indexes:
                found = index.find(context)
                if found is not None and (best is None or found[1] > best[1]):
                    best, chosen, source = found, index, name
            if best is not None and best[1] >= min(NGRAM_MAX, len(context)):
                break  # (the longest ending there is: the nearer source wins)
        if best is None:
            return [], ""
        return chosen.tokens[best[0] : best[0] + limit], source

    def shadow_judged(
        self, sequence: Sequence[int], tail: Sequence[int] = (), cut: bool = False
    ) -> tuple[str, int, int] | None:
        """The shadow draft's outcome once the sequence (and ``tail``, its tokens not yet in
        the KV) tells it: (source, drafted, right); None while it does not yet (the draft is
        dropped, unjudged, where tokens were taken back before it). With ``cut``, what is
        known now: a draft right so far counts as drafted and right as far as it is known."""
        if not self.shadow:
            return None
        start, length = self.shadow_at, len(self.shadow)
        if len(sequence) + len(tail) < start:
            self.shadow = []
            return None
        head = sequence[start : start + length] if start < len(sequence) else []
        offset = max(0, start - len(sequence))
        emitted = [*head, *tail[offset : offset + length - len(head)]]
        right = common_prefix(self.shadow, emitted)
        drafted, kept = self.shadow_prior
        if right == len(emitted) and len(emitted) < length:
            if not cut:
                return None  # right so far: the next tokens tell
            drafted -= length - len(emitted)  # (only what is known)
        outcome = (self.shadow_source, drafted + length, kept + right)
        self.shadow, self.shadow_prior = [], (0, 0)
        return outcome


class DecodeCost:
    """Seconds one step takes by the tokens in its batch, as measured here (a moving mean per
    size); sizes not measured are interpolated between measured ones."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.sizes: list[int] = []  # measured, in order

    def add(self, tokens: int, seconds: float) -> None:
        before = self.seconds.get(tokens)
        if before is None:
            bisect.insort(self.sizes, tokens)
        self.seconds[tokens] = seconds if before is None else 0.7 * before + 0.3 * seconds

    def estimate(self, tokens: float) -> float | None:
        """Seconds for a batch of ``tokens``: measured, or the line between the nearest sizes
        measured below and above (None: nothing measured at or below it)."""
        at = bisect.bisect_left(self.sizes, tokens)
        if at < len(self.sizes) and self.sizes[at] == tokens:
            return self.seconds[self.sizes[at]]
        if at == 0:
            return None
        low = self.sizes[at - 1]
        if at == len(self.sizes):  # past the largest size measured: no cheaper than per token
            return self.seconds[low] * tokens / low
        high = self.sizes[at]
        share = (tokens - low) / (high - low)
        return self.seconds[low] + share * (self.seconds[high] - self.seconds[low])


class Gate:
    """Whether, and how far, to draft: ``mode`` "auto" (the measured best lengths, none where
    drafting does not pay), "on" (ON_DRAFT always) or "off".

    Each step's decision weighs, for every length k up to DRAFT_MAX, the tokens the step would
    emit (one a request, and the drafts' expected right ones) against what a decode of the batch
    grown by the expected drafts costs, measured, or interpolated between the sizes measured. A
    length that looks worth it on an interpolation is drafted at: those steps measure its size,
    and the next decision goes by that."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.cost = DecodeCost()
        # Every answering step's shadow or real draft, judged against what was emitted.
        self.acceptance = Acceptance()
        self.by_source = {name: Acceptance() for name in SOURCES}
        self.drafted = 0  # draft tokens verified (in a decode)
        self.accepted = 0  # of them, kept
        self.chosen: list[int] = []  # the draft lengths of the last decision

    @property
    def watching(self) -> bool:
        """Whether answers draft at all (in the shadow, at least)."""
        return self.mode != "off"

    def decoded(self, tokens: int, seconds: float) -> None:
        """A decode of ``tokens`` took ``seconds``."""
        if seconds > 0.0:
            self.cost.add(tokens, seconds)

    def judge(self, drafter: Drafter, source: str, drafted: int, right: int) -> None:
        """A draft of ``drafter``'s, of ``drafted`` tokens (shadow or real), of which the first
        ``right`` were the tokens emitted."""
        drafter.record.add(drafted, right)
        self.acceptance.add(drafted, right)
        if source:
            self.by_source[source].add(drafted, right)

    def verified(self, drafted: int, kept: int) -> None:
        """A real draft verified: ``kept`` of its ``drafted`` tokens were kept."""
        self.drafted += drafted
        self.accepted += kept

    def lengths(self, drafters: Sequence[Drafter | None]) -> list[int]:
        """The draft length of each answering request of a step (None: one that does not
        draft). The batch's tokens per second are maximised: each request in turn takes the
        length that raises them most beside the lengths before it, by its own drafts' record
        (the daemon's, until it has OWN_MIN), and none where none raises them by GAIN_MIN."""
        if self.mode == "off" or not drafters:
            self.chosen = [0] * len(drafters)
        elif self.mode == "on":
            self.chosen = [ON_DRAFT if drafter is not None else 0 for drafter in drafters]
        else:
            self.chosen = self._best(drafters)
        return self.chosen

    def _best(self, drafters: Sequence[Drafter | None]) -> list[int]:
        streams = len(drafters)
        plain = self.cost.estimate(streams)
        if plain is None:
            return [0] * streams
        drafted_all, kept_all = 0.0, 0.0
        rate = streams / plain  # the batch's tokens per second, with the lengths chosen so far
        chosen = []
        for drafter in drafters:
            best = 0
            if drafter is not None:
                record = drafter.record
                if len(record.judged) < OWN_MIN:
                    record = self.acceptance
                best_rate, counts = rate * GAIN_MIN, (0.0, 0.0)
                for k in range(1, DRAFT_MAX + 1):
                    drafted, kept = record.expected(k)
                    size = streams + drafted_all + drafted  # (a mean: the line prices it)
                    seconds = self.cost.estimate(size) if drafted > 0 else None
                    if seconds is None:
                        continue
                    tried = (streams + kept_all + kept) / seconds
                    if tried > best_rate:
                        best, best_rate, counts = k, tried, (drafted, kept)
                if best:
                    rate = best_rate
                    drafted_all += counts[0]
                    kept_all += counts[1]
            chosen.append(best)
        return chosen

    def describe(self) -> dict[str, Any]:
        """For status and /metrics."""
        by_source = {}
        for name, acceptance in self.by_source.items():
            drafted, right = acceptance.totals()
            if drafted:
                by_source[name] = round(right / drafted, 3)
        base = self.cost.seconds.get(1)
        costs = {
            n: round(s / base, 2) for n, s in sorted(self.cost.seconds.items()) if base and n <= 16
        }
        return {
            "mode": self.mode,
            "draft_lengths": self.chosen,
            "draft_tokens": self.drafted,
            "draft_accepted": self.accepted,
            "acceptance": by_source,  # shadow and real drafts' tokens right, by source
            "decode_cost": costs,  # a decode of n tokens against one of 1
        }


def replay(
    tokens: Sequence[int],
    start: int,
    k: int,
    siblings: Sequence[Sequence[int]] = (),
) -> tuple[int, int, int, int]:
    """Teacher-forced acceptance: emit ``tokens[start:]`` as verification steps drafting up to
    ``k`` tokens each (siblings grown in lockstep); return (tokens emitted, steps, drafted,
    accepted)."""
    own = NgramIndex(tokens[:start])
    others = [NgramIndex(s[:start]) for s in siblings]
    drafter = Drafter(own, others)
    position, steps, drafted, accepted = start, 0, 0, 0
    while position < len(tokens):
        limit = min(k, len(tokens) - position - 1)
        draft, _ = drafter.draft(own.tokens, limit) if limit > 0 else ([], "")
        right = common_prefix(draft, list(tokens[position : position + len(draft)]))
        advance = right + 1
        own.extend(tokens[position : position + advance])
        for other, sibling in zip(others, siblings, strict=True):
            other.extend(sibling[position : position + advance])
        position += advance
        steps += 1
        drafted += len(draft)
        accepted += right
    return len(tokens) - start, steps, drafted, accepted
