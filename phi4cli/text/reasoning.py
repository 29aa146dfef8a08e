"""Reasoning-model output: the streaming ``<think>`` splitter, final-answer extraction, voting.

Pure functions and small state machines; no I/O. Both the daemon (which counts reasoning tokens
for ``--think-budget``) and the client (which folds reasoning away) use them.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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


class GrowingText:
    """Text that grows piece by piece, in time linear in its length. ``self.text += piece`` on
    an attribute copies the whole text at each piece (CPython grows a string in place only where
    nothing else holds it): a remote engine's 64 MiB answer in 512-byte pieces was an hour of a
    client's CPU that way. Reading it joins the pieces, once for all the reads until the next."""

    __slots__ = ("_parts", "_size")

    def __init__(self, text: str = "") -> None:
        self._parts = [text] if text else []
        self._size = len(text)

    def add(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._size += len(text)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __str__(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


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
        # Blanks before the first text, kept apart from ``_pending`` (a stream of nothing but
        # blanks would otherwise be copied and stripped again at each piece).
        self._blank = GrowingText()
        self.opened = False  # an explicit <think> was seen
        self.closed = False  # </think> was seen
        self._reasoning = GrowingText()
        self._answer = GrowingText()
        self.retracted = False  # answer text already passed on turned out to be reasoning

    @property
    def reasoning(self) -> str:
        return str(self._reasoning)

    @property
    def answer(self) -> str:
        return str(self._answer)

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
        if self._state == "start" and not self._pending:
            stripped = text.lstrip()
            self._blank.add(text[: len(text) - len(stripped)])
            text = stripped
        self._pending += text
        pieces: list[tuple[str, str]] = []
        while self._pending:
            if self._state == "start":
                if self._pending.startswith(THINK_OPEN):
                    self._pending = self._pending[len(THINK_OPEN) :]
                    self._state, self.opened = REASONING, True
                    self._blank = GrowingText()
                    continue
                if THINK_OPEN.startswith(self._pending):
                    return pieces  # might still become <think>
                self._state = REASONING if self._presumed_reasoning else ANSWER
                self._pending = self._take_blank() + self._pending
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

    def closing_at(self, text: str) -> int | None:
        """Where the end of thinking would begin, in the held-back text followed by ``text``,
        if feeding ``text`` now would end the thinking; else None."""
        if not self.in_reasoning or self.closed:
            return None
        index = (self.held + text).find(THINK_CLOSE)
        return index if index >= 0 else None

    @property
    def held(self) -> str:
        """The text held back (the start of what may be a tag)."""
        return str(self._blank) + self._pending if self._blank else self._pending

    def drop_held(self) -> None:
        """Forget the held-back text: the end of thinking it began is taken back."""
        self._pending = ""
        self._blank = GrowingText()

    def _take_blank(self) -> str:
        blank, self._blank = str(self._blank), GrowingText()
        return blank

    def finish(self) -> list[tuple[str, str]]:
        """Flush whatever was held back at the end of the stream."""
        pieces: list[tuple[str, str]] = []
        if self._state == "start":
            self._pending = self._take_blank() + self._pending
        if self._pending:
            kind = ANSWER if self._state == "start" and not self._presumed_reasoning else None
            kind = kind or (REASONING if self.in_reasoning else ANSWER)
            self._emit(pieces, kind, self._pending)
            self._pending = ""
        return pieces

    def _retract_answer(self) -> None:
        self._reasoning.add(str(self._answer))
        self._answer = GrowingText()
        self.retracted = True

    def _emit(self, pieces: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if kind == ANSWER and not self._answer:
            text = text.lstrip("\n")  # the blank line after </think> is layout, not answer
            if not text:
                return
        if kind == REASONING:
            self._reasoning.add(text)
        else:
            self._answer.add(text)
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


_BRACE = re.compile(r"(?<!\\)[{}]")  # a brace that is not escaped (\\{ is a literal brace)
_BARE_ANSWER = re.compile(r"[^\s$.,;]{1,200}")  # \\boxed 5: a short bare answer, no braces


@functools.lru_cache(maxsize=8)
def _brace_pairs(text: str) -> dict[int, int]:
    """Map the index of every ``{`` that is closed in ``text`` to the index of its ``}``.

    One pass with a stack, so finding the groups of a text costs the same whatever its nesting
    (scanning forward from each opening brace was quadratic in nested or unbalanced text).
    Cached: the renderer asks for several groups of the same text."""
    pairs: dict[int, int] = {}
    opened: list[int] = []
    for match in _BRACE.finditer(text):
        if match.group() == "{":
            opened.append(match.start())
        elif opened:
            pairs[opened.pop()] = match.start()
    return pairs


def braced_group(text: str, start: int) -> str | None:
    """Return the content of the balanced ``{...}`` group opening at ``start`` (None if open)."""
    close = _brace_pairs(text).get(start)
    return None if close is None else text[start + 1 : close]


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) of the content of every ``\\boxed{...}`` and ``\\boxed 5``, in order of
    where each box opens; linear in the text, however the boxes nest."""
    pairs = _brace_pairs(text)
    spans: list[tuple[int, int]] = []
    for match in _BOXED.finditer(text):
        end = match.end()
        if end < len(text) and text[end] == "{":
            close = pairs.get(end)
            if close is not None:
                spans.append((end + 1, close))
        else:
            bare = _BARE_ANSWER.match(text, end)
            if bare:
                spans.append(bare.span())
    return spans


def boxed_answers(text: str) -> list[str]:
    """Return the contents of every ``\\boxed{...}`` (nested braces kept) and ``\\boxed 5``."""
    return [text[start:end].strip() for start, end in _boxed_spans(text)]


def _stated(answer: str) -> str | None:
    """The answer, or None when it states nothing: ``\\boxed{}``, ``\\boxed{ }``, ``\\boxed{\\,}``
    are no answer, the same as no box at all."""
    answer = answer.strip()
    unboxed = re.sub(r"\\(?:boxed|fbox)|[{}$]", "", answer)  # \\boxed{\\boxed{}} is empty too
    return answer if normalize_answer(unboxed) else None


def _strip_math(answer: str) -> str:
    answer = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left + right):
            answer = answer[len(left) : -len(right)].strip()
    return answer.rstrip(".").strip()


def extract_final_answer(solution: str) -> str | None:
    """Return the final answer of a solution, or None when it states none (never a guess).

    The last ``\\boxed{...}`` that holds something wins (an empty box states nothing); failing
    that, the last "final answer is ..." sentence. Linear in the solution's length.
    """
    for start, end in reversed(_boxed_spans(solution)):
        answer = _stated(solution[start:end])
        if answer is not None:
            return answer
    sentences = _FINAL_SENTENCE.findall(solution)
    if sentences:
        answer = _strip_math(sentences[-1])
        inner = [box for box in boxed_answers(answer) if _stated(box) is not None]
        return _stated(inner[-1] if inner else answer)
    return None


@functools.lru_cache(maxsize=1024)  # a vote normalises each answer once per pair it is in
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


class Vote(NamedTuple):
    """The outcome of self-consistency voting."""

    answer: str | None  # the winning answer in its most common written form; None: no answers
    votes: int
    total: int
    tie: bool  # the winner shares the top count with another answer (earliest one wins)
    members: tuple[int, ...] = ()  # which samples gave the winning answer
    runner_up: int = 0  # votes (samples) of the answer that came next (most votes, or weight)

    @property
    def agreement(self) -> str:
        return f"{self.votes}/{self.total}"


Equal = Callable[[str, str], bool]

# A comparison's budget: math-verify takes milliseconds on real answers; one that runs longer is
# given up and compared as text. Answers that would make SymPy compute giant numbers in one C
# call (which nothing can interrupt) are refused before parsing: see symbolic_too_costly.
COMPARISON_BUDGET_S = 2.0  # real answers take milliseconds to half a second on a busy machine
_MAX_SYMBOLIC_CHARS = 200
_MAX_SYMBOLIC_DEPTH = 12
_MAX_LITERAL_EXPONENT = 10_000
_MAX_LITERAL_FACTORIAL = 1_000
_SMALL_NUMBER = re.compile(r"-?\d{1,6}(?:[./]\d{1,6})?|-?\\frac\{?\d{1,6}\}?\{?\d{1,6}\}?")
# Commands that are operators, not symbols: an exponent made of numbers and these is a number.
_OPERATORS = re.compile(r"\\(?:cdot|times|div|[dt]?frac|sqrt|left|right|mathrm|text)(?![a-zA-Z])")


def _symbolic(text: str) -> bool:
    """Whether ``text`` names a symbol (``x``, ``\\pi``), so SymPy keeps it unevaluated."""
    return re.search(r"[a-zA-Z]", _OPERATORS.sub("", text)) is not None


def _argument_at(text: str, start: int) -> tuple[str, int]:
    """The operand written at ``start`` (a ``{...}`` or ``(...)`` group, a number, a command or
    one character) and where it ends; an open group runs to the end."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        return "", start
    if text[start] in "{(":
        closer = "}" if text[start] == "{" else ")"
        depth = 0
        for index in range(start, len(text)):
            if text[index] == text[start]:
                depth += 1
            elif text[index] == closer:
                depth -= 1
                if depth == 0:
                    return text[start + 1 : index], index + 1
        return text[start + 1 :], len(text)
    token = re.compile(r"\d+(?:\.\d+)?|\\[a-zA-Z]+|.", re.DOTALL).match(text, start)
    assert token is not None
    return token.group(), token.end()


def _operand_before(text: str, end: int) -> str:
    """The operand written just before ``end``: a ``{...}`` or ``(...)`` group, or a number or
    letter with any ``!`` after it."""
    index = end
    while index > 0 and text[index - 1] == " ":
        index -= 1
    if index > 0 and text[index - 1] in "})":
        closer = text[index - 1]
        opener = "{" if closer == "}" else "("
        depth = 0
        for start in range(index - 1, -1, -1):
            if text[start] == closer:
                depth += 1
            elif text[start] == opener:
                depth -= 1
                if depth == 0:
                    return text[start:index]
        return text[:index]
    token = re.search(r"(?:\d+|[a-zA-Z])?!*$", text[:index])
    return token.group() if token else ""


@functools.lru_cache(maxsize=1024)
def symbolic_too_costly(answer: str) -> bool:
    """Whether comparing ``answer`` symbolically could cost more than a vote can wait: very long
    or deeply nested text, a factorial of anything but a small number, a power of numbers whose
    exponent is not a small number (``9^{9^{9}}``, ``2^{10^{6}}``, ``10^{100000}``). Such an
    answer is compared as text. Costs time linear in the (capped) answer."""
    text = normalize_answer(answer).replace("**", "^")
    if len(text) > _MAX_SYMBOLIC_CHARS:
        return True
    depth = deepest = 0
    for char in text:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]":
            depth -= 1
    if deepest > _MAX_SYMBOLIC_DEPTH:
        return True
    for bang in re.finditer(r"!(?!=)", text):
        number = re.search(r"(\d+)\s*$", text[: bang.start()])
        if number is None:
            if not _symbolic(text):  # (10^6)! or 5!!: numbers all the same, too big to tell
                return True
        elif int(number.group(1)) > _MAX_LITERAL_FACTORIAL:
            return True
    for caret in re.finditer(r"\^", text):
        exponent, end = _argument_at(text, caret.end())
        if _symbolic(exponent):
            continue  # symbolic: SymPy keeps x^{y^{z}} as it is
        following = text[end:].lstrip(" ")
        if following.startswith("^") or not _SMALL_NUMBER.fullmatch(exponent.strip()):
            return True
        number = re.match(r"-?\d+", exponent.strip())
        if number and abs(int(number.group())) > _MAX_LITERAL_EXPONENT:
            return True
        base = _operand_before(text, caret.start())
        raised = base.count("^") + base.count("!")
        if (
            raised
            and not _symbolic(base)
            and (raised > 1 or not number or int(number.group()) > 10)
        ):
            return True  # (2^{9999})^{9999}, 1000!^{1000}: a small exponent of a huge number
    return bool(re.search(r"\\[dt]?binom\{\d{6,}|\\Gamma|\\uparrow", text))


class _OverBudget(BaseException):
    """Raised into a comparison that ran past its budget (a BaseException, so that the
    ``except Exception`` of math-verify and SymPy lets it through)."""


class ComparisonTooCostly(Exception):
    """A comparison ran past its budget."""


def _within_budget(seconds: float, work: Callable[[], bool]) -> bool:
    """Return ``work()``, or raise ComparisonTooCostly once it has run ``seconds``.

    Works in any thread: a watchdog thread raises into this one (``PyThreadState_SetAsyncExc``)
    rather than by a signal, which only the main thread can take. The raise lands between
    bytecodes: a single long C call is not interrupted, hence ``symbolic_too_costly``."""
    import ctypes
    import threading

    target = ctypes.c_ulong(threading.get_ident())
    finished = threading.Event()
    lock = threading.Lock()
    fired = False

    def interrupt() -> None:
        nonlocal fired
        wait = seconds
        while not finished.wait(wait):
            with lock:
                if finished.is_set():
                    return
                fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(target, ctypes.py_object(_OverBudget))
            wait = 0.1  # again, in case a bare "except:" swallowed it

    def disarm() -> None:
        with lock:
            finished.set()
            if fired:  # one set but not raised yet must not land in the caller
                ctypes.pythonapi.PyThreadState_SetAsyncExc(target, None)

    watchdog = threading.Thread(target=interrupt, name="phi4-compare-budget", daemon=True)
    try:
        try:
            watchdog.start()
            return work()
        finally:
            disarm()
    except _OverBudget:
        # The raise may have landed inside disarm, before the watchdog was told to stop (and it
        # raises again until it is): disarm until one has run to its end.
        while True:
            try:
                disarm()
                break
            except _OverBudget:
                continue
        raise ComparisonTooCostly from None


class AnswerComparer:
    """Decides whether two final answers are the same, in bounded time, and counts the
    comparisons it had to decide as text (too costly to compare symbolically)."""

    def __init__(self, budget_s: float = COMPARISON_BUDGET_S) -> None:
        self.budget_s = budget_s
        self.as_text = 0  # comparisons given up and decided on the normalised text alone
        self._costly: set[str] = set()  # answers that ran out of budget once: text from now on

    def __call__(self, a: str, b: str) -> bool:
        """Whether two final answers are the same mathematically: ``\\frac12``, ``0.5`` and
        ``x = \\frac{1}{2}`` are; so are ``x = 2 \\text{ or } x = 3`` and ``\\{3, 2\\}``.

        Decided by HuggingFace's math-verify (LaTeX and plain forms parsed to SymPy), imported
        only when a vote needs it; what it cannot parse is compared as normalised text, and so is
        what is too costly to compare (counted in ``as_text``)."""
        if normalize_answer(a) == normalize_answer(b):
            return True
        if {a, b} & self._costly or symbolic_too_costly(a) or symbolic_too_costly(b):
            self.as_text += 1
            return False
        verify = _math_verify()
        if verify is None:
            return False
        try:
            return _within_budget(self.budget_s, lambda: _verified(verify, a, b))
        except ComparisonTooCostly:
            self._costly.update((a, b))
            self.as_text += 1
            return False

    def notice(self) -> str | None:
        """The one line to tell the user, if any comparison was decided as text."""
        if not self.as_text:
            return None
        count = self.as_text
        noun = "comparison was" if count == 1 else "comparisons were"
        return f"{count} answer {noun} too costly; compared them as text"


def _verified(verify: Any, a: str, b: str) -> bool:
    left, right = _parsed(a), _parsed(b)
    if not left or not right:
        return False
    try:
        return bool(
            verify(left, right, timeout_seconds=None) or verify(right, left, timeout_seconds=None)
        )
    except Exception:  # a parse it cannot compare: not the same, as far as anyone can tell
        return False


@functools.lru_cache(maxsize=1)
def _math_verify() -> Any:
    """math-verify's ``verify``, with its logging silenced (its own per-pair "Timeout during
    comparison" warnings, and the note that its signal-based timeout is off: ours replaces it,
    and works off the main thread). None when it cannot be imported."""
    import logging

    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # their modules' loggers inherit it
    try:
        from math_verify import verify

        _parsed("\\frac{1}{2}")  # the parser's first use builds its tables: not on any budget
    except Exception:
        return None
    return verify


def same_answer(a: str, b: str) -> bool:
    """Whether two final answers are the same mathematically (see AnswerComparer), each
    comparison bounded in time; for a count of those decided as text, use an AnswerComparer."""
    return AnswerComparer()(a, b)


# lru_cache keeps only parses that finished: one cut short by its budget raises, caching nothing.
@functools.lru_cache(maxsize=512)
def _parsed(answer: str) -> Any:
    try:
        from math_verify import parse

        return parse(f"${_strip_math(answer)}$", parsing_timeout=None)
    except Exception:
        return []


def majority_vote(
    answers: Sequence[str | None],
    equal: Equal = same_answer,
    weights: Sequence[float] | None = None,
) -> Vote:
    """Vote over sample answers (None = no answer): equal answers (``equal``) count together,
    and the winner is reported in its most common written form; ties go to the answer that came
    first. With ``weights`` (one per answer: DeepConf's confidence-weighted vote), the answer
    whose samples weigh most wins; ``votes`` still counts its samples."""
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

    if weights is not None and len(weights) != len(answers):
        raise ValueError(f"{len(weights)} weights for {len(answers)} answers")

    def weight(members: list[int]) -> float:
        if weights is None:
            return len(members)
        return sum(w for w in (weights[i] for i in members) if math.isfinite(w) and w > 0)

    heaviest = max(weight(members) for members in classes)
    leaders = [m for m in classes if math.isclose(weight(m), heaviest, rel_tol=1e-9)]
    winner = leaders[0]
    top = len(winner)
    written = [answers[i] or "" for i in winner]
    forms = Counter(normalize_answer(w) for w in written)
    best = max(forms.values())
    form = next(w for w in written if forms[normalize_answer(w)] == best)
    others = sorted((len(members) for members in classes if members is not winner), reverse=True)
    return Vote(
        form, top, len(answers), len(leaders) > 1, tuple(winner), others[0] if others else 0
    )


# Stop once the leader leads with 93%: 3 of 3 agreeing. Adaptive-Consistency's paper uses 95%
# (4 of 4); in bench/adaptive_samples.py's simulation 93% took 1.8x fewer samples than K = 8 at
# 99.9% agreement with the full-K majority, 95% 1.5x at 100%.
STOP_CONFIDENCE = 0.93


def leader_confidence(leader: int, runner_up: int) -> float:
    """How sure the votes so far make it that the leading answer is the more likely of the two
    most common: P(p1 > p2) for p1 ~ Beta(leader + 1, runner_up + 1), the Beta stopping rule of
    Adaptive-Consistency, exactly (for whole counts, P(Binomial(leader + runner_up + 1, 1/2)
    <= leader))."""
    from math import comb

    n = leader + runner_up + 1
    return float(sum(comb(n, k) for k in range(leader + 1)) / 2**n)


def vote_settled(vote: Vote, left: int, confidence: float = STOP_CONFIDENCE) -> bool:
    """Whether more samples are worth asking for: not when the ``left`` still to come cannot
    change the leader, or when the leader leads with ``confidence`` (3 of 3 agreeing: 0.9375,
    4 of 4: 0.97)."""
    if vote.votes == 0:
        return False  # no answer yet: nothing to be sure of
    if vote.votes > vote.runner_up + left:
        return True
    return not vote.tie and leader_confidence(vote.votes, vote.runner_up) >= confidence
