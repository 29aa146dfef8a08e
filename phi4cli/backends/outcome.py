"""What one request produced, folded from its events: reasoning, solution, answer, stats, error.

The one place events become an answer: ``solve``, ``chat`` and ``serve`` all fold with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from phi4cli.core.errors import ExitStatus, Phi4Error
from phi4cli.core.protocol import ErrorCode, Event, EventKind, Stats
from phi4cli.text.reasoning import GrowingText, extract_final_answer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from phi4cli.text.check_verdicts import Check

    class Answered(Protocol):
        """What the exit status asks of a request's result (an Outcome, or what is kept of it)."""

        @property
        def error(self) -> Event | None: ...
        @property
        def thinking_unfinished(self) -> bool: ...
        @property
        def answer(self) -> str | None: ...
        @property
        def looped(self) -> bool: ...


class Outcome:
    def __init__(self, index: int, question: str) -> None:
        self.index = index
        self.question = question
        self._reasoning = GrowingText()  # (a str's += on an attribute copies it all each time)
        self._solution = GrowingText()
        self.stats: Stats | None = None
        self.error: Event | None = None  # the terminal error event, if the request failed
        self.done = False
        self._answer: tuple[str, str | None] | None = None  # (the solution it is of, answer)
        self.check: Check | None = None  # the answer checked against the question, if it was

    @property
    def reasoning(self) -> str:
        return str(self._reasoning)

    @reasoning.setter
    def reasoning(self, text: str) -> None:
        self._reasoning = GrowingText(text)

    @property
    def solution(self) -> str:
        return str(self._solution)

    @solution.setter
    def solution(self, text: str) -> None:
        self._solution = GrowingText(text)

    @property
    def has_solution(self) -> bool:
        """Whether any solution text came (without joining it)."""
        return bool(self._solution)

    def apply(self, event: Event) -> None:
        """Fold one event into the outcome."""
        kind = event.kind
        if kind == EventKind.TOKEN:
            self._solution.add(event.text)
        elif kind == EventKind.REASONING:
            self._reasoning.add(event.text)
        elif kind == EventKind.RETRACT:
            self._reasoning.add(self.solution)
            self.solution = ""
        elif kind == EventKind.STATS:
            self.stats = event.stats
        elif kind == EventKind.ERROR:
            self.error = event
            self.done = True
        elif kind == EventKind.DONE:
            self.done = True
        elif kind == EventKind.RESTART:  # sent again elsewhere: what came so far is void
            self.reasoning = self.solution = ""
            self.stats = None
            self.check = None

    @property
    def error_code(self) -> ErrorCode | None:
        return None if self.error is None else self.error.code

    @property
    def error_message(self) -> str:
        return "" if self.error is None else self.error.said

    def fail(self, code: ErrorCode, message: str) -> None:
        self.apply(Event.error(code, message))

    def exception(self) -> Phi4Error:
        """The error this request ended with, as the exception the CLI reports."""
        assert self.error is not None, "the request did not fail"
        return self.error.exception()

    @property
    def unsure(self) -> bool:
        """Stopped because its confidence fell below the floor (``--stop-unsure``): what it
        wrote was cut short, and it states no answer."""
        return self.stats is not None and self.stats.finish_reason == "unsure"

    @property
    def answer(self) -> str | None:
        """The solution's final answer (last \\boxed{}, or a "final answer is" sentence); None
        when it states none, an empty ``\\boxed{}`` included, or was stopped as unsure."""
        if self.unsure:
            return None
        if self._answer is None or self._answer[0] is not self.solution:
            self._answer = (self.solution, extract_final_answer(self.solution))
        return self._answer[1]

    @property
    def stats_dict(self) -> dict[str, Any]:
        return {} if self.stats is None else self.stats.to_dict()

    @property
    def thinking_unfinished(self) -> bool:
        return self.stats is not None and self.stats.thinking_unfinished

    @property
    def cut_off(self) -> bool:
        """It stated no answer because --max-tokens cut its answer (its thinking had ended)."""
        return (
            self.answer is None and self.stats is not None and self.stats.finish_reason == "length"
        )

    @property
    def answered_early(self) -> bool:
        """Its thinking was closed because the answer was asked for now (Enter while it
        thought): the model answered from what it had."""
        return self.stats is not None and self.stats.answered_early

    @property
    def looped(self) -> bool:
        """A loop left it without an answer to trust: stopped because its output repeated
        itself (a loop in the answer, ``--loop stop``, a loop whose thinking could not be
        closed), or its looping thinking was closed and the answer asked for stated none."""
        loop = self.stats.loop if self.stats is not None else None
        return loop == "stopped" or (loop == "answered" and self.answer is None)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "index": self.index,
            "question": self.question,
            "answer": self.answer,
            "solution": self.solution,
            "reasoning": self.reasoning,
            # The thinking ran out of tokens before any answer: say so at the top, not only in
            # the stats (the exit status is 1 then).
            "thinking_unfinished": self.thinking_unfinished,
            # The answer was asked for while the model thought (Enter: answer now), and given
            # from what it had: said at the top too.
            "answered_early": self.answered_early,
            "model": self.stats.model if self.stats else None,
            "seed": self.stats.seed if self.stats else None,
            "stats": self.stats_dict,
        }
        if self.check is not None:
            record["check"] = self.check.to_json()
        if self.error is not None:
            record["error"] = {"code": self.error.code.value, "message": self.error.said}
        return record

    @property
    def refuted(self) -> bool:
        """Its answer was checked and found wrong."""
        from phi4cli.text.check_verdicts import REFUTED

        return self.check is not None and self.check.verdict == REFUTED

    @property
    def verified(self) -> bool:
        """Its answer was checked and found right."""
        from phi4cli.text.check_verdicts import VERIFIED

        return self.check is not None and self.check.verdict == VERIFIED


def exit_status(outcomes: Sequence[Answered], answer_required: bool) -> ExitStatus:
    """The exit status of a command's results, the same for one question and a file of them:
    1 when any request failed, any thinking ran out of tokens before an answer, any output
    repeated itself and was stopped, or (with ``--answer-only``) any solution stated no final
    answer. (A lone request's failure is raised
    instead, for its own exit status and message.)"""
    if any(o.error is not None for o in outcomes):
        return ExitStatus.ERROR
    if any(o.thinking_unfinished for o in outcomes):  # no answer: the thinking ran out
        return ExitStatus.ERROR
    if any(o.looped for o in outcomes):
        return ExitStatus.ERROR
    if answer_required and any(o.answer is None for o in outcomes):
        return ExitStatus.ERROR
    return ExitStatus.OK
