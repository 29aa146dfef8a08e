"""The thinking policy: what phi4 does while a model thinks, the one place that decides it.

An engine (the daemon's, on the tokens it decodes; a remote one, on a server's stream) tells a
:class:`ThinkingPolicy` what happened — a piece of text, the thinking closing, a count of
thinking tokens, whether the end of thinking it was told to write fitted — and acts on the
:class:`Act` it gets back: go on, close the thinking so the model answers, take the end of
thinking back and write "Wait" in its place, or stop. The policy does no I/O and holds every
cap, so the two engines cannot drift apart; it also keeps what its decisions were, for the
request's Stats (``budget_reached``, ``loop``, ``loop_at``, ``waits``).

- ``--think-budget N``: once N tokens of thinking are written, close the thinking (once).
- ``--min-think N``: an end of thinking before N tokens becomes "Wait" (s1's budget forcing),
  at most ``MAX_WAITS`` times, never after phi4 closed the thinking itself.
- ``--loop answer|stop|off`` (:mod:`phi4cli.text.loops` says what a loop is): a loop in the
  thinking closes it so the model answers (``answer``, once; the answer is then watched
  afresh), or stops the request (``stop``); a loop in the answer always stops it.
- Answer now (a key while the model thinks, the protocol's ``adjust`` with ``answer_now``):
  close the thinking (once) at the engine's next count, as a budget reached does; no "Wait"
  after it. Asked once the thinking is over, it changes nothing.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from phi4cli.text.loops import LoopDetector

if TYPE_CHECKING:
    from phi4cli.core._settings import Ask

# Ends of thinking turned into "Wait" that one answer may take: a model that keeps closing its
# thinking at once would otherwise be asked again until its token limit.
MAX_WAITS = 16


class Act(StrEnum):
    GO_ON = "go on"
    ANSWER = "answer"  # close the thinking: the model answers
    WAIT = "wait"  # take the end of thinking back and write "Wait" in its place
    STOP = "stop"  # stop the request: it ends as a loop


class ThinkingPolicy:
    """One request's thinking policy (see the module docstring). ``tokens`` are what the engine
    counts: llama.cpp tokens in the daemon, streamed pieces from a server."""

    def __init__(self, think_budget: int | None, min_think: int, loop: str) -> None:
        self.think_budget, self.min_think, self.loop_policy = think_budget, min_think, loop
        self.detector: LoopDetector | None = None if loop == "off" else LoopDetector()
        self.budget_reached = False
        self.loop: str | None = None  # "answered" (the thinking was closed there) or "stopped"
        self.loop_at: int | None = None  # tokens written when the loop was caught
        self.waits = 0
        self.answered_early = False  # the thinking was closed because the answer was asked now
        self._now_asked = False  # answer now was asked (acted on or not)
        self._now_pending = False  # ... and not acted on yet
        self._closing_for: str | None = None  # why the engine was asked to close the thinking

    @classmethod
    def asked(cls, ask: Ask) -> ThinkingPolicy:
        """The policy a request asks for: both engines make theirs here."""
        return cls(ask.think_budget, ask.min_think, ask.loop)

    def text(self, text: str, in_reasoning: bool, tokens: int) -> Act:
        """A piece of the output was written (thinking when ``in_reasoning``), ``tokens`` in
        all by now: ANSWER or STOP when it loops, else GO_ON."""
        if self.detector is None or self.loop == "stopped" or not self.detector.feed(text):
            return Act.GO_ON
        self.loop_at = tokens
        if in_reasoning and self.loop is None and self.loop_policy == "answer":
            self._closing_for = "loop"
            return Act.ANSWER
        self.loop = "stopped"
        return Act.STOP

    def answer_now(self) -> None:
        """The answer is asked for now (the user's key): the next count while the model
        thinks closes the thinking. Asking again changes nothing; so does asking once the
        thinking is over (the request answers already)."""
        if not self._now_asked:
            self._now_asked = self._now_pending = True

    def counted(self, reasoning_tokens: int, in_reasoning: bool) -> Act:
        """After a token: ANSWER once the answer is asked for now or the thinking reaches
        --think-budget, else GO_ON."""
        if self._now_pending and in_reasoning and self.loop is None and not self.budget_reached:
            self._now_pending = False
            self._closing_for = "now"
            return Act.ANSWER
        if (
            self.think_budget is not None
            and in_reasoning
            and not self.budget_reached
            and not self.answered_early
            and self.loop is None
            and reasoning_tokens >= self.think_budget
        ):
            self._closing_for = "budget"
            return Act.ANSWER
        return Act.GO_ON

    def closed(self, fitted: bool) -> Act:
        """The engine wrote the end of thinking it was asked for (``fitted``) or found no room
        for it. A loop that cannot be answered is stopped; a budget that cannot be closed lets
        the thinking run to the token limit."""
        reason, self._closing_for = self._closing_for, None
        if reason == "budget":
            self.budget_reached = fitted
            return Act.GO_ON
        if reason == "now":
            self.answered_early = fitted
            return Act.GO_ON
        if fitted:
            self.loop, self.detector = "answered", LoopDetector()  # the answer, watched afresh
            return Act.GO_ON
        self.loop = "stopped"
        return Act.STOP

    def closing(self, reasoning_tokens: int) -> Act:
        """The model ends its thinking after ``reasoning_tokens``: WAIT while under
        --min-think (not for an answer with no thinking at all, 0 tokens; not once phi4 closed
        the thinking itself, nor once the answer was asked for now; not after MAX_WAITS), else
        GO_ON."""
        if (
            0 < reasoning_tokens < self.min_think
            and not self.budget_reached
            and not self._now_asked
            and self.loop is None
            and self.waits < MAX_WAITS
        ):
            return Act.WAIT
        return Act.GO_ON

    def waited(self) -> None:
        """The engine wrote "Wait" in place of an end of thinking."""
        self.waits += 1

    @property
    def stopped(self) -> bool:
        return self.loop == "stopped"

    def stats(self) -> dict[str, object]:
        """The request's Stats fields this policy decides."""
        return {
            "budget_reached": self.budget_reached,
            "loop": self.loop,
            "loop_at": self.loop_at,
            "waits": self.waits,
            "answered_early": self.answered_early,
        }
