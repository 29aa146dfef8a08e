"""Shell completion: the values it offers (setting names, a setting's fixed values, models:
aliases and ``.gguf`` files), and a fast way to answer the shell without Typer.

Completion runs on every Tab. Building the Typer app takes most of a completion's time (Typer,
click and every command's module), so ``answer`` completes from a table generated from the app
(``_completion_table``, kept current by ``python -m phi4cli.docs`` and a test) in Typer's own
protocol and output, and hands anything it is not sure of to Typer. The values read only the
config's tables and one directory listing: no model is opened, no daemon asked.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

Item = tuple[str, str | None]  # a value and its help (None: none)


def setting_keys(incomplete: str) -> list[str]:
    """The settings whose name starts with ``incomplete``. Without a description: Typer
    renders one through rich, which costs an import and wraps long ones across lines."""
    from phi4cli.core.config import setting_help

    return [key for key, _env, _allowed in setting_help() if key.startswith(incomplete)]


def setting_values(key: str | None, incomplete: str) -> list[str]:
    """The values of setting ``key`` that start with ``incomplete``, where they are a fixed set
    (none for a number, a duration or text: the shell then offers nothing)."""
    from phi4cli.core.config import CHOICES
    from phi4cli.core.options import SETTING

    row = SETTING.get(key or "")
    values = CHOICES.get(key or "", ("true", "false") if row and row.option == "bool" else ())
    return [value for value in values if value.startswith(incomplete)]


def chats(incomplete: str) -> list[str]:
    """The saved conversations (``chat --resume NAME``) whose names start with ``incomplete``."""
    from phi4cli.client.chats import ChatStore
    from phi4cli.core.paths import get_paths

    try:
        names = ChatStore(get_paths().data_dir / "chats").names()  # (the names --resume takes)
    except OSError:  # (one removed while they were listed)
        return []
    return sorted(name for name in names if name.startswith(incomplete))


def models(incomplete: str) -> list[tuple[str, str]]:
    """The model aliases, ``.gguf`` files and directories that start with ``incomplete``."""
    from phi4cli.core.models import ALIASES

    found = [
        (name, alias.description) for name, alias in ALIASES.items() if name.startswith(incomplete)
    ]
    directory, _, prefix = incomplete.rpartition("/")
    if directory == "" and incomplete.startswith("/"):
        directory = "/"
    listed = os.path.expanduser(directory) if directory else "."
    try:
        entries = sorted(os.scandir(listed), key=lambda entry: entry.name)
    except OSError:
        return found
    lead = "" if not directory else directory if directory.endswith("/") else directory + "/"
    for entry in entries:
        if not entry.name.startswith(prefix) or (entry.name.startswith(".") and not prefix):
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            continue
        if is_dir:
            found.append((f"{lead}{entry.name}/", "directory"))
        elif entry.name.endswith(".gguf"):
            found.append((f"{lead}{entry.name}", "model file"))
    return found


def aliases(incomplete: str) -> list[tuple[str, str]]:
    """The model aliases that start with ``incomplete``, with what each is."""
    from phi4cli.core.models import ALIASES

    return [
        (name, alias.description) for name, alias in ALIASES.items() if name.startswith(incomplete)
    ]


def _split(line: str) -> list[str]:
    """The words of a command line as click's completion splits them (shlex, an unclosed
    quote keeping what was typed)."""
    import shlex

    lex = shlex.shlex(line, posix=True)
    lex.whitespace_split = True
    lex.commenters = ""
    words: list[str] = []
    try:
        words.extend(lex)
    except ValueError:
        words.append(lex.token)
    return words


def _values(kind: Any, incomplete: str, positionals: list[str], shell: str) -> list[Item] | None:
    if kind == "none":
        return []
    if kind == "file":
        return [(incomplete, None)]  # Typer's mark: the shell completes the path itself
    if isinstance(kind, tuple) and kind[0] == "choice":
        return [(choice, None) for choice in kind[1:] if choice.startswith(incomplete)]
    found: list[Item]
    if kind == "model":
        found = list(models(incomplete))
    elif kind == "alias":
        found = list(aliases(incomplete))
    elif kind == "setting_key":
        found = [(key, None) for key in setting_keys(incomplete)]
    elif kind == "setting_value":
        key = positionals[0] if positionals else None
        found = [(value, None) for value in setting_values(key, incomplete)]
    elif kind == "chat":
        found = [(name, None) for name in chats(incomplete)]
    else:
        return None
    return [
        (value, _help_for(shell, help_)) for value, help_ in found if value.startswith(incomplete)
    ]


def _help_for(shell: str, text: str | None) -> str | None:
    """A help text as Typer sends it to ``shell`` (rich leaves plain text as it is)."""
    if not text:
        return None
    if shell == "zsh":
        return _zsh(text)
    import re

    return re.sub(r"\s", " ", text)


def items(args: list[str], incomplete: str, shell: str) -> list[Item] | None:
    """What Typer offers ``shell`` for ``incomplete`` after the words ``args``, each with its
    help as that shell is sent it; None when unsure."""
    from phi4cli.client._completion_table import TABLE as _TABLE

    TABLE: Mapping[str, Any] = _TABLE
    path: list[str] = []
    node = TABLE[""]
    given: set[str] = set()
    positionals: list[str] = []
    index, after_dashes = 0, False
    while index < len(args):
        word = args[index]
        index += 1
        if word == "--" and not after_dashes:
            if node["commands"] is not None:
                return None  # "--" before a subcommand: rare, and click's handling is its own
            after_dashes = True
            continue
        if not after_dashes and word.startswith("-") and word != "-":
            name, equals, _value = word.partition("=")
            if not word.startswith("--") and len(word) > 2:
                name, equals = word[:2], "="  # -n4
            spec = node["options"].get(name)
            if spec is None or (equals and not spec[1]):
                return None
            if spec[1] and not equals:
                if index == len(args):
                    continue  # its value is still to come: not given yet, to click
                index += 1
            given.add(spec[0])
            continue
        if node["commands"] is not None:
            if " ".join([*path, word]) not in TABLE:
                return None  # not a command: Typer says what it says
            path.append(word)
            node, given, positionals = TABLE[" ".join(path)], set(), []
            continue
        positionals.append(word)
    if incomplete == "=":
        incomplete = ""
    elif "=" in incomplete and incomplete.startswith("-"):
        name, _, incomplete = incomplete.partition("=")
        args = [*args, name]
    if "--" not in args and incomplete.startswith("-"):
        return _names(node, incomplete, given, shell)
    if args and args[-1] in node["options"]:  # after "--" too, as click does
        _param, takes_value, kind = node["options"][args[-1]]
        if takes_value:
            return _values(kind, incomplete, positionals, shell)
    taken = 0
    for _name, nargs, kind in node["arguments"]:
        if nargs == -1 or taken >= len(positionals):
            return _values(kind, incomplete, positionals, shell)
        taken += nargs
    return _names(node, incomplete, given, shell)


def _names(node: Mapping[str, Any], incomplete: str, given: set[str], shell: str) -> list[Item]:
    """A group's subcommands, then (for an incomplete that starts like an option) the options
    not given yet, as click lists them."""
    form = 0 if shell == "zsh" else 1
    found: list[Item] = []
    for name, helps in node["commands"] or ():
        if name.startswith(incomplete):
            found.append((name, helps[form] if helps else None))
    if incomplete and not incomplete[0].isalnum():
        for param, names, helps, multiple in node["order"]:
            if param in given and not multiple:
                continue
            found += [
                (name, helps[form] if helps else None)
                for name in names
                if name.startswith(incomplete)
            ]
    return found


def _zsh(value: str) -> str:
    return (
        value.replace('"', '""')
        .replace("'", "''")
        .replace("$", "\\$")
        .replace("`", "\\`")
        .replace(":", r"\\:")
    )


def answer(environ: Mapping[str, str]) -> tuple[str | None, int] | None:
    """Typer's answer to a completion request (``_PHI4_COMPLETE=complete_bash|zsh|fish``): the
    text to print (None: nothing) and the exit status; None to let Typer answer."""
    instruction = environ.get("_PHI4_COMPLETE", "")
    if instruction == "complete_bash":
        words = _split(environ.get("COMP_WORDS", ""))
        try:
            cword = int(environ.get("COMP_CWORD", ""))
        except ValueError:
            return None
        args = words[1:cword]
        incomplete = words[cword] if cword < len(words) else ""
        found = items(args, incomplete, "bash")
        if found is None:
            return None
        return "\n".join(value for value, _help in found), 0
    if instruction not in ("complete_zsh", "complete_fish"):
        return None
    line = environ.get("_TYPER_COMPLETE_ARGS", "")
    args = _split(line)[1:]
    incomplete = ""
    if args and not line.endswith(" "):
        incomplete = args.pop()
    shell = instruction.removeprefix("complete_")
    found = items(args, incomplete, shell)
    if found is None:
        return None
    if shell == "zsh":
        shown = [
            f'"{_zsh(value)}":"{help_}"' if help_ else f'"{_zsh(value)}"' for value, help_ in found
        ]
        if not shown:
            return "_files", 0
        return "_arguments '*: :((" + "\n".join(shown) + "))'", 0
    action = environ.get("_TYPER_COMPLETE_FISH_ACTION", "")
    if action == "is-args":
        return None, 0 if found else 1  # files are completed where no value is offered
    if action == "get-args" and found:
        return "\n".join(f"{value}\t{help_}" if help_ else value for value, help_ in found), 0
    return "", 0
