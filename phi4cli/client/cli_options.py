"""The command line's shared options, each made from its row of the settings table
(``options.SETTINGS``): the Typer option of a setting, the groups of them that the answering
commands and the daemon commands take (``with_options``), and their completions."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from phi4cli.core.options import ANSWER_KEYS, CHOICES, DAEMON_OPTIONS, SETTING, SETTINGS


def _complete_model(incomplete: str) -> list[tuple[str, str]]:
    from phi4cli.client.completion import models

    return models(incomplete)


def complete_alias(incomplete: str) -> list[tuple[str, str]]:
    from phi4cli.core.models import ALIASES

    return [
        (name, alias.description) for name, alias in ALIASES.items() if name.startswith(incomplete)
    ]


def complete_setting_key(incomplete: str) -> list[str]:
    from phi4cli.client.completion import setting_keys

    return setting_keys(incomplete)


def complete_setting_value(ctx: typer.Context, incomplete: str) -> list[str]:
    from phi4cli.client.completion import setting_values

    return setting_values(ctx.params.get("key"), incomplete)


def complete_chat(incomplete: str) -> list[str]:
    from phi4cli.client.completion import chats

    return chats(incomplete)


def _choices(values: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A completer offering ``values`` (the fast completer reads them from its table)."""

    def complete_choice(incomplete: str) -> list[str]:
        return [value for value in values if value.startswith(incomplete)]

    complete_choice.choices = values  # type: ignore[attr-defined]  # (for docs.completion_table)
    return complete_choice


# Values offered at Tab for options whose setting has a few words among its values.
_OFFERED = {**CHOICES, "gpu_layers": ("auto", "all", "0")}


def setting_option(key: str, **extra: Any) -> Any:
    """The Typer option of setting ``key``, from its row of ``options.SETTINGS``."""
    row = SETTING[key]
    given = (("min", row.low), ("max", row.high), ("metavar", row.metavar))
    checks: dict[str, Any] = {name: value for name, value in given if value is not None}
    if key in _OFFERED and row.option != "bool" and "autocompletion" not in extra:
        extra["autocompletion"] = _choices(_OFFERED[key])
    make: Any = typer.Option  # its overloads take no unpacked names
    return make(*row.flags.split(), help=row.help, show_default=False, **checks, **extra)


# The type of an option's value, by ``Setting.option``; None: not given (the setting stands).
_OPTION_TYPES: dict[str, Any] = {
    "int": int | None,
    "float": float | None,
    "str": str | None,
    "bool": bool | None,
    "list": list[str] | None,
}
ModelOption = Annotated[str | None, setting_option("model", autocompletion=_complete_model)]
KeepAliveOption = Annotated[str | None, setting_option("keep_alive")]
RawOutputOption = Annotated[
    bool,
    typer.Option(
        "--raw-output",
        help="Write the model's text to stdout unchanged, control characters and "
        "escape sequences included, when stdout is not a terminal.",
    ),
]
ShowReasoningOption = Annotated[
    bool,
    typer.Option("--show-reasoning", "-r", help="Stream the model's thinking (dimmed, stderr)."),
]

# Options shared by several commands, each overriding the setting of its name (None: not given),
# each made from its setting's row. ``with_options`` adds a group of them to a command's
# signature, where Typer finds them, and hands them to the command as one dict.
SHARED_OPTIONS: dict[str, Any] = {
    row.key: Annotated[_OPTION_TYPES[row.option], setting_option(row.key)]
    for row in SETTINGS
    if row.flags
}
SHARED_OPTIONS["model"] = ModelOption
# Every command that asks for answers (solve, chat, eval) takes these; chat not those of votes,
# as it samples each message once.
ANSWER_OPTIONS = ANSWER_KEYS
CHAT_OPTIONS = tuple(key for key in ANSWER_KEYS if key not in ("vote", "stop_unsure"))


class OptionGroup(dict[str, Any]):
    """The shared options a command was given, by setting name (None: not given)."""


def with_options(
    group: tuple[str, ...], first: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the SHARED_OPTIONS named in ``group`` to a command whose first parameter receives
    them as one ``OptionGroup``, before or after the command's own options."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        import typing

        hints = typing.get_type_hints(func, include_extras=True)  # this module's are text
        parameters = list(inspect.signature(func).parameters.values())
        receiver = parameters[0].name
        own = [
            p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
            for p in parameters[1:]
        ]
        added = [
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SHARED_OPTIONS[name]
            )
            for name in group
        ]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            options = OptionGroup({name: kwargs.pop(name) for name in group})
            return func(**{receiver: options}, **kwargs)

        every = [*added, *own] if first else [*own, *added]
        command.__annotations__ = {p.name: p.annotation for p in every}
        command.__signature__ = inspect.Signature(every)  # type: ignore[attr-defined]
        return command

    return decorate


with_daemon_options = with_options(DAEMON_OPTIONS, first=True)


NoInstructionOption = Annotated[
    bool,
    typer.Option(
        "--no-instruction",
        help="Send each question alone, without the instruction to reason step by step and "
        "box the final answer [config instruction].",
    ),
]
