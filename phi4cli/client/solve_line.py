"""``phi4 solve``'s command line read from a table generated from the Typer command
(``_solve_options``, kept current by ``python -m phi4cli.docs`` and a test), without Typer, by
the fast entry (``phi4cli.entry``), so that a warm solve does not import Typer. Anything it is
not sure of (``--help``, an unknown option, a value Typer would refuse) it leaves to Typer,
which then says exactly what it always says."""

from __future__ import annotations

from typing import Any


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
        if kind in ("flag", "off"):  # --history, --no-history
            if equals:
                return None
            values[dest] = kind == "flag"
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
