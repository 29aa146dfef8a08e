"""The ``phi4`` command's entry point: a fast way in for ``phi4 solve``, Typer for the rest.

A warm ``phi4 solve "..."`` is mostly interpreter start-up and imports: Typer and click alone cost
several times what the daemon needs to answer a short question. So ``solve`` is parsed here from
a table generated from the Typer command itself (``_solve_options``, kept current by
``python -m phi4cli.docs`` and a test) and goes straight to ``solving.run_solve``. Anything this
parser is not sure of (``--help``, completion, an unknown option, a value Typer would refuse)
goes to Typer, which then says exactly what it always says.

Both ways are handed the one ``Environment`` of the run, and end in ``exits.run_reporting``,
the one place that turns an exception into an exit status and a line on stderr.
"""

from __future__ import annotations

import os
import sys

from phi4cli.client.exits import exit_now, run_reporting

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


def parse_solve(args: list[str]) -> dict[str, Any] | None:
    """Parse ``phi4 solve``'s arguments as Typer would; None when unsure (Typer decides then)."""
    from phi4cli.client._solve_options import ARGUMENT, DEFAULTS, OPTIONS

    values: dict[str, Any] = dict(DEFAULTS)
    positional: list[str] = []
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        if token == "--":
            positional += args[index:]
            break
        if not token.startswith("-") or token == "-":
            positional.append(token)
            continue
        if token.startswith("--"):
            name, equals, attached = token.partition("=")  # --max-tokens=4
        elif len(token) > 2:
            name, equals, attached = token[:2], "=", token[2:]  # -n4 (and -n=4 is "=4")
        else:
            name, equals, attached = token, "", ""
        spec = OPTIONS.get(name)
        if spec is None:
            return None  # --help, -h, a typo, combined flags: Typer's to answer
        dest, kind, bounds = spec
        if kind == "flag":
            if equals:
                return None
            values[dest] = True
            continue
        if equals:
            raw = attached
        elif index < len(args):
            raw, index = args[index], index + 1
        else:
            return None
        try:
            value: Any = int(raw) if kind == "int" else float(raw) if kind == "float" else raw
        except ValueError:
            return None
        if bounds is not None:
            low, high = bounds
            if (low is not None and value < low) or (high is not None and value > high):
                return None
        if kind == "list":
            value = (*(values[dest] or ()), value)  # a tuple, as Typer gives it
        values[dest] = value
    from phi4cli.core.inputs import join_words

    values[ARGUMENT] = join_words(positional)
    return values


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if "_PHI4_COMPLETE" in os.environ:
        # A Tab: answered from a table when it can be, without building the Typer app.
        from phi4cli.client.completion import answer

        answered = answer(os.environ)
        if answered is not None:
            text, status = answered
            if text is not None:
                print(text)
            if argv is None:
                exit_now(status)
            sys.exit(status)
    # The one Environment of the run (streams, terminals, colour; paths on first use), which
    # every command that reads or writes through one is handed.
    from phi4cli.client.environment import Environment

    env = Environment()
    # What writes to sys.stdout or sys.stderr, not through env (rich's own consoles, print), meets
    # the same guard at a terminal.
    if env.stdout_isatty:
        sys.stdout = env.stdout
    if env.stderr_isatty:
        sys.stderr = env.stderr
    if args[:1] == ["solve"] and "_PHI4_COMPLETE" not in os.environ:
        parsed = parse_solve(args[1:])
        if parsed is not None:
            from phi4cli.client.solving import SolveOptions, run_solve

            options = SolveOptions(**parsed)
            run_reporting(lambda: run_solve(options, env), fast_exit=argv is None)
    from phi4cli.client.cli import main as typer_main

    typer_main(args, env)
