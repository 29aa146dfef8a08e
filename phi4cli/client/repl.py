"""The ``phi4 chat`` REPL: input with history and slash commands, answers streamed from the
daemon, where the conversation's tokens stay cached between turns.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory

from phi4cli.backends.backend import Backend, RequestStream
from phi4cli.backends.outcome import Outcome
from phi4cli.client.chat_commands import COMMAND_NAMES
from phi4cli.client.chats import ChatStore, Conversation, Turn
from phi4cli.client.environment import Environment
from phi4cli.client.exits import Announce, say
from phi4cli.client.history import History
from phi4cli.client.keys import ANSWER_NOW_HINT, AnswerKeys, AnswerNow
from phi4cli.client.presenters import PlainPresenter, TerminalPresenter, loop_cut, unfinished
from phi4cli.client.render import format_stats
from phi4cli.core._settings import Ask
from phi4cli.core.atomicfile import RefusedFileError, read_user_file, write_atomic, write_problem
from phi4cli.core.config import Settings
from phi4cli.core.errors import DaemonGoneError, Phi4Error, RequestError, cli_words
from phi4cli.core.inputs import replace_bad
from phi4cli.core.options import SETTABLE
from phi4cli.core.protocol import PRIORITY_INTERACTIVE, ErrorCode, Op, SolveParams, Stats
from phi4cli.text.checker import Checker
from phi4cli.text.sanitize import clean_text

PROMPT = "phi4> "
CONTINUATION = "... "
HISTORY_LIMIT = 1000
CONTEXT_WARNING = 0.8


Reader = Callable[[str], str | None]  # prompt -> line; None at end of input


class Interrupts:
    """Ctrl-C (SIGINT) during a chat, taken only where it is safe to stop.

    Python's own handler raises KeyboardInterrupt at whatever line runs: in the middle of rich
    starting its live display (which then fails to stop: "IndexError: pop from empty list"),
    between reading a line and starting the answer (the Ctrl-C then counted as one at the
    prompt). Here a Ctrl-C raises only inside ``allowed()`` — around the waits for the daemon
    and for piped input — and is otherwise noted, for ``take()`` at the next safe point.
    """

    def __init__(self) -> None:
        self.pending = False
        self._raising = False
        self._previous: Any = None
        self.installed = False

    def _handler(self, signum: int, frame: object) -> None:
        if self._raising:
            self._raising = False  # a second Ctrl-C in the except block is noted, not raised
            raise KeyboardInterrupt
        self.pending = True

    def install(self) -> None:
        # Only the main thread may set signal handlers; elsewhere (an embedding caller's
        # thread) Python's default stays, and KeyboardInterrupt is handled where it lands.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, self._previous)
            self.installed = False

    def take(self) -> bool:
        """Whether a Ctrl-C came since the last take (and forget it)."""
        pending, self.pending = self.pending, False
        return pending

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """A wait that a Ctrl-C may break with KeyboardInterrupt (one noted before, too)."""
        self._raising = True
        try:
            if self.take():
                raise KeyboardInterrupt
            yield
        finally:
            self._raising = False


class ChatRepl:
    def __init__(
        self,
        env: Environment,
        backend: Backend,
        settings: Settings,
        model: str,
        conversation: Conversation,
        store: ChatStore,
        show_reasoning: bool = False,
        verbose: bool = False,
        history: History | None = None,
    ) -> None:
        self.env = env
        self.history = history  # where each answer is kept (None: history off)
        self.backend = backend
        self.settings = settings
        self.model = model  # the model's path (or, for a remote backend, its name there)
        self.conversation = conversation
        self.store = store
        self.show_reasoning = show_reasoning
        self.verbose = verbose
        self.last_stats: Stats | None = None  # the last answer's, for /show and /stats
        self._answers_shown = 0
        self.daemon_n_ctx: int | None = None  # the daemon's, as the last answer said, across /reset
        self.failed = 0  # messages that ended in an error
        self.unsaved = False  # the last autosave failed (a full disk): tried again at the end
        self.interrupts = Interrupts()
        self.keys: AnswerKeys | None = None  # at a terminal: the keyboard during answers
        self._checker: Checker | None = None  # made on the first answer to check

    # --- input loop ---------------------------------------------------------------------------

    def run(self, read: Reader) -> int:
        """Read and answer until /exit or end of input; return the exit status: 1 when some
        message got no answer (an error), as a script piping questions in needs to know, or
        the conversation could not be saved."""
        self._loop(read)
        if self.unsaved:  # no next answer to save it after: once more, and said if it fails
            try:
                self.store.save(self.conversation)
            except Phi4Error as exc:
                self.env.notice(
                    f"error: {exc}; what it holds since it was last saved is in "
                    "the answers above only"
                )
                return 1
        return 1 if self.failed else 0

    def _loop(self, read: Reader) -> None:
        interrupted_once = False
        # Start the daemon (and its model load) now, while the user types the first question.
        self.backend.connect()
        # prompt-toolkit takes Ctrl-C itself while it reads (as a key); any other reader's
        # wait (a pipe) is one a Ctrl-C may break.
        reading: Callable[[], contextlib.AbstractContextManager[None]] = (
            contextlib.nullcontext
            if getattr(read, "handles_ctrl_c", False)
            else self.interrupts.allowed
        )
        self.interrupts.install()
        try:
            while True:
                try:
                    self.interrupts.take()  # one after an answer was complete: for nothing
                    with reading():
                        line = read_message(read)
                except KeyboardInterrupt:
                    if interrupted_once:
                        return
                    interrupted_once = True
                    self.env.notice("press Ctrl-C again (or Ctrl-D, or /exit) to leave")
                    continue
                interrupted_once = False
                if line is None:
                    return
                line, replaced = replace_bad(line)  # typed bytes that are not UTF-8
                if replaced:
                    self.env.notice(
                        "your input is not valid UTF-8; its bad bytes are read as "
                        "U+FFFD, the replacement character"
                    )
                if not line.strip():
                    continue
                if line.strip().startswith("/"):
                    if not self.command(line.strip()):
                        return
                else:
                    self.ask(line)
        finally:
            self.interrupts.uninstall()
            self.backend.close()
            if self._checker is not None:
                self._checker.close()

    # --- answering ----------------------------------------------------------------------------

    def _presenter(self) -> PlainPresenter | TerminalPresenter:
        if self.env.terminal:
            presenter = TerminalPresenter(self.show_reasoning, verbose=False)
            if self.keys is not None:  # Enter while it thinks: the answer now
                presenter.key_hint = ANSWER_NOW_HINT
            return presenter
        if self._answers_shown:  # piped: a blank line between answers, or they run together
            self.env.stdout.write("\n")
        return PlainPresenter(
            self.env.stdout,
            self.env.stderr,
            self.show_reasoning,
            verbose=False,
            raw=self.env.raw_stdout,
        )

    def sampling(self) -> dict[str, Any]:
        values = {key: getattr(self.settings, key) for key in SETTABLE}
        values.update(self.conversation.settings)
        return values

    def _request(self, question: str) -> SolveParams:
        asked = {k: v for k, v in self.conversation.settings.items() if k in Ask._fields}
        ask = Ask.of(self.settings)._replace(**asked, system=self.conversation.system)
        return SolveParams(
            question,
            ask,
            self.model,
            priority=PRIORITY_INTERACTIVE,
            session=self.conversation.session,
            history=tuple(self.conversation.history()),
        )

    def ask(self, question: str) -> None:
        """Answer one message; keep the turn in the conversation (and save it)."""
        typed_ctrl_c = self.keys.begin() if self.keys is not None else False
        try:
            if typed_ctrl_c or self.interrupts.take():  # between Enter and now
                self.env.notice("stopped before the answer began; this question is not kept")
                return
            self._ask(question)
        finally:
            if self.keys is not None:
                self.keys.end()

    def _ask(self, question: str) -> None:
        outcome = Outcome(index=0, question=question)
        presenter = self._presenter()
        self._checker_for(question)
        try:
            interrupted = self._stream(self._request(question), outcome, presenter)
        except KeyboardInterrupt:  # before the request was sent (daemon starting up)
            presenter.abort()
            self.env.notice("stopped before the answer began; this question is not kept")
            return
        except DaemonGoneError as exc:
            # Mid-answer (before any output the stream itself starts a fresh daemon): the chat
            # goes on, and the next message starts a fresh daemon with the whole transcript.
            # What streamed stays on the screen, as after Ctrl-C (a live region would be erased).
            presenter.show_partial(outcome)
            self.env.notice(
                f"error: {chat_hints(unfinished(outcome, str(exc)))}; this question "
                "is not kept (ask it again)"
            )
            self.failed += 1
            return
        except RequestError as exc:  # refused before it was sent (too long): the chat goes on
            presenter.abort()
            self.env.notice(f"error: {chat_words(exc)}")
            self.failed += 1
            return
        except Phi4Error:
            presenter.show_partial(outcome)
            raise
        if outcome.error is not None and not interrupted:
            presenter.show_partial(outcome)  # what streamed stays, the error line below it
            kept = ""
            if outcome.error_code in (ErrorCode.SHUTTING_DOWN, ErrorCode.UNREACHABLE):
                # The engine went away mid-answer: the chat goes on, and the next message
                # goes to a fresh daemon (or a replica still up) with the whole transcript.
                kept = "; this question is not kept (ask it again)"
            said = unfinished(outcome, chat_words(outcome.exception()))
            self.env.notice(f"error: {said}{kept}")
            self.failed += 1
            return
        if interrupted:
            presenter.show_partial(outcome)
            if not outcome.solution.strip():
                self.env.notice("stopped before the answer began; this question is not kept")
                return
            self.env.notice(
                "stopped; the partial answer is kept in the conversation (/retry samples it again)"
            )
        else:
            self._show_answer(outcome, presenter)
        turn = Turn(question, outcome.solution, outcome.reasoning, outcome.stats_dict, interrupted)
        self._record(turn, outcome.stats)
        if self.history is not None:
            self.history.add("chat", outcome, self.sampling(), self.model, self.conversation.name)

    def _checker_for(self, question: str) -> Checker | None:
        """The checker for ``question``'s answer, started now if it may be checked (SymPy loads
        while the model thinks); None with ``check off``."""
        if self.sampling().get("check", "auto") == "off":
            return None
        if self._checker is None:
            self._checker = Checker()
        self._checker.prepare(question)
        return self._checker

    def _check(self, outcome: Outcome) -> None:
        """Check the answer against the message (``check``, as /set or the settings say); with
        ``strict``, a refuted answer counts as a message that failed (exit 1)."""
        mode = self.sampling().get("check", "auto")
        checker = self._checker_for(outcome.question)
        if checker is None:
            return
        outcome.check = checker.check(outcome.question, outcome.answer)
        if mode == "strict" and outcome.refuted:
            self.failed += 1

    def _show_answer(self, outcome: Outcome, presenter: PlainPresenter | TerminalPresenter) -> None:
        """Most chat replies are talk, not a solved problem: one without a boxed answer is shown
        as written, with no "no final answer" line after it. Only thinking that ran out of
        tokens is said, as that reply is not what the model meant to write."""
        if outcome.answer is not None:
            self._check(outcome)
            presenter.finish(outcome)
            cut = loop_cut(outcome)
            if cut is not None:
                self.env.notice(cut)
            if not self.env.terminal and outcome.check is not None:
                from phi4cli.client.presenters import check_line

                said = check_line(outcome.check)
                if said is not None:
                    self.env.notice(said)
            return
        presenter.show_partial(outcome)
        if outcome.thinking_unfinished:
            self.env.notice(
                "no final answer: the thinking did not finish (give it more tokens: "
                "/set max_tokens N, or /set think_budget N)"
            )
            self.failed += 1  # the message got no answer: exit 1, as `phi4 solve` does

    def _stream(
        self,
        params: SolveParams,
        outcome: Outcome,
        presenter: PlainPresenter | TerminalPresenter,
    ) -> bool:
        """Send the turn and show its events; return True if the user stopped it with Ctrl-C.

        The first Ctrl-C asks the engine to stop and keeps reading, so the partial answer (and
        its stats) arrive; a second one hangs up. A Ctrl-C breaks only the wait for the next
        event: one while an event is shown is taken once it is. Enter while the model thinks
        asks for the answer now: the thinking is closed, and the model answers from what it has.
        """
        stream: RequestStream = self.backend.stream(Op.CHAT, params)
        hurry = None  # at a terminal, Enter while it thinks: the answer now
        if self.keys is not None and isinstance(presenter, TerminalPresenter):
            hurry = AnswerNow(self.keys, stream.answer_now, presenter.answering_now)
        interrupted = False
        while not outcome.done:
            if self.interrupts.take():
                if interrupted:
                    stream.close()
                    outcome.fail(ErrorCode.CANCELLED, "cancelled")
                    break
                interrupted = True
                stream.cancel()
            try:
                with self.interrupts.allowed():
                    event = next(stream, None)
            except KeyboardInterrupt:
                self.interrupts.pending = True  # taken at the top of the loop
                continue
            if event is None:
                if not outcome.done:
                    outcome.fail(ErrorCode.BACKEND_ERROR, "the answer ended without an end")
                break
            outcome.apply(event)
            presenter.on_event(event)
            if hurry is not None:
                hurry.see(event)
        return interrupted

    def _record(self, turn: Turn, stats: Stats | None) -> None:
        conversation = self.conversation
        self._answers_shown += 1
        conversation.turns.append(turn)
        if stats is not None:
            self.last_stats = stats
        dropped = stats.dropped_turns if stats is not None else 0
        if dropped:
            conversation.dropped = min(len(conversation.turns) - 1, conversation.dropped + dropped)
            self.env.notice(
                f"the context was full: the {dropped} oldest turn(s) were dropped from what the "
                "model sees (the system prompt is kept; /show tells how much)"
            )
        used = stats.context_used if stats is not None else None
        n_ctx = stats.n_ctx if stats is not None else None
        if used and n_ctx and used / n_ctx > CONTEXT_WARNING:
            self.env.notice(
                f"the context is {used / n_ctx:.0%} full; the oldest turns will be dropped soon "
                "(/reset starts afresh)"
            )
        if self.verbose and stats is not None:
            print(format_stats(stats), file=self.env.stderr, flush=True)
        self._autosave()

    def _autosave(self) -> None:
        """Save after each answer. A failed save (disk full) is said, not fatal: the
        conversation stays in memory and is saved again after the next answer."""
        try:
            self.store.save(self.conversation)
        except Phi4Error as exc:
            if not self.unsaved:  # (said once, not after every answer)
                self.env.notice(
                    f"{exc}; the conversation is kept in memory and saved again after each answer"
                )
            self.unsaved = True
        else:
            self.unsaved = False

    # --- slash commands -----------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run one slash command; return False to leave the REPL."""
        name, _, argument = line.partition(" ")
        found = COMMAND_NAMES.get(name)
        if found is None:
            import difflib

            close = difflib.get_close_matches(name, COMMAND_NAMES, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            self.env.notice(f"unknown command {name}; {hint}/help lists them")
            return True
        return found.handler(self, argument.strip()) is not False


def chat_words(error: Phi4Error) -> str:
    """A request's error as a chat says it: worded from the daemon's facts where it sent them
    (the answer's tokens named as /set names them), else from the command line's words."""
    if error.fault is None:
        return chat_hints(str(error))
    fault = error.fault
    said = cli_words(fault, max_tokens="max_tokens")
    lowers = fault.param == "max_tokens" or fault.available is not None
    return f"{said} (in this chat: /set max_tokens N)" if lowers else said


def chat_hints(message: str) -> str:
    """A message for the command line, told the chat way: the settings a chat changes with
    /set are named so, not as the options of ``phi4 solve`` (``--max-tokens``)."""
    named = []
    for key in SETTABLE:
        flag = "--" + key.replace("_", "-")
        message, count = re.subn(rf"{flag}(?![\w-])", key, message)
        if count:
            named.append(f"/set {key} N")
    return f"{message} (in this chat: {', '.join(named)})" if named else message


def read_message(read: Reader) -> str | None:
    """Read one message: a line, or a block between lines that start and end with triple quotes."""
    line = read(PROMPT)
    if line is None or not line.lstrip().startswith('"""'):
        return line
    text = line.lstrip()[3:]
    if text.rstrip().endswith('"""') and text.strip():
        return text.rstrip()[:-3]
    parts = [text] if text else []
    while True:
        more = read(CONTINUATION)
        if more is None:
            return "\n".join(parts)
        if more.rstrip().endswith('"""'):
            parts.append(more.rstrip()[:-3])
            return "\n".join(part for part in parts).strip("\n")
        parts.append(more)


def line_reader(
    stream: TextIO, echo: TextIO | None = None, notice: Announce | None = None
) -> Reader:
    """Read input from a non-terminal stream (a pipe or file), one line per call.

    A line that is not valid UTF-8 is read with U+FFFD in place of each bad byte, and
    ``notice`` says so with its line number: one bad line in a file of questions is no reason to
    end the chat (as the decoder's exception would)."""
    raw = getattr(stream, "buffer", None)  # bytes, so a bad line can be decoded on its own
    number = 0

    def read(prompt: str) -> str | None:
        nonlocal number
        if raw is not None:
            data = raw.readline()
            line = data.decode("utf-8", errors="surrogateescape")
        else:
            line = stream.readline()
        if not line:
            return None
        number += 1
        line, replaced = replace_bad(line)
        if replaced and notice is not None:
            notice(
                f"stdin line {number} is not valid UTF-8; its bad bytes are read as "
                "U+FFFD, the replacement character"
            )
        if echo is not None:
            print(clean_text(f"{prompt}{line.rstrip()}"), file=echo)
        return line.rstrip("\n")

    return read


class SlashCompleter(Completer):
    """Tab completion of slash commands, and of the keys after ``/set``."""

    def get_completions(
        self, document: Document, complete_event: CompleteEvent
    ) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/"):
            return
        if text.startswith("/set ") and text.count(" ") == 1:
            word = text[5:]
            for key in SETTABLE:
                if key.startswith(word):
                    yield Completion(key, start_position=-len(word))
            return
        if " " in text:
            return
        for command in COMMAND_NAMES:
            if command.startswith(text):
                yield Completion(command, start_position=-len(text))


class PromptReader:
    """A Reader on prompt-toolkit's session (a callable, as every Reader)."""

    handles_ctrl_c = True  # read as a key while the prompt is up, never as a signal

    def __init__(self, session: Any) -> None:
        self.session = session

    def __call__(self, prompt: str) -> str | None:
        try:
            text: str = self.session.prompt(prompt)
        except EOFError:
            return None
        return text

    def answer_keys(self) -> AnswerKeys | None:
        """The keyboard during answers, when the input is a terminal."""
        try:
            fd = self.session.input.fileno()
        except (AttributeError, NotImplementedError, OSError, ValueError):
            return None
        return AnswerKeys(fd, self.session.input) if os.isatty(fd) else None


def prompt_reader(history_file: Path, input: Any = None, output: Any = None) -> PromptReader:
    """Read input with prompt-toolkit: history (Up/Down, Ctrl-R), suggestions, completion."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _interrupt(event: Any) -> None:
        # With text typed, Ctrl-C clears it; on an empty line it asks to leave.
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    session: PromptSession[str] = PromptSession(
        history=AtomicFileHistory(history_file),
        auto_suggest=AutoSuggestFromHistory(),
        completer=SlashCompleter(),
        complete_while_typing=True,
        key_bindings=bindings,
        input=input,
        output=output,
    )
    return PromptReader(session)


class AtomicFileHistory(FileHistory):
    """prompt-toolkit's file history, rewritten atomically (and kept to HISTORY_LIMIT entries)."""

    failed = False  # said once: a history that cannot be written is no reason to end the chat

    def __init__(self, filename: str | os.PathLike[str]) -> None:
        """Raise RefusedFileError (the chat does not start) when the history is a file another
        user could have written: what it holds is offered as your own input."""
        super().__init__(filename)
        self.load_history_strings()

    def load_history_strings(self) -> Iterable[str]:
        try:
            raw = read_user_file(Path(os.fsdecode(self.filename)), "input history")
        except OSError:  # none, or none that can be read: no reason to end the chat
            return []
        strings: list[str] = []
        lines: list[str] = []
        for line_bytes in io.BytesIO(raw):  # lines end at "\n" only, as FileHistory's do
            line = line_bytes.decode("utf-8", errors="replace")
            if line.startswith("+"):
                lines.append(line[1:])
            elif lines:
                strings.append("".join(lines)[:-1])  # the last line's newline is no input
                lines = []
        if lines:
            strings.append("".join(lines)[:-1])
        return reversed(strings)

    def store_string(self, string: str) -> None:
        try:
            self._store(string)
        except (OSError, RefusedFileError) as exc:
            if not self.failed:
                self.failed = True
                path = os.fsdecode(self.filename)
                why = write_problem(exc, path) if isinstance(exc, OSError) else str(exc)
                say(f"cannot save the input history to {path}: {why}; the chat goes on")

    def _store(self, string: str) -> None:
        path = Path(os.fsdecode(self.filename))
        entries = list(reversed(list(self.load_history_strings())))[-(HISTORY_LIMIT - 1) :]
        entries.append(string)
        lines = []
        for entry in entries:
            lines.append("\n# phi4\n")
            lines.extend(f"+{part}\n" for part in entry.split("\n"))
        write_atomic(path, "".join(lines).encode("utf-8", errors="replace"), what="input history")
