"""Reasoning-model output: the streaming ``<think>`` splitter, final-answer extraction, voting.

Pure functions and small state machines; no I/O. Both the daemon (which counts reasoning tokens
for ``--think-budget``) and the client (which folds reasoning away) use them.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from phi4cli.records import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING = "reasoning"
ANSWER = "answer"
RETRACT = "retract"  # a piece kind: all answer text passed on so far was reasoning after all

# Reasoning models that may omit the opening tag (Phi-4-mini-reasoning does) are recognised by
# their name; output of any other model is an answer unless it starts with <think>.
_THINKING_MODEL = re.compile(r"reason|think|r1\b|qwq", re.IGNORECASE)


def model_thinks(*names: str) -> bool:
    """Return True when a model's names say it thinks before answering."""
    return any(_THINKING_MODEL.search(name) for name in names if name)


def _partial_suffix(text: str, tag: str) -> int:
    """Return the length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkSplitter:
    """Split streamed text into reasoning and answer pieces, however the tags are chunked.

    ``feed`` returns ``(kind, text)`` pieces in order, ``kind`` being ``reasoning`` or ``answer``;
    the tags themselves are not passed on. Text is held back only while it could still be the
    start of a tag.
    """

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._presumed_reasoning = starts_in_reasoning
        self._state = "start"  # start -> reasoning | answer
        self._pending = ""
        self.opened = False  # an explicit <think> was seen
        self.closed = False  # </think> was seen
        self.reasoning = ""
        self.answer = ""
        self.retracted = False  # answer text already passed on turned out to be reasoning

    @property
    def in_reasoning(self) -> bool:
        if self._state == "start":
            return self._presumed_reasoning
        return self._state == REASONING

    @property
    def unfinished(self) -> bool:
        """True when the stream ended (or stands) inside the thinking, with no answer begun."""
        return self.in_reasoning and not self.closed

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._pending += text
        pieces: list[tuple[str, str]] = []
        while self._pending:
            if self._state == "start":
                stripped = self._pending.lstrip()
                if not stripped:
                    return pieces
                if stripped.startswith(THINK_OPEN):
                    self._pending = stripped[len(THINK_OPEN) :]
                    self._state, self.opened = REASONING, True
                    continue
                if THINK_OPEN.startswith(stripped):
                    return pieces  # might still become <think>
                self._state = REASONING if self._presumed_reasoning else ANSWER
                continue
            if self._state == ANSWER and self.closed:
                self._emit(pieces, ANSWER, self._pending)
                self._pending = ""
                break
            # In reasoning, look for the end of it. In an answer that no </think> has closed yet,
            # look too: a model that omits <think> may still close its thinking.
            kind = self._state
            index = self._pending.find(THINK_CLOSE)
            if index >= 0:
                if kind == ANSWER:
                    self._retract_answer()
                    pieces.append((RETRACT, ""))
                self._emit(pieces, REASONING, self._pending[:index])
                self._pending = self._pending[index + len(THINK_CLOSE) :]
                self._state, self.closed = ANSWER, True
                continue
            keep = _partial_suffix(self._pending, THINK_CLOSE)
            self._emit(pieces, kind, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return pieces

    def finish(self) -> list[tuple[str, str]]:
        """Flush whatever was held back at the end of the stream."""
        pieces: list[tuple[str, str]] = []
        if self._pending:
            kind = ANSWER if self._state == "start" and not self._presumed_reasoning else None
            kind = kind or (REASONING if self.in_reasoning else ANSWER)
            self._emit(pieces, kind, self._pending)
            self._pending = ""
        return pieces

    def _retract_answer(self) -> None:
        self.reasoning += self.answer
        self.answer = ""
        self.retracted = True

    def _emit(self, pieces: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if kind == ANSWER and not self.answer:
            text = text.lstrip("\n")  # the blank line after </think> is layout, not answer
            if not text:
                return
        if kind == REASONING:
            self.reasoning += text
        else:
            self.answer += text
        if pieces and pieces[-1][0] == kind and kind != RETRACT:
            pieces[-1] = (kind, pieces[-1][1] + text)
        else:
            pieces.append((kind, text))


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str, str]:
    """Return ``(reasoning, answer)`` of a complete output."""
    splitter = ThinkSplitter(starts_in_reasoning)
    splitter.feed(text)
    splitter.finish()
    return splitter.reasoning, splitter.answer


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_FINAL_SENTENCE = re.compile(
    r"final answer\s*(?:is|:|=)\s*:?\s*(.+?)(?:\.\s|\.$|\n|$)", re.IGNORECASE
)


def braced_group(text: str, start: int) -> str | None:
    """Return the content of the balanced ``{...}`` group opening at ``start`` (None if open)."""
    depth = 0
    for index in range(start, len(text)):
        char = text[index]
        if char == "\\":
            continue
        if char == "{" and (index == 0 or text[index - 1] != "\\"):
            depth += 1
        elif char == "}" and text[index - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index]
    return None


def boxed_answers(text: str) -> list[str]:
    """Return the contents of every ``\\boxed{...}`` (nested braces kept) and ``\\boxed 5``."""
    found: list[str] = []
    for match in _BOXED.finditer(text):
        end = match.end()
        if end < len(text) and text[end] == "{":
            content = braced_group(text, end)
            if content is not None:
                found.append(content.strip())
        else:
            bare = re.match(r"[^\s$.,;]+", text[end:])
            if bare:
                found.append(bare.group(0))
    return found


def _strip_math(answer: str) -> str:
    answer = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left + right):
            answer = answer[len(left) : -len(right)].strip()
    return answer.rstrip(".").strip()


def extract_final_answer(solution: str) -> str | None:
    """Return the final answer of a solution, or None when it states none (never a guess).

    The last ``\\boxed{...}`` wins; failing that, the last "final answer is ..." sentence.
    """
    boxes = boxed_answers(solution)
    if boxes:
        return boxes[-1]
    sentences = _FINAL_SENTENCE.findall(solution)
    if sentences:
        answer = _strip_math(sentences[-1])
        inner = boxed_answers(answer)
        return inner[-1] if inner else (answer or None)
    return None


def normalize_answer(answer: str) -> str:
    """Return a canonical form of an answer for comparing samples: spacing, \\dfrac, \\left..."""
    text = _strip_math(answer)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\(?:left|right|displaystyle|,|;|!|\s)", "", text)
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\s+", "", text)
    text = re.sub(r"^[a-zA-Z]\s*=", "", text)  # "x = 5" and "5" agree
    if re.fullmatch(r"-?\d+\.0+", text):
        text = text.split(".")[0]
    return text


class Vote(Record):
    """The outcome of self-consistency voting."""

    answer: str | None  # the winning answer in its most common written form; None: no answers
    votes: int
    total: int
    tie: bool  # the winner shares the top count with another answer (earliest one wins)
    members: tuple[int, ...] = ()  # which samples gave the winning answer

    @property
    def agreement(self) -> str:
        return f"{self.votes}/{self.total}"


Equal = Callable[[str, str], bool]


def same_answer(a: str, b: str) -> bool:
    """Whether two final answers are the same mathematically: ``\\frac12``, ``0.5`` and
    ``x = \\frac{1}{2}`` are; so are ``x = 2 \\text{ or } x = 3`` and ``\\{3, 2\\}``.

    Decided by HuggingFace's math-verify (LaTeX and plain forms parsed to SymPy), imported only
    when a vote needs it; what it cannot parse is compared as normalised text.
    """
    if normalize_answer(a) == normalize_answer(b):
        return True
    left, right = _parsed(a), _parsed(b)
    if not left or not right:
        return False
    try:
        from math_verify import verify

        return bool(verify(left, right) or verify(right, left))
    except Exception:  # a parse it cannot compare: not the same, as far as anyone can tell
        return False


@functools.lru_cache(maxsize=512)
def _parsed(answer: str) -> Any:
    try:
        from math_verify import parse

        return parse(f"${_strip_math(answer)}$")
    except Exception:
        return []


def majority_vote(answers: Sequence[str | None], equal: Equal = same_answer) -> Vote:
    """Vote over sample answers (None = no answer): equal answers (``equal``) count together,
    and the winner is reported in its most common written form; ties go to the answer that came
    first."""
    classes: list[list[int]] = []
    for index, answer in enumerate(answers):
        if answer is None or not normalize_answer(answer):
            continue
        for members in classes:
            first = answers[members[0]]
            assert first is not None
            if equal(first, answer):
                members.append(index)
                break
        else:
            classes.append([index])
    if not classes:
        return Vote(answer=None, votes=0, total=len(answers), tie=False)
    top = max(len(members) for members in classes)
    leaders = [members for members in classes if len(members) == top]
    winner = leaders[0]
    written = [answers[i] or "" for i in winner]
    forms = Counter(normalize_answer(w) for w in written)
    best = max(forms.values())
    form = next(w for w in written if forms[normalize_answer(w)] == best)
    return Vote(form, top, len(answers), len(leaders) > 1, tuple(winner))


def _first_seen(items: Iterable[str | None]) -> list[str | None]:
    seen: list[str | None] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
