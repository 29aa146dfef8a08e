"""What a person sees while a run goes on: the spinner and the load line on stderr, the progress
bar of a file of problems, and notices printed above them. All of it for a terminal; in a pipe,
plain lines or nothing. rich is imported on the first event, after the request has gone out."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phi4cli.client.environment import Environment
from phi4cli.client.exits import Announce
from phi4cli.client.render import human_seconds
from phi4cli.core.protocol import Event, EventKind
from phi4cli.text.sanitize import clean_text

if TYPE_CHECKING:
    from phi4cli.client.problems import ProblemFeed


class StderrStatus:
    """A spinner line on stderr while waiting, for a person at a terminal.

    Started on the first event, not before: the request is on its way to the daemon before rich
    is imported. Not in a pipeline (stdout redirected): plain text only there.
    """

    def __init__(self, env: Environment, message: str) -> None:
        self._wanted = env.terminal and bool(env.stderr_isatty)
        self._env, self._message = env, message  # text, or a renderable
        self._status: Any = None

    @property
    def message(self) -> Any:
        return self._message

    def update(self, message: Any) -> None:
        """Show ``message``: text, or anything rich renders (a ``LoadLine``)."""
        self._message = message
        if self._status is not None:
            self._status.update(message)

    def see(self, _event: Event) -> None:
        if self._wanted and self._status is None:
            from rich.console import Console

            console = Console(file=self._env.stderr, force_terminal=True)
            self._status = console.status(self._message, spinner="dots")
            self._status.start()
            self._env.print_above_live = printer(console)

    def stop(self) -> None:
        if self._status is not None:
            self._env.print_above_live = None
            self._status.stop()
            self._status = None


def printer(console: Any) -> Callable[[str], None]:
    """Print a line through ``console``: above its live display, while one is shown."""

    def print_line(text: str) -> None:
        console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)

    return print_line


class FileProgress:
    """A progress bar on stderr for `--file` and `eval`, only when stderr is a terminal.

    From the start it shows n/N done, how many problems are being solved, and the time taken;
    once one is done, the rate and the time left. With a token ``budget`` (``--max-tokens``) the
    bar also moves as the model writes: a problem counts for the share of its budget it has
    used (at most 0.95 until it is done). While it is shown, lines for the terminal (``notice``,
    and ``out`` when stdout is a terminal too) are printed above the bar through rich's live
    console, never onto the bar's line.
    """

    def __init__(
        self, total: int | None, env: Environment, label: str = "solving", budget: int | None = None
    ) -> None:
        self.total = total  # None: not known yet (a pipe); :meth:`reading` follows the input
        self._feed: ProblemFeed | None = None
        self.env = env
        self.label = label
        self.budget = budget
        self._progress: Any = None
        self._task: Any = None
        self._started: set[int] = set()  # running: the model has written for them
        self._done = 0
        self._pieces: dict[int, int] = {}  # pieces of text written, per running problem
        self._loading = False

    def __enter__(self) -> FileProgress:
        if self.env.stderr_isatty:
            from rich import progress as bar
            from rich.console import Console

            console = Console(file=self.env.stderr, force_terminal=True)
            self._progress = bar.Progress(
                bar.TextColumn("{task.description}"),
                bar.BarColumn(),
                bar.TextColumn("{task.fields[done]}/{task.fields[of]}"),  # done, not partial
                bar.TextColumn("{task.fields[activity]}"),
                bar.TimeElapsedColumn(),
                _RateColumn(),
                console=console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self.label,
                total=self.total or 1,
                activity="",
                done=0,
                of=self._of(),
                known=self.total is not None,
            )
            self._progress.refresh()  # 0/N at once, not at the first tick
            self.env.print_above_live = self._print_above
        return self

    def reading(self, feed: ProblemFeed) -> None:
        """The problems come from ``feed`` (a pipe, its length unknown until it ends): N in
        n/N is what has come so far, with a ``+`` until the input ends."""
        self._feed = feed

    def _of(self) -> str:
        if self.total is not None:
            return str(self.total)
        if self._feed is None:
            return "?"
        return f"{len(self._feed)}" + ("" if self._feed.ended else "+")

    def see(self, index: int, event: Event) -> None:
        """Follow one request's event: it has started once the model writes for it."""
        if self._progress is None:
            return
        kind = event.kind
        loading = (kind == EventKind.ACCEPTED and event.get("state") in ("loading", "warming")) or (
            kind == EventKind.PROGRESS and event.get("stage") in ("loading", "warming")
        )
        if kind == EventKind.RESTART:  # sent again: its pieces so far do not count
            self._pieces.pop(index, None)
            return
        if loading:
            self._loading = True
        elif kind in (EventKind.REASONING, EventKind.TOKEN):
            self._pieces[index] = self._pieces.get(index, 0) + 1
            if index in self._started:
                if self.budget:
                    self._show_completed()
                return
            self._started.add(index)
            self._loading = False
        else:
            return
        self._show_activity()

    def advance(self, index: int) -> None:
        """Problem ``index`` is done."""
        if self._progress is not None:
            self._done += 1
            self._started.discard(index)
            self._pieces.pop(index, None)
            self._show_completed()
            self._show_activity()

    def _show_completed(self) -> None:
        partial = 0.0
        if self.budget:
            partial = sum(min(n / self.budget, 0.95) for n in self._pieces.values())
        done = self._done
        if self.total is None and self._feed is not None:
            known = self._feed.ended
            self._progress.update(
                self._task, total=max(len(self._feed), 1), of=self._of(), known=known
            )
        self._progress.update(self._task, completed=done + partial, done=done)

    def _show_activity(self) -> None:
        running = len(self._started)
        activity = "loading the model" if self._loading else f"{running} running" if running else ""
        self._progress.update(self._task, activity=activity)

    def notice(self, message: str) -> None:
        """One ``phi4:`` line on stderr: above the bar while it is shown (as is every
        ``env.notice`` then, the backend's included)."""
        self.env.notice(message)

    def out(self, text: str) -> None:
        """A line of output on stdout; above the bar when stdout is the bar's terminal too.
        Cleaned of control sequences as ``SolveJob.print`` does (unless ``--raw-output``)."""
        text = text if self.env.raw_stdout else clean_text(text)
        if self._progress is not None and self.env.stdout_isatty:
            self._print_above(text)
        else:
            print(text, file=self.env.stdout, flush=True)

    def _print_above(self, text: str) -> None:
        printer(self._progress.console)(text)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self.env.print_above_live = None
            self._progress.stop()
            self._progress = None


def _RateColumn() -> Any:
    """A rich column: problems a minute (or a second) and the time left, once one is done
    (from the problems done, not the bar's share of budgets, which only guesses)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            elapsed, done = task.elapsed or 0.0, task.fields.get("done", 0)
            if not done or elapsed <= 0:
                return Text("")
            rate = done / elapsed
            shown = f"{rate:.1f}/s" if rate >= 1 else f"{rate * 60:.1f}/min"
            known = task.fields.get("known", True)  # how many in all: not yet from a pipe
            left = (task.total - done) / rate if task.total and known else 0.0
            return Text(f"{shown}, {human_seconds(left)} left" if left > 0 else shown)

    return RateColumn()


class ProgressNotice:
    """Say once on stderr when requests wait for a model to load, and once when they wait for
    room in the daemon's memory. With a ``LoadLine`` that is wanted (a terminal), the wait for
    a load is that live line instead of a notice."""

    def __init__(self, announce: Announce, load_line: LoadLine | None = None) -> None:
        self._announce = announce
        self._said: set[str] = set()
        self._load_line = load_line if load_line is not None and load_line.wanted else None

    def _once(self, topic: str, message: str) -> None:
        if topic not in self._said:
            self._said.add(topic)
            self._announce(message)

    def _loading(self, model: str | None, stage: str, message: str) -> None:
        if self._load_line is not None:
            self._load_line.start(model, stage)
        else:
            self._once("loading", message)

    def see(self, event: Event) -> None:
        kind = event.kind
        if kind == EventKind.PROGRESS and event.get("stage") == "waiting":
            self._once(
                "memory",
                f"waiting for memory: a request reserves {event.get('needed', 0):,} tokens of "
                f"context and {event.get('free', 0):,} are free until a running one finishes",
            )
        elif kind == EventKind.PROGRESS and event.get("stage") in ("loading", "warming"):
            self._loading(
                event.get("model"),
                str(event.get("stage")),
                f"loading {event.get('model', 'the model')}...",
            )
        elif kind == EventKind.PROGRESS and event.get("stage") == "ready":
            if self._load_line is not None and self._load_line.shown:  # reading the question
                self._load_line.start(event.get("model"), "ready")
        elif kind == EventKind.ACCEPTED and event.get("state") in ("loading", "warming"):
            self._loading(
                event.get("model"),
                str(event.get("state")),
                "waiting for the daemon to load the model...",
            )
        elif kind in (EventKind.REASONING, EventKind.TOKEN, EventKind.RETRACT) or kind.terminal:
            self.stop()

    def stop(self) -> None:
        if self._load_line is not None:
            self._load_line.stop()


class LoadLine:
    """At a terminal, while the daemon loads the model a request waits for: one live line with
    what the daemon is doing (loading, then warming up: its ``progress`` events say) and the
    seconds since the command began, gone once the model writes. Shown in the command's spinner when
    it has one (a terminal holds one live line at a time), else in a line of its own."""

    def __init__(self, env: Environment, spinner: StderrStatus | None = None) -> None:
        self.wanted = env.terminal and bool(env.stderr_isatty)
        self._env, self._spinner = env, spinner
        self._began = time.monotonic()
        self._model = "the model"
        self._state = "loading"
        self._live: Any = None
        self._restore: Any = None
        self._shown = False

    def start(self, model: str | None, stage: str = "loading") -> None:
        """Show the line, or say on it what the daemon does now: ``stage`` (loading, warming)
        of ``model``."""
        if model:
            self._model = os.path.basename(model)
        self._state = stage
        if self._shown:
            return
        self._shown = True
        if self._spinner is not None:
            self._restore = self._spinner.message
            self._spinner.update(self)
            return
        from rich.console import Console
        from rich.live import Live
        from rich.spinner import Spinner

        console = Console(file=self._env.stderr, force_terminal=True)
        self._live = Live(
            Spinner("dots", text=self), console=console, transient=True, refresh_per_second=4
        )
        self._live.start(refresh=True)
        self._env.print_above_live = printer(console)

    @property
    def shown(self) -> bool:
        return self._shown

    def stop(self) -> None:
        if not self._shown:
            return
        self._shown = False
        if self._live is not None:
            self._env.print_above_live = None
            self._live.stop()
            self._live = None
        elif self._spinner is not None:
            self._spinner.update(self._restore)

    def __rich__(self) -> Any:
        from rich.text import Text

        now = time.monotonic()
        model = self._model
        doing = {
            "starting": "starting the daemon",
            "loading": f"loading {model}",
            "warming": f"warming up {model}",
            "ready": f"{model} is loaded, reading the question",
        }.get(self._state, f"waiting for {model}")
        return Text(f"{doing}… {now - self._began:.0f} s")
