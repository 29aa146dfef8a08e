"""Turning daemon events and records into text for people: answer stream, stats, status, models."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, TextIO

from phi4cli.backends.outcome import Outcome
from phi4cli.client.environment import Environment
from phi4cli.core.protocol import Event, EventKind, Stats
from phi4cli.text.sanitize import TextCleaner, clean_text, terminal_text

if TYPE_CHECKING:
    from collections.abc import Sequence

    from phi4cli.text.checking import Check


def human_bytes(size: float | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def human_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def format_stats(stats: Stats) -> str:
    """The ``--verbose`` block, like ``ollama run --verbose``: load, prompt, cache, rates, total."""
    prompt_eval, prompt_s = stats.prompt_eval_tokens, stats.prompt_eval_s
    completion, decode_s = stats.completion_tokens, stats.decode_s
    said = []
    if stats.budget_reached:
        said.append("budget reached")
    elif stats.answered_early:
        said.append("answered early")
    elif stats.thinking_unfinished:
        said.append("unfinished")
    if stats.loop is not None:
        said.append(
            f"looped at {stats.loop_at:,}: "
            + ("ended, the model answered" if stats.loop == "answered" else "stopped")
        )
    if stats.waits:
        said.append(f"{stats.waits} early end{'s' if stats.waits > 1 else ''} made Wait")
    thinking = "; ".join(said)
    rows = [
        ("load time", human_seconds(stats.load_s)),
        (
            "prompt tokens",
            f"{stats.prompt_tokens} ({stats.cached_tokens} cached, {prompt_eval} evaluated)",
        ),
        (
            "prompt eval",
            f"{prompt_s:.3f} s"
            + (f" ({prompt_eval / prompt_s:.1f} tokens/s)" if prompt_s > 0 and prompt_eval else ""),
        ),
        (
            "reasoning tokens",
            f"{stats.reasoning_tokens}" + (f" ({thinking})" if thinking else ""),
        ),
        ("answer tokens", f"{stats.answer_tokens}"),
        ("eval rate", f"{completion / decode_s:.1f} tokens/s" if decode_s > 0 else "-"),
        *(
            [("drafted", f"{stats.draft_tokens} tokens verified, {stats.draft_accepted} kept")]
            if stats.draft_tokens
            else []
        ),
        ("confidence", _confidence(stats)),
        ("first token", human_seconds(stats.first_token_s)),
        ("total", human_seconds(stats.total_s)),
        (
            "finish",
            stats.finish_reason
            if stats.seed is None
            else f"{stats.finish_reason}, seed {stats.seed}",
        ),
    ]
    return "\n".join(f"{label + ':':<18}{value}" for label, value in rows if value is not None)


def _confidence(stats: Stats) -> str | None:
    mean, lowest = stats.confidence, stats.lowest_group_confidence
    if mean is None or lowest is None:
        return None
    return f"{mean:.2f} mean, {lowest:.2f} lowest over a window"


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
    from phi4cli.text.checking import REFUTED, VERIFIED

    detail = terminal_text(clean_text(check.detail))
    if check.verdict == VERIFIED:
        return f"\u2713 verified: {detail}"
    if check.verdict == REFUTED:
        return f"\u2717 refuted: {detail}"
    return f"unchecked: {detail}" if verbose else None


def check_markup(check: Check | None, verbose: bool = False) -> str:
    """:func:`check_line` in rich markup, beside the ``Answer:`` line at a terminal."""
    from rich.markup import escape

    from phi4cli.text.checking import REFUTED, VERIFIED

    line = check_line(check, verbose) if check is not None else None
    if check is None or line is None:
        return ""
    style = {VERIFIED: "green", REFUTED: "bold red"}.get(check.verdict, "dim")
    return f"[{style}]{escape(line)}[/{style}]"


def plan_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The daemon's memory plan as (label, text) rows, for `phi4 warm` and `phi4 status`."""
    if not plan:
        return []
    layers = plan.get("gpu_layers", 0)
    many = "s" if plan["parallel"] != 1 else ""
    if plan.get("kv_layout") == "streams":
        at_once = (
            f"{plan['slots']} request{'s' if plan['slots'] != 1 else ''}, a stream of "
            f"{plan['request_capacity']:,} tokens each (kv_layout streams)"
        )
    else:
        at_once = (
            f"{plan['parallel']} such request{many}; up to {plan['slots']} shorter ones "
            "(one shared cache)"
        )
    rows = [
        (
            "KV cache",
            f"{plan['n_ctx']:,} tokens x {human_bytes(plan['kv_bytes_per_token'])} "
            f"({plan['kv_cache_type']}) = {human_bytes(plan['kv_bytes'])}"
            + (", set by n_ctx" if plan.get("n_ctx_source") == "setting" else ""),
        ),
        (
            "per request",
            f"{plan['request_tokens']:,} tokens (prompt, thinking and answer) "
            "unless --max-tokens says otherwise",
        ),
        ("at once", at_once),
        (
            "offload",
            f"{'all' if layers < 0 else layers} layers on {plan.get('device')}"
            if layers
            else "none (CPU)",
        ),
    ]
    return rows + [("note", note) for note in plan.get("notes", [])]


def format_warm(timings: dict[str, Any]) -> str:
    """The `phi4 warm` table: stage to RAM, load, warm-up decode, system-prompt prefill, total."""
    if timings.get("staged"):
        how = "copied to" if timings.get("stage_copied") else "reused"
        stage = f"{timings.get('stage_s', 0):.2f} s ({how} {timings.get('loaded_from')})"
    elif timings.get("stage_note"):
        stage = f"skipped: {timings['stage_note']}"
    else:
        stage = "off"
    prefill = timings.get("prefill")
    prefill_how = "restored from the saved state" if prefill == "restored" else "computed, saved"
    steps = [timings.get(key) or 0.0 for key in ("stage_s", "load_s", "warmup_s", "prefill_s")]
    mlock = timings.get("mlock")
    rows = [
        ("model", timings.get("model")),
        ("stage to RAM", stage),
        ("load (mmap)", f"{timings.get('load_s', 0):.2f} s" + (", mlock" if mlock else "")),
        ("warm-up decode", f"{timings.get('warmup_s', 0):.3f} s"),
        (
            "system prompt",
            f"{timings.get('prefill_s', 0):.3f} s "
            f"({timings.get('system_tokens', 0)} tokens, {prefill_how})",
        ),
        ("total", f"{sum(steps):.2f} s"),
    ]
    if timings.get("start_cells"):
        rows.append(
            (
                "",
                f"(answers from {timings['start_cells']:,} cells while the whole KV "
                "cache is made in the background)",
            )
        )
    if timings.get("already_loaded"):
        rows.append(("", "(already warm: these are the timings of its load)"))
    rows += plan_rows(timings.get("memory") or {})
    return clean_text("\n".join(f"{key:<16}{value}" for key, value in rows))


def _speculation_row(speculation: dict[str, Any]) -> str:
    """Exact self-speculation now: the mode, the gate's length, drafts kept, and what each
    source's drafts would have had right."""
    mode, lengths = speculation.get("mode"), speculation.get("draft_lengths") or []
    if mode == "off":
        return "off"
    drafted, kept = speculation.get("draft_tokens", 0), speculation.get("draft_accepted", 0)
    if any(lengths):
        row = f"{mode}: drafting {'/'.join(str(n) for n in lengths)} a step"
    else:
        row = f"{mode}: not drafting now"
    row += f"; {kept:,} of {drafted:,} drafted tokens kept"
    sources = speculation.get("acceptance") or {}
    if sources:
        row += " (right: " + ", ".join(f"{name} {share:.0%}" for name, share in sources.items())
        row += ")"
    return row


def _threads_row(memory: dict[str, Any]) -> str:
    """How many threads decode now, and why."""
    now, most = memory["threads"], memory.get("threads_max", memory["threads"])
    if not memory.get("threads_adapt"):
        return f"{now} (fixed: --threads or a single core)"
    measured = memory.get("threads_measured") or {}
    speeds = ", ".join(f"{rate:g} tokens/s on {count}" for count, rate in measured.items())
    said = f"; measured {speeds}" if speeds else ""
    if now < most:
        return f"{now} of {most} (the fastest the free cores allow{said})"
    return f"{now} (fewer while other processes keep cores busy or one fewer decodes faster{said})"


def format_status(status: dict[str, Any]) -> str:
    served = status.get("requests_served", 0)
    active = status.get("requests_active", 0)
    queued = status.get("queued", 0)
    memory = status.get("memory") or {}
    # "active" counts the queued too: say running and queued, the words of the kv row below.
    running = memory.get("running", max(0, active - queued))
    keep_alive = status.get("keep_alive_s")
    if status.get("idle_s") is None:
        idle = "busy"
    elif keep_alive is not None and keep_alive < 0:
        idle = f"{human_seconds(status['idle_s'])} (stays resident: keep_alive forever)"
    else:
        idle = (
            f"{human_seconds(status['idle_s'])} "
            f"(exits in {human_seconds(status.get('keep_alive_left_s'))})"
        )
    rows = [
        ("state", status.get("state")),
        ("model", status.get("model") or "-"),
        ("pid", status.get("pid")),
        ("uptime", human_seconds(status.get("uptime_s"))),
        ("memory", human_bytes(status.get("rss_bytes"))),
        ("requests", f"{served:,} served; now {running:,} running, {queued:,} queued"),
        ("idle", idle),
        ("context", f"{status['n_ctx']:,} tokens" if status.get("n_ctx") else "planned at load"),
    ]
    if memory:
        rows.append(
            (
                "kv now",
                f"{memory['reserved_tokens']:,} reserved by {memory['running']} "
                f"running, {memory['free_tokens']:,} free, "
                f"{memory['idle_cached_tokens']:,} cached for reuse",
            )
        )
        kept = memory.get("prompt_cache")
        if kept:
            rows.append(
                (
                    "prompts",
                    f"{kept['prompts']:,} kept in RAM, "
                    f"{human_bytes(kept['bytes'])} of "
                    f"{human_bytes(kept['max_bytes'])}; put back "
                    f"{counted(kept['hits'], 'time')} "
                    f"({kept['hit_tokens']:,} tokens not read again)",
                )
            )
        speculation = memory.get("speculation")
        if speculation:
            rows.append(("speculation", _speculation_row(speculation)))
        growing = memory.get("context_growing_s")
        if growing is not None:
            rows.append(
                (
                    "kv growing",
                    f"answering from {memory['context_cells']:,} of its "
                    f"{memory['n_ctx']:,} cells while the whole context is "
                    f"made (for {human_seconds(growing)}; requests may "
                    "reserve the whole)",
                )
            )
    if memory.get("threads"):
        rows.append(("threads", _threads_row(memory)))
    waiting = status.get("waiting")
    if waiting:
        rows.append(
            (
                "waiting",
                f"for memory: the next request needs {waiting['needed']:,} "
                f"tokens, {waiting['free']:,} are free",
            )
        )
    rows += plan_rows(memory.get("plan") or {})
    rows += [("socket", status.get("socket")), ("log", status.get("log"))]
    if status.get("error"):
        rows.insert(1, ("error", status["error"]))
    return clean_text("\n".join(f"{key:<12}{value}" for key, value in rows))


def format_setting(key: str, value: Any) -> str:
    """One setting's value as `phi4 config show` and `config set` print it: durations as
    written (30m), booleans as config.toml spells them, None as what it means for that key."""
    from phi4cli.core.config import format_duration
    from phi4cli.core.machine import physical_cores

    if key in ("keep_alive", "backend_timeout", "backend_deadline"):
        return format_duration(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # the backend's replicas
        return " ".join(value)
    if value is None:
        if key == "threads":
            return f"auto ({physical_cores()} physical cores)"
        from phi4cli.core.options import SETTING

        return SETTING[key].none if key in SETTING else "none"
    return str(value)


def format_settings(sources: dict[str, tuple[Any, str]]) -> str:
    """`phi4 config show`: each setting, its value and where the value comes from."""
    width = max(map(len, sources))
    lines = [
        f"{key:<{width}}  {format_setting(key, value):<24}  {source}"
        for key, (value, source) in sources.items()
    ]
    return clean_text("\n".join(lines))  # a system prompt in the config is anyone's text


def format_models(rows: list[Any]) -> str:
    """`phi4 models`: each alias and every other .gguf, its size, and where it is or comes from."""
    width = max(len(row.name) for row in rows)
    lines = []
    for row in rows:
        state = human_bytes(row.size) if row.present else "not on disk"
        lines.append(f"{row.name:<{width}}  {state:>11}  {row.description}")
        fetch = f"phi4 pull {row.name}" if row.source.startswith("hf:") else row.source
        where = row.path if row.present else f"get it: {fetch}"
        lines.append(f"{'':<{width}}  {'':>11}  {where}")
    return clean_text("\n".join(lines))


def format_rows(rows: list[tuple[str, object]], gap: int = 2) -> str:
    """Label-value rows, labels padded to the longest: status, /show, /help and the like."""
    width = max((len(label) for label, _ in rows), default=0) + gap
    return clean_text("\n".join(f"{label:<{width}}{value}" for label, value in rows))


def counted(number: int, one: str, many: str | None = None) -> str:
    """``1 turn``, ``2 turns``; ``many`` where the plural is not ``one`` and an s."""
    return f"{number} {one if number == 1 else many or one + 's'}"


def format_chat_show(
    conversation: Any, stats: Stats, model: str, settings: str, n_ctx: object
) -> str:
    """The chat's `/show`: the conversation, its model and settings, context use and cache."""
    used = stats.context_used
    return format_rows(
        [
            ("conversation", f"{conversation.name} ({counted(len(conversation.turns), 'turn')})"),
            ("model", model),
            ("system", conversation.system or "(the model default)"),
            ("settings", settings),
            (
                "context",
                f"{used} of {n_ctx} tokens used"
                if used
                else f"{n_ctx} tokens, unused"
                if isinstance(n_ctx, int)
                else f"{n_ctx}, unused",
            ),
            ("cached", f"{stats.cached_tokens} tokens of the last prompt came from cache"),
            ("dropped", f"{conversation.dropped} oldest turn(s) no longer in the model's context"),
        ],
        gap=1,
    )


def format_chat_list(entries: list[tuple[str, int, float]]) -> str:
    """The chat's `/list`: (name, turns, seconds since last saved), most recent first."""
    if not entries:
        return "no saved conversations"
    return clean_text(
        "\n".join(
            f"{name}  {turns} turns, {human_seconds(age)} ago" for name, turns, age in entries
        )
    )


def format_eval(summary: dict[str, Any], seconds: float, output: object) -> str:
    """`phi4 eval`'s table: how many right, wrong, unanswered; pass@k; thinking; time."""
    total = summary["problems"]

    def share(count: int) -> str:
        return f"{count:,}  ({count / total:.1%})" if total else f"{count:,}"

    rows: list[tuple[str, object]] = [
        ("problems", f"{total:,}"),
        ("correct", share(summary["correct"])),
        ("wrong", share(summary["wrong"])),
        ("no answer", share(summary["no_answer"])),
        ("truncated", share(summary["truncated"]) + "  (the thinking ran out of tokens)"),
        ("errors", share(summary["error"])),
    ]
    if "samples" in summary:
        rows[1] = ("correct", share(summary["correct"]) + f"  (majority of {summary['samples']})")
        taken = "  (some sample taken was right)" if summary.get("adaptive") else ""
        rows.insert(2, (f"pass@{summary['samples']}", share(summary["pass_at_k_count"]) + taken))
        used = f"{summary['mean_samples_used']:.1f} a problem of at most {summary['samples']}"
        if summary.get("adaptive"):
            used += " (each stops once its vote is settled)"
        if summary.get("samples_unsure"):
            used += f"; {summary['samples_unsure']:,} stopped as unsure"
        rows.insert(3, ("samples", used))
    rows.append(
        ("thinking", f"{summary['mean_reasoning_tokens']:,.0f} tokens a solution on average")
    )
    if "completion_tokens" in summary:
        by = "by the samples taken" if "samples" in summary else "in all"
        rows.append(
            ("tokens", f"{summary['completion_tokens']:,} written {by} (thinking included)")
        )
    confidence = summary.get("mean_confidence")
    if confidence:

        def mean(status: str) -> str:
            value = confidence.get(status)
            return "-" if value is None else f"{value:.2f}"

        said = f"{mean('correct')} right, {mean('wrong')} wrong (the answers' mean lowest window)"
        rows.append(("confidence", said))
    checks = summary.get("checks")
    if checks:
        decided = checks["verified"] + checks["refuted"]
        rows.append(
            (
                "checked",
                f"{decided:,} answers decided: {checks['verified']:,} verified, "
                f"{checks['refuted']:,} refuted; {checks['wrong_verdicts']:,} "
                "against the references",
            )
        )
    rows += [("time", f"{human_seconds(seconds)} this run"), ("results", str(output))]
    return format_rows(rows)


def format_replicas(replicas: list[dict[str, Any]]) -> str:
    """`phi4 status --backend`: a line per server, up (what it serves, how fast it answered,
    its load) or down (why)."""
    lines = []
    for replica in replicas:
        if replica["state"] == "up":
            how = f"answered in {replica['probe_s']:.2f} s  {_replica_load(replica)}"
            if replica.get("models"):
                how = f"serving {', '.join(replica['models'])}  {how}"
        else:
            how = replica["reason"] or ""
        lines.append(f"{replica['replica']}  {replica['state']}  {how}")
    return clean_text("\n".join(lines))


def _replica_load(replica: dict[str, Any]) -> str:
    """ "in flight 3, waiting 0, answered 120, 45.2 tokens/s": what the server's /metrics says
    (a part it does not publish is left out)."""
    parts = [
        f"{label} {int(replica[key]):,}"
        for key, label in (
            ("in_flight", "in flight"),
            ("waiting", "waiting"),
            ("answered", "answered"),
        )
        if replica.get(key) is not None
    ]
    if replica.get("tokens_per_s") is not None:
        parts.append(f"{replica['tokens_per_s']:g} tokens/s")
    return ", ".join(parts) if parts else "(it publishes no load metrics)"
