"""The ``phi4 chat`` REPL: input with history and slash commands, answers streamed from the
daemon, where the conversation's tokens stay cached between turns.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory

from phi4cli.atomicfile import write_atomic
from phi4cli.backends import Backend, RequestStream
from phi4cli.chats import ChatStore, Conversation, Turn, default_name
from phi4cli.config import Settings, parse_setting
from phi4cli.environment import Environment
from phi4cli.errors import DaemonGoneError, Phi4Error, RequestError
from phi4cli.outcome import Outcome
from phi4cli.protocol import ErrorCode, Op, Stats
from phi4cli.render import (
    PlainPresenter,
    TerminalPresenter,
    format_chat_list,
    format_chat_show,
    format_rows,
    format_stats,
)

COMMANDS = {
    "/help": "show this help",
    "/reset": "start a new conversation (same model and settings)",
    "/system": "/system TEXT sets the system prompt; /system - restores the model's own",
    "/set": "/set temperature|top_p|max_tokens|think_budget|seed VALUE",
    "/show": "model, settings, context used of n_ctx, cached tokens, dropped turns",
    "/retry": "sample the last answer again",
    "/save": "/save NAME saves the conversation under NAME",
    "/load": "/load NAME continues a saved conversation",
    "/list": "list saved conversations",
    "/stats": "statistics of the last answer",
    "/reasoning": "/reasoning on|off shows the model's thinking, or folds it into one line",
    "/exit": "leave (also /bye or Ctrl-D)",
}
SETTABLE = ("temperature", "top_p", "max_tokens", "think_budget", "seed")
PROMPT = "phi4> "
CONTINUATION = "... "
HISTORY_LIMIT = 1000
CONTEXT_WARNING = 0.8


Reader = Callable[[str], str | None]  # prompt -> line; None at end of input


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
    ) -> None:
        self.env = env
        self.backend = backend
        self.settings = settings
        self.model = model  # the model's path (or, for a remote backend, its name there)
        self.conversation = conversation
        self.store = store
        self.show_reasoning = show_reasoning
        self.verbose = verbose
        self._last_stats: Stats | None = None
        self.failed = 0  # messages that ended in an error

    # --- input loop ---------------------------------------------------------------------------

    def run(self, read: Reader) -> int:
        """Read and answer until /exit or end of input; return the exit status: 1 when some
        message got no answer (an error), as a script piping questions in needs to know."""
        self._loop(read)
        return 1 if self.failed else 0

    def _loop(self, read: Reader) -> None:
        interrupted_once = False
        # Start the daemon (and its model load) now, while the user types the first question.
        self.backend.connect()
        try:
            while True:
                try:
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
                if not line.strip():
                    continue
                if line.strip().startswith("/"):
                    if not self.command(line.strip()):
                        return
                else:
                    self.ask(line)
        finally:
            self.backend.close()

    # --- answering ----------------------------------------------------------------------------

    def _presenter(self) -> PlainPresenter | TerminalPresenter:
        if self.env.terminal:
            return TerminalPresenter(self.show_reasoning, verbose=False)
        return PlainPresenter(self.env.stdout, self.env.stderr, self.show_reasoning, verbose=False)

    def sampling(self) -> dict[str, Any]:
        values = {key: getattr(self.settings, key) for key in SETTABLE}
        values.update(self.conversation.settings)
        return values

    def _request(self, question: str) -> dict[str, Any]:
        return {
            **self.sampling(),
            "session": self.conversation.session,
            "message": question,
            "history": self.conversation.history(),
            "system": self.conversation.system,
            "model": self.model,
            "deterministic": self.settings.deterministic,
        }

    def ask(self, question: str) -> None:
        """Answer one message; keep the turn in the conversation (and save it)."""
        outcome = Outcome(index=0, question=question)
        presenter = self._presenter()
        try:
            interrupted = self._stream(self._request(question), outcome, presenter)
        except KeyboardInterrupt:  # before the request was sent (daemon starting up)
            presenter.abort()
            self.env.notice("stopped before the answer began; this question is not kept")
            return
        except DaemonGoneError as exc:
            # Mid-answer (before any output the stream itself starts a fresh daemon): the chat
            # goes on, and the next message starts a fresh daemon with the whole transcript.
            presenter.abort()
            self.env.notice(f"error: {exc}; this question is not kept (ask it again)")
            self.failed += 1
            return
        except RequestError as exc:  # refused before it was sent (too long): the chat goes on
            presenter.abort()
            self.env.notice(f"error: {exc}")
            self.failed += 1
            return
        except Phi4Error:
            presenter.abort()
            raise
        if outcome.error is not None and not interrupted:
            presenter.abort()
            self.env.notice(f"error: {outcome.exception()}")
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
            presenter.finish(outcome)
        turn = Turn(question, outcome.solution, outcome.reasoning, outcome.stats_dict, interrupted)
        self._record(turn, outcome.stats)

    def _stream(
        self,
        params: dict[str, Any],
        outcome: Outcome,
        presenter: PlainPresenter | TerminalPresenter,
    ) -> bool:
        """Send the turn and show its events; return True if the user stopped it with Ctrl-C.

        The first Ctrl-C asks the engine to stop and keeps reading, so the partial answer (and
        its stats) arrive; a second one hangs up.
        """
        stream: RequestStream = self.backend.stream(Op.CHAT, params)
        interrupted = False
        while not outcome.done:
            try:
                for event in stream:
                    outcome.apply(event)
                    presenter.on_event(event)
                if not outcome.done:
                    outcome.fail(ErrorCode.BACKEND_ERROR, "the answer ended without an end")
            except KeyboardInterrupt:
                if interrupted:
                    stream.close()
                    outcome.fail(ErrorCode.CANCELLED, "cancelled")
                    break
                interrupted = True
                stream.cancel()
        return interrupted

    def _record(self, turn: Turn, stats: Stats | None) -> None:
        conversation = self.conversation
        conversation.turns.append(turn)
        if stats is not None:
            self._last_stats = stats
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
            self.env.notice(f"{exc}; the conversation is kept in memory and saved again after "
                            "the next answer")  # fmt: skip

    # --- slash commands -----------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run one slash command; return False to leave the REPL."""
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        out = self.env.stdout
        if name in ("/exit", "/bye", "/quit"):
            return False
        if name == "/help":
            print(format_rows(list(COMMANDS.items())), file=out)
            print('Multi-line input: start and end it with """, or press Alt-Enter (Esc Enter) '
                  "for a new line. Ctrl-C stops an answer.", file=out)  # fmt: skip
        elif name == "/reset":
            old = self.conversation
            self.conversation = Conversation(
                name=default_name(), model=old.model, system=old.system, settings=dict(old.settings)
            )
            print("new conversation (same model and settings)", file=out)
        elif name == "/system":
            if not argument:
                print(
                    f"system prompt: {self.conversation.system or '(the model default)'}", file=out
                )
            else:
                self.conversation.system = None if argument == "-" else argument
                print("system prompt set; it applies from the next answer", file=out)
        elif name == "/set":
            self._set(argument)
        elif name == "/show":
            self._show()
        elif name == "/retry":
            self._retry()
        elif name == "/save":
            self._save(argument)
        elif name == "/load":
            self._load(argument)
        elif name == "/list":
            self._list()
        elif name == "/stats":
            shown = format_stats(self._last_stats) if self._last_stats else "no answer yet"
            print(shown, file=out)
        elif name == "/reasoning":
            if argument not in ("on", "off"):
                self.env.notice("usage: /reasoning on|off")
            else:
                self.show_reasoning = argument == "on"
                print(f"reasoning {'shown' if self.show_reasoning else 'folded'}", file=out)
        else:
            self.env.notice(f"unknown command {name}; /help lists them")
        return True

    def _set(self, argument: str) -> None:
        key, _, value = argument.partition(" ")
        if key not in SETTABLE or not value.strip():
            self.env.notice(f"usage: /set {'|'.join(SETTABLE)} VALUE")
            return
        try:
            parsed = parse_setting(key, value.strip(), f"/set {key}")
        except Phi4Error as exc:
            self.env.notice(str(exc))
            return
        self.conversation.settings[key] = parsed
        print(f"{key} = {parsed}", file=self.env.stdout)

    def _show(self) -> None:
        stats = self._last_stats or Stats()
        n_ctx = stats.n_ctx or self.settings.n_ctx or "auto (planned by the daemon)"
        settings = ", ".join(f"{k}={v}" for k, v in self.sampling().items())
        shown = format_chat_show(self.conversation, stats, self.model, settings, n_ctx)
        print(shown, file=self.env.stdout)

    def _retry(self) -> None:
        conversation = self.conversation
        if not conversation.turns:
            self.env.notice("nothing to retry yet")
            return
        last = conversation.turns.pop()
        dropped = conversation.dropped
        conversation.dropped = min(dropped, len(conversation.turns))
        before = len(conversation.turns)
        self.ask(last.question)
        if len(conversation.turns) == before:  # no new answer: keep the old one
            conversation.turns.append(last)
            conversation.dropped = dropped

    def _save(self, name: str) -> None:
        if not name:
            self.env.notice("usage: /save NAME")
            return
        old = self.conversation.name
        self.conversation.name = name
        try:
            path = self.store.save(self.conversation)
        except Phi4Error as exc:
            self.conversation.name = old
            self.env.notice(str(exc))
            return
        if old != name and old.startswith("chat-"):
            self.store.delete(old)  # the autosave under the generated name is now this one
        print(f"saved as {name} ({path})", file=self.env.stdout)

    def _load(self, name: str) -> None:
        if not name:
            self.env.notice("usage: /load NAME")
            return
        try:
            self.conversation = self.store.load(name)
        except Phi4Error as exc:
            self.env.notice(str(exc))
            return
        print(f"loaded {name}: {len(self.conversation.turns)} turns", file=self.env.stdout)

    def _list(self) -> None:
        entries = []
        for name in self.store.names():
            try:
                saved = self.store.load(name)
            except Phi4Error:
                continue
            entries.append((name, len(saved.turns), max(0.0, time.time() - saved.updated)))
        print(format_chat_list(entries), file=self.env.stdout)


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


def line_reader(stream: TextIO, echo: TextIO | None = None) -> Reader:
    """Read input from a non-terminal stream (a pipe or file), one line per call."""

    def read(prompt: str) -> str | None:
        line = stream.readline()
        if not line:
            return None
        if echo is not None:
            print(f"{prompt}{line.rstrip()}", file=echo)
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
        for command in (*COMMANDS, "/bye"):
            if command.startswith(text):
                yield Completion(command, start_position=-len(text))


def prompt_reader(history_file: Path, input: Any = None, output: Any = None) -> Reader:
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

    def read(prompt: str) -> str | None:
        try:
            return session.prompt(prompt)
        except EOFError:
            return None

    return read


class AtomicFileHistory(FileHistory):
    """prompt-toolkit's file history, rewritten atomically (and kept to HISTORY_LIMIT entries)."""

    failed = False  # said once: a history that cannot be written is no reason to end the chat

    def store_string(self, string: str) -> None:
        try:
            self._store(string)
        except OSError as exc:
            if not self.failed:
                self.failed = True
                print(f"phi4: cannot save the input history to {self.filename!s}: "
                      f"{exc.strerror}; the chat goes on", file=sys.stderr, flush=True)  # fmt: skip

    def _store(self, string: str) -> None:
        path = Path(os.fsdecode(self.filename))
        entries = list(reversed(list(self.load_history_strings())))[-(HISTORY_LIMIT - 1) :]
        entries.append(string)
        lines = []
        for entry in entries:
            lines.append("\n# phi4\n")
            lines.extend(f"+{part}\n" for part in entry.split("\n"))
        write_atomic(path, "".join(lines).encode("utf-8", errors="replace"))
