"""The chat's slash commands, read from one table (``COMMANDS``) by ``/help``, Tab and dispatch:
each command's name, its line of help and the function that runs it on the chat, given the rest
of the line. ``Chat`` is what a command reads and changes of the chat (``repl.ChatRepl``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from phi4cli.client.chats import ChatStore, Conversation, default_name
from phi4cli.client.environment import Environment
from phi4cli.client.render import (
    counted,
    format_chat_list,
    format_chat_show,
    format_rows,
    format_stats,
)
from phi4cli.core.config import Settings, parse_setting
from phi4cli.core.errors import Phi4Error
from phi4cli.core.options import SETTABLE, SETTING
from phi4cli.core.protocol import Stats
from phi4cli.text.sanitize import clean_text


class Chat(Protocol):
    """What a slash command reads and changes of the chat."""

    env: Environment
    settings: Settings
    model: str
    conversation: Conversation
    store: ChatStore
    show_reasoning: bool
    last_stats: Stats | None  # the last answer's, for /show and /stats
    daemon_n_ctx: int | None  # the daemon's, as the last answer said, across /reset

    def sampling(self) -> dict[str, Any]: ...

    def ask(self, question: str) -> None: ...


def _exit(chat: Chat, _argument: str) -> bool:
    return False


def _help(chat: Chat, _argument: str) -> None:
    out = chat.env.stdout
    print(format_rows([(c.name, c.help) for c in COMMANDS]), file=out)
    print(
        'Multi-line input: start and end it with """, or press Alt-Enter (Esc Enter) '
        "for a new line. Ctrl-C stops an answer.",
        file=out,
    )


def _reset(chat: Chat, _argument: str) -> None:
    old = chat.conversation
    chat.conversation = Conversation(
        name=default_name(), model=old.model, system=old.system, settings=dict(old.settings)
    )
    _forget_context(chat)
    _done(chat, "new conversation (same model and settings)")


def _done(chat: Chat, message: str) -> None:
    """Say what a command did: on stdout at a terminal, on stderr when stdout is piped (it
    then holds the answers and what was asked for, as /show or /list, only)."""
    out = chat.env.stdout if chat.env.stdout_isatty else chat.env.stderr
    print(clean_text(message), file=out, flush=True)


def _forget_context(chat: Chat) -> None:
    """A new or loaded conversation: the last answer's context figures were another
    conversation's (/show said "2,000 of 4,096 tokens used" after /reset); n_ctx stays."""
    if chat.last_stats is not None:
        chat.daemon_n_ctx = chat.last_stats.n_ctx
    chat.last_stats = None


def _system(chat: Chat, argument: str) -> None:
    if not argument:
        system = chat.conversation.system or "(the model default)"
        print(clean_text(f"system prompt: {system}"), file=chat.env.stdout)
    else:
        chat.conversation.system = None if argument == "-" else argument
        _done(chat, "system prompt set; it applies from the next answer")


def _stats(chat: Chat, _argument: str) -> None:
    shown = format_stats(chat.last_stats) if chat.last_stats else "no answer yet"
    print(shown, file=chat.env.stdout)


def _reasoning(chat: Chat, argument: str) -> None:
    if argument not in ("on", "off"):
        chat.env.notice("usage: /reasoning on|off")
        return
    chat.show_reasoning = argument == "on"
    _done(chat, f"reasoning {'shown' if chat.show_reasoning else 'folded'}")


def _set(chat: Chat, argument: str) -> None:
    key, _, value = argument.partition(" ")
    if key not in SETTABLE or not value.strip():
        chat.env.notice(f"usage: /set {'|'.join(SETTABLE)} VALUE")
        return
    try:
        parsed = parse_setting(key, value.strip(), f"/set {key}")
    except Phi4Error as exc:
        chat.env.notice(str(exc))
        return
    chat.conversation.settings[key] = parsed
    _done(chat, f"{key} = {parsed}")


def _show(chat: Chat, _argument: str = "") -> None:
    stats = chat.last_stats or Stats()
    n_ctx = (
        stats.n_ctx or chat.daemon_n_ctx or chat.settings.n_ctx or "auto (planned by the daemon)"
    )
    settings = ", ".join(
        f"{k}={v}" for k, v in chat.sampling().items() if not SETTING[k].is_off(v)
    )  # off: not said
    shown = format_chat_show(chat.conversation, stats, chat.model, settings, n_ctx)
    print(shown, file=chat.env.stdout)


def _retry(chat: Chat, _argument: str = "") -> None:
    conversation = chat.conversation
    if not conversation.turns:
        chat.env.notice("nothing to retry yet")
        return
    last = conversation.turns.pop()
    dropped = conversation.dropped
    conversation.dropped = min(dropped, len(conversation.turns))
    before = len(conversation.turns)
    chat.ask(last.question)
    if len(conversation.turns) == before:  # no new answer: keep the old one
        conversation.turns.append(last)
        conversation.dropped = dropped


def _save(chat: Chat, name: str) -> None:
    if not name:
        chat.env.notice("usage: /save NAME")
        return
    old = chat.conversation.name
    chat.conversation.name = name
    try:
        path = chat.store.save(chat.conversation)
    except Phi4Error as exc:
        chat.conversation.name = old
        chat.env.notice(str(exc))
        return
    if old != name and old.startswith("chat-"):
        chat.store.delete(old)  # the autosave under the generated name is now this one
    _done(chat, f"saved as {name} ({path})")


def _load(chat: Chat, name: str) -> None:
    if not name:
        chat.env.notice("usage: /load NAME")
        return
    try:
        chat.conversation = chat.store.load(name)
    except Phi4Error as exc:
        chat.env.notice(str(exc))
        return
    _forget_context(chat)
    _done(chat, f"loaded {name}: {counted(len(chat.conversation.turns), 'turn')}")


def _list(chat: Chat, _argument: str = "") -> None:
    entries = []
    for name in chat.store.names():
        try:
            saved = chat.store.load(name)
        except Phi4Error:
            continue
        entries.append((name, len(saved.turns), max(0.0, time.time() - saved.updated)))
    print(format_chat_list(entries), file=chat.env.stdout)


class SlashCommand(NamedTuple):
    """One of the chat's slash commands: what ``/help`` says of it, what Tab completes, and the
    function that runs it (given the chat and the rest of the line; False leaves the chat)."""

    name: str
    help: str
    handler: Callable[[Chat, str], bool | None]
    aliases: tuple[str, ...] = ()


# The chat's commands: /help, completion and dispatch are all read from this table.
COMMANDS = (
    SlashCommand("/help", "show this help", _help),
    SlashCommand(
        "/reset",
        "start a new conversation, same model and settings (also /clear, as in ollama)",
        _reset,
        ("/clear",),
    ),
    SlashCommand(
        "/system",
        "/system TEXT sets the system prompt; /system - restores the model's own",
        _system,
    ),
    SlashCommand("/set", f"/set {'|'.join(SETTABLE)} VALUE", _set),
    SlashCommand(
        "/show",
        "model, settings, context used of n_ctx, cached tokens, dropped turns",
        _show,
    ),
    SlashCommand("/retry", "sample the last answer again", _retry),
    SlashCommand("/save", "/save NAME saves the conversation under NAME", _save),
    SlashCommand("/load", "/load NAME continues a saved conversation", _load),
    SlashCommand("/list", "list saved conversations", _list),
    SlashCommand("/stats", "statistics of the last answer", _stats),
    SlashCommand(
        "/reasoning",
        "/reasoning on|off shows the model's thinking, or folds it into one line",
        _reasoning,
    ),
    SlashCommand("/exit", "leave (also /bye, /quit or Ctrl-D)", _exit, ("/bye", "/quit")),
)
COMMAND_NAMES = {name: c for c in COMMANDS for name in (c.name, *c.aliases)}
