"""What every ``phi4`` command of the Typer app shares: the Environment of this run (the one
``cli.main`` was given, or one made for a command run some other way), printing through its
stdout, and the settings a command reads."""

from __future__ import annotations

from typing import Any

from phi4cli.client.environment import Environment
from phi4cli.core.config import Settings, load_settings
from phi4cli.core.paths import Paths

_environment: Environment | None = None  # the one main was given: see run_env


def use_environment(env: Environment | None) -> None:
    """Run the commands in ``env`` (``cli.main`` gives the one ``entry.main`` made); None: the
    next command run makes its own."""
    global _environment
    _environment = env


def run_env() -> Environment:
    """The Environment of this run: the one ``main`` was given (``entry.main`` makes it), or,
    for a command run some other way (a test's CliRunner), one made now, once."""
    global _environment
    if _environment is None:
        _environment = Environment()
    return _environment


def print_out(*values: object, file: Any = None, **options: Any) -> None:
    """print, to this run's Environment's stdout unless told otherwise: a command's output
    goes through the streams ``main`` was given, never around them."""
    print(*values, file=file if file is not None else run_env().stdout, **options)


def command_settings(paths: Paths, **overrides: object) -> Settings:
    """The settings a command runs with: the config file's, the environment's and ``overrides``
    (its options; None: not given)."""
    return load_settings(paths.config_file, overrides)
