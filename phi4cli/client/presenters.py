"""Showing one answer to a person: the plain presenter, for pipes (the solution as written,
cleaned), and the terminal's (a live thinking line, the solution as Markdown with readable math,
the answer on a line of its own); the Markdown made of a solution, the lines said when there is
no answer, and a check's verdict.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, TextIO

from phi4cli.backends.outcome import Outcome
from phi4cli.client.environment import Environment
from phi4cli.client.render import format_stats
from phi4cli.core.protocol import Event, EventKind
from phi4cli.text.sanitize import TextCleaner, clean_text, terminal_text

if TYPE_CHECKING:
    from collections.abc import Sequence

    from phi4cli.text.check_verdicts import Check


# A run of `*` between two operands is multiplication (12*13, x_1*x_2, (a+b)*(c+d), 2**3), never
# emphasis; `*` beside a space (`a * b`, a `* ` bullet, `**bold**` at a word's edge) stays
# Markdown. The lookbehind is one character wide, so each run is tried once: linear.
_PRODUCT = re.compile(r"(?<=[^\W_)\]}!'′])\*+(?=[^\W_(\[{√+\-−.])")  # noqa: RUF001 - prime
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


# A character reference, as Markdown decodes it (CommonMark: up to 6 hex or 7 decimal digits, or
# an HTML5 entity name).
_ENTITY = re.compile(r"&(?:#[xX]([0-9a-fA-F]{1,6})|#([0-9]{1,7})|([A-Za-z][A-Za-z0-9]{1,31}));")


def _escape_entities(prose: str) -> str:
    """Escape (``\\&``) each entity that Markdown would decode into something phi4 does not
    show as it is (&#x202e; would reach the screen as a real U+202E): it is shown as written."""
    out: list[str] = []
    position = 0
    for match in _ENTITY.finditer(prose):
        start = match.start()
        hexadecimal, decimal, name = match.groups()
        if name is not None:
            from html.entities import html5

            decoded = html5.get(name + ";", "")
        else:
            code = int(hexadecimal, 16) if hexadecimal is not None else int(decimal)
            decoded = chr(code) if code <= 0x10FFFF else ""
        if terminal_text(decoded) == decoded and clean_text(decoded) == decoded:
            continue
        backslashes = start
        while backslashes > position and prose[backslashes - 1] == "\\":
            backslashes -= 1
        if (start - backslashes) % 2 == 0:  # an odd run escapes the & already: \&#x202e;
            out.append(prose[position:start] + "\\")
            position = start
    out.append(prose[position:])
    return "".join(out)


def _escape_math(prose: str) -> str:
    """Escape what Markdown would take from math in ``prose`` (outside code): `*` in products,
    and `<`, which would open an HTML tag and hide ``x<y and y>z`` up to the `>`."""
    prose = _PRODUCT.sub(lambda match: "\\*" * len(match.group(0)), prose)
    if "&" in prose:
        prose = _escape_entities(prose)
    return prose.replace("<", "\\<")


def markdown_source(solution: str) -> str:
    """Return the (cleaned) solution as Markdown for the terminal: math converted to Unicode
    and escaped so that no character of it is lost or read as Markdown; code left as written;
    invisible characters shown (``<U+200B>``) and no entity decoded into one or into a control."""
    from phi4cli.text.latex import latex_to_unicode

    # Shown before rich lays the text out, so that lines are wrapped at the width shown.
    lines = terminal_text(latex_to_unicode(solution)).split("\n")
    in_fence = False
    for number, line in enumerate(lines):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        # Inline code spans: the odd pieces between backticks are left as written.
        pieces = line.split("`")
        pieces[::2] = [_escape_math(piece) for piece in pieces[::2]]
        lines[number] = "`".join(pieces)
    return "\n".join(lines)


def _markdown(solution: str) -> Any:
    """The solution as rich renders it at a terminal. A link shows its address in full, as text,
    rather than as an OSC 8 hyperlink: a model cannot hide where a link goes.

    Its lines are the model's, as in a pipe: Markdown joins the lines of a paragraph
    (``1\\n2\\n3`` would be ``1 2 3``), so each line break the parser found inside a paragraph
    (a soft break) is made a hard one. Only the parser knows where a paragraph is, so lists,
    tables, code, headings and quotes are read as before."""
    from rich.markdown import Markdown

    markdown = Markdown(markdown_source(clean_text(solution)), hyperlinks=False)
    for block in markdown.parsed:
        for token in block.children or ():
            if token.type == "softbreak":
                token.type = "hardbreak"
    return markdown


def unfinished(outcome: Outcome, message: str) -> str:
    """The line for an error that ended ``outcome`` after some of its solution was shown (the
    daemon stopped or crashed, a connection lost, a server that hung up): ``message``, and that
    the answer above is unfinished, as a Ctrl-C's line says. (Decided from what was shown: no
    door's words are read.)"""
    if not outcome.solution.strip():
        return message
    return f"{message}; the answer above is unfinished"


def no_answer_reason(outcome: Outcome) -> str:
    if outcome.looped and outcome.answer is not None:
        return (
            "the output repeated itself and was stopped: its answer may be cut short (--loop "
            "answer ends looping thinking so the model answers; a loop in the answer is stopped)"
        )
    if outcome.looped and outcome.stats is not None and outcome.stats.loop == "answered":
        return (
            "no final answer: the thinking repeated itself and was ended there, and the answer "
            "then asked for stated none (ask again, or with --samples)"
        )
    if outcome.looped and not outcome.reasoning.strip():
        # No thinking (a model that does not think, or --think-budget 0): the answer looped.
        return (
            "no final answer: the answer repeated itself and was stopped (ask again, or with "
            "--samples)"
        )
    if outcome.looped:
        return (
            "no final answer: the output repeated itself and was stopped (--loop answer "
            "ends looping thinking so the model answers)"
        )
    if outcome.thinking_unfinished:
        return "no final answer: the thinking did not finish (raise --max-tokens or --think-budget)"
    if outcome.stats is not None and outcome.stats.finish_reason == "length":
        return "no final answer: the answer was cut off at --max-tokens (raise it)"
    return "no final answer stated in the solution"


def loop_cut(outcome: Outcome) -> str | None:
    """The line for thinking the loop rule ended so that the model answered, where that answer
    stated one (every other loop's line is :func:`no_answer_reason`'s); None otherwise."""
    stats = outcome.stats
    if stats is None or stats.loop != "answered" or outcome.answer is None:
        return None
    at = f" after {stats.loop_at:,} tokens" if stats.loop_at else ""
    return (
        f"the thinking repeated itself and was ended{at}, so the model answered from what "
        "it had (--loop off lets it run)"
    )


def no_vote_reason(samples: Sequence[Outcome]) -> str:
    """Why a vote over ``samples`` (those not cancelled) has no answer, none of them stating
    one, and what to do: one line."""
    ended = [o for o in samples if o.error is None]  # (the failed ones are said on their own)
    count = len(samples)
    head = f"no final answer: none of the {count} samples stated one"
    if ended and all(o.unsure for o in ended):
        return f"{head}, each was stopped as unsure (ask again without --stop-unsure)"
    unfinished = sum(o.thinking_unfinished for o in ended)
    if unfinished:
        return (
            f"{head}, the thinking of {unfinished} did not finish (raise --max-tokens or "
            "--think-budget)"
        )
    if ended and all(o.stats is not None and o.stats.loop == "stopped" for o in ended):
        return (
            f"{head}, each repeated itself and was stopped (--loop answer ends looping "
            "thinking so the model answers)"
        )
    return f'{head} (as \\boxed{{...}} or "the final answer is"): ask again, or with more --samples'


class PlainPresenter:
    """For pipes: the solution streams to stdout as written, cleaned of control sequences
    (unless ``raw``); reasoning only on stderr, if asked, always cleaned."""

    def __init__(
        self, out: TextIO, err: TextIO, show_reasoning: bool, verbose: bool, raw: bool = False
    ) -> None:
        self.out, self.err = out, err
        self.show_reasoning, self.verbose = show_reasoning, verbose
        self._last = {"out": "\n", "err": "\n"}
        self._cleaners = {"out": None if raw else TextCleaner(), "err": TextCleaner()}

    def _write(self, stream: str, text: str, cleaned: bool = False) -> None:
        cleaner = self._cleaners[stream]
        if cleaner is not None and not cleaned:
            text = cleaner.feed(text)
        if not text:
            return
        handle = self.out if stream == "out" else self.err
        handle.write(text)
        handle.flush()
        self._last[stream] = text[-1]

    def _end_line(self, stream: str) -> None:
        cleaner = self._cleaners[stream]
        if cleaner is not None:
            self._write(stream, cleaner.flush(), cleaned=True)
        if self._last[stream] != "\n":
            self._write(stream, "\n", cleaned=True)

    def on_event(self, event: Event) -> None:
        kind, text = event.kind, event.text
        if kind == EventKind.TOKEN and text:
            self._write("out", text)
        elif kind == EventKind.REASONING and self.show_reasoning and text:
            self._write("err", text)

    def abort(self) -> None:
        """End partial lines so an error message starts on a line of its own."""
        self._end_line("err")
        self._end_line("out")

    def show_partial(self, outcome: Outcome) -> None:
        """After Ctrl-C or an error mid-answer: the partial solution has streamed already; end
        its line."""
        self.abort()

    def finish(self, outcome: Outcome) -> None:
        self.abort()
        if self.verbose and outcome.stats is not None:
            print(format_stats(outcome.stats), file=self.err, flush=True)


class TerminalPresenter:
    """For a person: a live "thinking" line, the solution as Markdown with readable math, and the
    final answer highlighted on its own line."""

    def __init__(self, show_reasoning: bool, verbose: bool, env: Environment | None = None) -> None:
        from rich.console import Console

        if env is None:
            self.out = Console(highlight=False)
            self.err = Console(stderr=True, highlight=False)
        else:
            # NO_COLOR takes the colour away, not the view: bold, dim and the live lines stay.
            self.out = Console(file=env.stdout, highlight=False, no_color=not env.colour or None)
            self.err = Console(file=env.stderr, highlight=False, no_color=not env.colour or None)
        self.show_reasoning, self.verbose = show_reasoning, verbose
        self._started = time.monotonic()
        self._thought_s: float | None = None  # how long the thinking took, once it ended
        self._reasoning_tokens = 0
        self._reasoning_cleaner = TextCleaner()
        self._solution = ""
        self._status: Any = None
        self._live: Any = None
        self._last_refresh = 0.0
        self._reasoning_open = False
        self.key_hint: str | None = None  # a key the live line offers (keys.ANSWER_NOW_HINT)
        self._answering_now = False  # that key was pressed: the answer is asked for now

    def _thinking_line(self) -> str:
        elapsed = time.monotonic() - self._started
        line = f"thinking… {elapsed:.1f} s · {self._reasoning_tokens} tokens"
        if self._answering_now:
            return f"{line} · answering now…"
        return f"{line} · {self.key_hint}" if self.key_hint else line

    def answering_now(self) -> None:
        """The answer was asked for now (Enter while it thinks): the live line says so, and
        the line left once the thinking ends says it was answered early."""
        self._answering_now = True
        if self._status is not None:
            self._status.update(self._thinking_line())

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _tail(self) -> Any:
        from rich.text import Text

        from phi4cli.text.latex import latex_to_unicode

        height = max(3, self.out.size.height - 2)
        shown = terminal_text(latex_to_unicode(clean_text(self._solution)))
        wrapped = Text(shown).wrap(self.out, self.out.width)
        return Text("\n").join(wrapped[-height:])

    def on_event(self, event: Event) -> None:
        kind, text = event.kind, event.text
        now = time.monotonic()
        if kind == EventKind.REASONING:
            self._reasoning_tokens += 1
            if self.show_reasoning:
                self._reasoning_open = True
                shown = self._reasoning_cleaner.feed(text)
                self.err.print(shown, style="dim", end="", markup=False, soft_wrap=True)
            elif self._status is None:
                self._status = self.err.status(self._thinking_line(), spinner="dots")
                self._status.start()
            elif now - self._last_refresh > 0.1:
                self._status.update(self._thinking_line())
                self._last_refresh = now
        elif kind in (EventKind.TOKEN, EventKind.RETRACT):
            self._stop_status()
            if self._reasoning_open:
                self.err.print(self._reasoning_cleaner.flush(), style="dim", markup=False)
                self._reasoning_open = False
            self._thought()  # the spinner goes; this trace of it stays, above the answer
            self._solution = self._solution + text if kind == EventKind.TOKEN else ""
            if self._live is None:
                from rich.live import Live

                # While it streams, show the tail of the solution; the whole of it is printed
                # once, as Markdown, when it is complete (a live region taller than the screen
                # cannot be redrawn).
                self._live = Live(
                    self._tail(), console=self.out, transient=True, auto_refresh=False
                )
                self._live.start()
            if now - self._last_refresh > 0.08:
                self._live.update(self._tail(), refresh=True)
                self._last_refresh = now

    def abort(self) -> None:
        self.stop()
        if self._reasoning_open:
            self.err.print()
            self._reasoning_open = False

    def stop(self) -> None:
        """Take down the live parts (also on Ctrl-C), leaving the terminal clean."""
        self._stop_status()
        if self._live is not None:
            self._live.stop()
            self._live = None

    def finish(self, outcome: Outcome) -> None:
        self.print_outcome(outcome, agreement=None)

    def show_partial(self, outcome: Outcome) -> None:
        """After Ctrl-C or an error mid-answer: put what was written of the solution on screen
        (the live region was erased), without an answer line."""
        self.abort()
        if outcome.solution.strip():
            self.out.print(_markdown(outcome.solution))

    def _thought(self, early: bool | None = None) -> None:
        """Once the thinking is over: a dim line on stderr saying how long it took, where the
        live line was (at a terminal only, once), and whether the answer was asked for before
        it ended (``early``; None: whether it was asked for here)."""
        if self._reasoning_tokens and self._thought_s is None and self.err.is_terminal:
            self._thought_s = time.monotonic() - self._started
            early = self._answering_now if early is None else early
            said = " (answered early)" if early else ""
            self.err.print(f"Thought for {self._thought_s:.1f} s{said}", style="dim", markup=False)

    def print_outcome(
        self,
        outcome: Outcome,
        agreement: str | None,
        answer: str | None = None,
        reason: str | None = None,
    ) -> None:
        """Show ``outcome``'s solution and its answer (``answer``: another, a vote's); without
        one, ``reason`` (default: why ``outcome`` states none)."""
        from phi4cli.text.latex import math_to_unicode

        self.stop()
        if self._reasoning_open:
            self.err.print(self._reasoning_cleaner.flush(), style="dim", markup=False)
        # No answer came after the thinking: say it here, answered early as its stats say.
        self._thought(outcome.stats is not None and outcome.stats.answered_early)
        if outcome.solution.strip():
            self.out.print(_markdown(outcome.solution))
        final = outcome.answer if answer is None else answer
        suffix = f"  [dim]({agreement})[/dim]" if agreement else ""
        check = check_markup(outcome.check, self.verbose) if final is not None else ""
        suffix += f"  {check}" if check else ""
        if final is not None:
            from rich.markup import escape

            shown = escape(terminal_text(math_to_unicode(clean_text(final))))
            self.out.print(f"[bold green]Answer:[/bold green] [bold]{shown}[/bold]{suffix}")
        else:
            from rich.markup import escape

            why = escape(reason or no_answer_reason(outcome))
            self.out.print(f"[yellow]{why}[/yellow]{suffix}")
        if self.verbose and outcome.stats is not None:
            self.err.print(format_stats(outcome.stats), style="dim", markup=False)


def check_line(check: Check, verbose: bool = False) -> str | None:
    """A check's verdict in one line (``✓ verified: 12·13 = 156``), or None for ``unchecked``
    (said only when ``verbose``)."""
    from phi4cli.text.check_verdicts import REFUTED, VERIFIED

    detail = terminal_text(clean_text(check.detail))
    if check.verdict == VERIFIED:
        return f"\u2713 verified: {detail}"
    if check.verdict == REFUTED:
        return f"\u2717 refuted: {detail}"
    return f"unchecked: {detail}" if verbose else None


def check_markup(check: Check | None, verbose: bool = False) -> str:
    """:func:`check_line` in rich markup, beside the ``Answer:`` line at a terminal."""
    from rich.markup import escape

    from phi4cli.text.check_verdicts import REFUTED, VERIFIED

    line = check_line(check, verbose) if check is not None else None
    if check is None or line is None:
        return ""
    style = {VERIFIED: "green", REFUTED: "bold red"}.get(check.verdict, "dim")
    return f"[{style}]{escape(line)}[/{style}]"
