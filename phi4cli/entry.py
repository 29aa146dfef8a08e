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
from typing import NoReturn

from phi4cli.client.exits import exit_now, run_reporting
from phi4cli.client.solve_line import parse_solve


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
