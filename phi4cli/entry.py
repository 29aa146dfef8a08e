"""The ``phi4`` command's entry point: a fast way in for ``phi4 solve``, Typer for the rest.

A warm ``phi4 solve "..."`` is mostly interpreter start-up and imports: Typer and click alone cost
several times what the daemon needs to answer a short question. So ``solve`` is parsed here from
a table generated from the Typer command itself (``_solve_options``, kept current by
``python -m phi4cli.docs`` and a test) and goes straight to ``solving.run_solve``. Anything this
parser is not sure of (``--help``, completion, an unknown option, a value Typer would refuse)
goes to Typer, which then says exactly what it always says.

This is also the one place that turns an exception into an exit status and a line on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _stderr(message: str) -> None:
    """One line on stderr; an error's text may carry a model's or a remote engine's words."""
    from phi4cli.sanitize import clean_text

    print(f"phi4: {clean_text(message)}", file=sys.stderr, flush=True)


def exit_now(status: int) -> NoReturn:
    """Exit without the interpreter's teardown: flush what was written, then leave.

    Tearing down the modules a solve imported takes longer than the daemon takes to answer a
    short question (about 5 ms here), and a finished `phi4 solve` has nothing left to clean up:
    its files are closed and it starts no threads that outlive the answer. Only for the ``phi4``
    program itself, never in-process callers (tests, ``python -m`` embedding)."""
    for stream in (sys.stdout, sys.stderr):
        # A reader that went away, or a closed stream (None when it was closed at start-up, as
        # by `2>&-`): nothing more can be said.
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(status)


def run_reporting(run: Callable[[], int | None], fast_exit: bool = False) -> NoReturn:
    """Run a command and exit with the documented status for whatever happened (with
    ``fast_exit``, skipping the interpreter's teardown: see ``exit_now``)."""
    from phi4cli.errors import ExitStatus, Phi4Error

    try:
        code = run()
        if sys.stdout is not None:  # None: closed when the command started (`>&-`)
            sys.stdout.flush()
        status = code if isinstance(code, int) else ExitStatus.OK
    except KeyboardInterrupt:
        print(file=sys.stderr)
        status = ExitStatus.INTERRUPTED
    except Phi4Error as exc:
        if os.environ.get("PHI4_DEBUG"):
            import traceback

            traceback.print_exc()
        _stderr(f"error: {exc}")
        status = exc.exit_status
    except Exception as exc:
        if os.environ.get("PHI4_DEBUG"):
            raise
        _stderr(f"internal error: {type(exc).__name__}: {exc} (PHI4_DEBUG=1 shows the traceback)")
        status = ExitStatus.ERROR
    if fast_exit:
        exit_now(int(status))
    sys.exit(status)


def parse_solve(args: list[str]) -> dict[str, Any] | None:
    """Parse ``phi4 solve``'s arguments as Typer would; None when unsure (Typer decides then)."""
    from phi4cli._solve_options import ARGUMENT, DEFAULTS, OPTIONS

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
    values[ARGUMENT] = join_words(positional)
    return values


def join_words(words: list[str] | tuple[str, ...] | None) -> str | None:
    """The question given as arguments: several words joined with single spaces, as
    ``ollama run`` and ``llm`` do (``phi4 solve what is 2+2``); None when none was given.

    A lone ``-`` stays ``-`` (read stdin); a ``-`` among words is just a word, and a question
    given as words leaves stdin alone."""
    return " ".join(words) if words else None


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if "_PHI4_COMPLETE" in os.environ:
        # A Tab: answered from a table when it can be, without building the Typer app.
        from phi4cli.completion import answer

        answered = answer(os.environ)
        if answered is not None:
            text, status = answered
            if text is not None:
                print(text)
            if argv is None:
                exit_now(status)
            sys.exit(status)
    if args[:1] == ["solve"] and "_PHI4_COMPLETE" not in os.environ:
        parsed = parse_solve(args[1:])
        if parsed is not None:
            from phi4cli.solving import SolveOptions, run_solve

            options = SolveOptions(**parsed)
            run_reporting(lambda: run_solve(options), fast_exit=argv is None)
    from phi4cli.cli import main as typer_main

    typer_main(args)
