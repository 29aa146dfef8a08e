"""Files generated from the Typer app and the settings table.

``python -m phi4cli.docs`` rewrites the shell completion scripts (``completions/``), the man page
(``man/phi4.1``), the settings' typed record (``phi4cli/core/_settings.py``), the fast entry's
table of ``phi4 solve``'s options (``phi4cli/client/_solve_options.py``) and Tab completion's
table (``phi4cli/client/_completion_table.py``); a test fails when a committed one is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from phi4cli import __version__

SHELLS = ("bash", "zsh", "fish")
ROOT = Path(__file__).resolve().parent.parent


def completion_script(shell: str) -> str:
    """The script Typer's ``--install-completion`` would install for ``shell``."""
    # Typer exposes this only through --show-completion, which detects the shell it runs in.
    from typer._completion_shared import get_completion_script

    script = get_completion_script(prog_name="phi4", complete_var="_PHI4_COMPLETE", shell=shell)
    return script if script.endswith("\n") else script + "\n"


def _roff(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return re.sub(r"^([.'])", r"\\&\1", text, flags=re.M)


def _paragraphs(text: str | None) -> str:
    blocks = [
        " ".join(line.strip() for line in block.splitlines())
        for block in (text or "").strip().split("\n\n")
        if block.strip()
    ]
    return "\n.PP\n".join(_roff(block) for block in blocks)


def _option_lines(command: Any) -> list[str]:
    lines: list[str] = []
    for param in command.params:
        if getattr(param, "hidden", False) or param.param_type_name == "argument":
            continue
        names = ", ".join(param.opts + list(getattr(param, "secondary_opts", [])))
        metavar = (
            ""
            if getattr(param, "is_flag", False)
            else f" {(param.metavar or param.type.name).upper().replace(' RANGE', '')}"
        )
        lines += [".TP", f".B {_roff(names)}{_roff(metavar)}", _roff(param.help or "")]
    return lines


def _synopsis(name: str, command: Any) -> str:
    arguments = " ".join(
        f"[{p.human_readable_name.upper()}]" + ("..." if p.nargs == -1 else "")
        for p in command.params
        if p.param_type_name == "argument"
    )
    return f"phi4 {name} [OPTIONS] {arguments}".rstrip()


def _commands(group: Any, prefix: str = "") -> list[str]:
    lines: list[str] = []
    for name, command in sorted(group.commands.items()):
        if getattr(command, "hidden", False):
            continue
        full = f"{prefix}{name}"
        if hasattr(command, "commands"):
            lines += _commands(command, f"{full} ")
            continue
        lines += [".TP", f".B {_roff(_synopsis(full, command))}", _paragraphs(command.help)]
        options = _option_lines(command)
        if options:
            lines += [".RS", *options, ".RE"]
    return lines


# Variables that are not settings of config.toml; the settings' own follow from config's table.
def environment() -> list[tuple[str, str]]:
    """Every environment variable phi4 reads, with what it means: each setting's ``PHI4_*``
    variable (from config's table, so none is left out) and the others."""
    from phi4cli.core.config import VARIABLES, setting_help

    settings = [(name, f"The {key} setting: {allowed}.") for key, name, allowed in setting_help()]
    return settings + [(", ".join(v.names), v.help) for v in VARIABLES]


FILES = [
    ("~/.config/phi4/config.toml", "Settings (keys as the PHI4_ variables, lower case)."),
    ("~/.local/share/phi4/models/", "Models downloaded by phi4 pull."),
    ("~/.local/share/phi4/chats/", "Saved conversations, JSON."),
    ("~/.local/state/phi4/daemon.log", "The daemon's log."),
    ("~/.local/state/phi4/chat_history", "Chat input history."),
    ("~/.cache/phi4/states/", "Saved system-prompt states (checked before they are used)."),
    ("~/.cache/phi4/sessions/", "Idle chats swapped out to disk (checked the same way)."),
    ("/dev/shm/phi4-UID/", "Staged model copies in RAM (or $PHI4_RAMDISK)."),
    ("$XDG_RUNTIME_DIR/phi4/", "Socket, status file and locks (else /tmp/phi4-UID/)."),
]


def exit_meanings() -> list[tuple[str, str]]:
    """The README's "Exit status" table, code and meaning, Markdown taken out: one text for the
    README and the man page."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Exit status") :].split("\n\n")[1]
    rows = []
    for line in table.splitlines()[2:]:
        code, meaning = (cell.strip() for cell in line.strip("|").split("|", 1))
        meaning = meaning.replace("`", "").replace("\\|", "|")
        rows.append((code, meaning[0].upper() + meaning[1:] + "."))
    return rows


EXAMPLES = [
    ('phi4 solve "Solve 3x^2+4x+5=1"', "Solve one problem; the thinking is folded away."),
    ('echo "12*13?" | phi4 solve - --answer-only', "Just the answer, for scripts."),
    ("phi4 solve --file problems.txt --jsonl", "Many problems, answered together, in order."),
    ("phi4 chat", "A conversation that stays cached in the daemon."),
    ("phi4 warm", "Load and prewarm the model before it is needed."),
]


def man_page() -> str:
    """The phi4(1) man page: the commands and options of the app plus written sections."""
    import typer

    from phi4cli.client.cli import app

    root = typer.main.get_command(app)
    lines = [
        f'.TH PHI4 1 "" "phi4 {__version__}" "User Commands"',
        ".SH NAME",
        "phi4 \\- a local math solver on Phi\\-4\\-mini\\-reasoning, resident in a daemon",
        ".SH SYNOPSIS",
        ".B phi4",
        "[\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
        ".SH DESCRIPTION",
        _paragraphs(
            "phi4 runs Microsoft's Phi-4-mini-reasoning on this machine. The model stays resident "
            "in a background daemon reached over a private Unix socket, so a question never pays "
            "for a process start, a model load, or re-reading a system prompt the model has "
            "already seen. The daemon starts on the first command that needs it.\n\n"
            "In a terminal, the model's thinking is folded into one live line, the solution is "
            "rendered as Markdown with readable math, and the final answer gets a line of its "
            "own. In a pipeline the output is plain text: the solution on stdout, never the "
            "thinking."
        ),
        ".SH COMMANDS",
        *_commands(root),
        ".SH OPTIONS",
        *_option_lines(root),
        ".SH ENVIRONMENT",
    ]
    for name, meaning in environment():
        lines += [".TP", f".B {_roff(name)}", _roff(meaning)]
    lines.append(".SH FILES")
    for name, meaning in FILES:
        lines += [".TP", f".I {_roff(name)}", _roff(meaning)]
    lines.append(".SH EXIT STATUS")
    for code, meaning in exit_meanings():
        lines += [".TP", f".B {code}", _roff(meaning)]
    lines.append(".SH EXAMPLES")
    for command, meaning in EXAMPLES:
        # A text line, not `.B` arguments: roff would take the quotes as argument delimiters
        # and drop them, printing a command that fails when typed as shown.
        lines += [".TP", f"\\fB{_roff(command)}\\fR", _roff(meaning)]
    lines += [".SH SEE ALSO", "llama.cpp, ollama(1)"]
    return "\n".join(line for line in lines if line) + "\n"


def solve_option_table() -> str:
    """The fast entry's table of `phi4 solve`'s options, derived from the Typer command, so
    ``phi4cli.entry`` can parse the common command without importing Typer."""
    import typer

    from phi4cli.client.cli import app

    command = typer.main.get_command(app).commands["solve"]  # type: ignore[attr-defined]
    options: dict[str, tuple[str, str, tuple[int | None, int | None] | None]] = {}
    defaults: dict[str, Any] = {}
    types: dict[str, str] = {}
    argument = ""
    for param in command.params:
        if param.param_type_name == "argument":
            argument = param.name
            defaults[param.name] = param.default
            types[param.name] = "str | None"  # the question's words, joined
            continue
        # Typer vendors its own click: judge the types by their names.
        type_name = param.type.name
        kinds = {"int": "int", "int range": "int", "float": "float", "str": "str"}
        kind = "flag" if getattr(param, "is_flag", False) else kinds[type_name]
        if getattr(param, "multiple", False):
            kind = "list"  # given again, it adds (--backend A --backend B)
        bounds = (param.type.min, param.type.max) if type_name == "int range" else None
        for name in param.opts:
            options[name] = (param.name, kind, bounds)
        for name in getattr(param, "secondary_opts", []):  # --no-history: the flag's off form
            options[name] = (param.name, "off", None)
        # Typer hands a repeatable option that was not given as an empty tuple.
        defaults[param.name] = () if kind == "list" and param.default is None else param.default
        python = {"flag": "bool", "int": "int", "float": "float", "str": "str"}.get(kind)
        types[param.name] = (
            "tuple[str, ...]"
            if python is None
            else python + (" | None" if defaults[param.name] is None else "")
        )
    lines = [
        '"""`phi4 solve`\'s options for the fast entry (``phi4cli.entry``) and the record',
        "that holds them, generated by ``python -m phi4cli.docs`` from the Typer command; a",
        'test fails when it is stale."""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Any",
        "",
        "# option -> (parameter, kind: flag|off|int|float|str|list, (min, max) or None)",
        "OPTIONS = {",
        *(f"    {name!r}: {spec!r}," for name, spec in options.items()),
        "}",
        f"ARGUMENT = {argument!r}",
        "DEFAULTS = {",
        *(f"    {name!r}: {value!r}," for name, value in defaults.items()),
        "}",
        "",
        "",
        "class SolveOptions:",
        '    """`phi4 solve`\'s options, as Typer or the fast entry parsed them (None: not',
        "    given, the setting stands); ``answer``: those every answering command takes. A",
        '    plain class: a namedtuple of this many fields costs the fast start a millisecond."""',
        "",
        "    def __init__(",
        "        self,",
        *(f"        {name}: {types[name]} = {value!r}," for name, value in defaults.items()),
        "    ) -> None:",
        *(f"        self.{name} = {name}" for name in defaults),
        "",
        "    @property",
        "    def answer(self) -> dict[str, Any]:",
        '        """The answer options (``options.ANSWER_KEYS``), by setting name."""',
        "        from phi4cli.core.options import ANSWER_KEYS",
        "",
        "        return {key: getattr(self, key) for key in ANSWER_KEYS}",
    ]
    return "\n".join(lines) + "\n"


# The completion callbacks of cli_options.py, by the name the fast completer knows each by.
_COMPLETERS = {
    "_complete_model": "model",
    "complete_alias": "alias",
    "complete_setting_key": "setting_key",
    "complete_setting_value": "setting_value",
    "complete_chat": "chat",
}


def _value_kind(param: Any) -> Any:
    """How the fast completer completes ``param``'s value: a completer's name, ("choice", ...),
    "file" (the shell's own), "none" (nothing to offer), or "typer" (hand over)."""
    custom = getattr(param, "_custom_shell_complete", None)
    if custom is not None:
        for cell in custom.__closure__ or ():
            wrapped = getattr(cell.cell_contents, "__wrapped__", None)
            if wrapped is not None:
                choices = getattr(wrapped, "choices", None)
                if choices is not None:
                    return ("choice", *choices)
                return _COMPLETERS.get(wrapped.__name__, "typer")
        return "typer"
    type_name = type(param.type).__name__
    if type_name == "Choice" and param.type.case_sensitive:
        return ("choice", *map(str, param.type.choices))
    if type_name in ("Path", "File"):
        return "file"
    # TyperPath offers nothing, so that the shell completes the path itself.
    if type_name in (
        "TyperPath",
        "StringParamType",
        "IntParamType",
        "FloatParamType",
        "IntRange",
        "FloatRange",
        "BoolParamType",
        "UUIDParameterType",
    ):
        return "none"
    return "typer"


def _rendered(text: str) -> str:
    """What Typer shows of a completion's help: rich's rendering of it, never wrapped."""
    from rich.console import Console

    console = Console(width=100_000)
    return "".join(segment.text for segment in console.render(text)).rstrip("\n")


def _zsh_escape(text: str) -> str:
    return (
        text.replace('"', '""')
        .replace("'", "''")
        .replace("$", "\\$")
        .replace("`", "\\`")
        .replace(":", r"\\:")
    )


def completion_table() -> str:
    """The fast completer's table (``phi4cli/client/_completion_table.py``): each command's
    subcommands, options and arguments as Typer would complete them, so Tab does not import
    Typer or build the app. Help texts are stored as each shell is sent them."""
    import re as _re

    import typer

    from phi4cli.client.cli import app

    def help_forms(text: str | None) -> tuple[str, str] | None:
        if not text:
            return None
        return (_rendered(_zsh_escape(text)), _rendered(_re.sub(r"\s", " ", text)))

    table: dict[str, Any] = {}

    def visit(command: Any, path: str, parent: Any) -> None:
        ctx = command.make_context(
            path.split(" ")[-1] if path else "phi4", [], parent=parent, resilient_parsing=True
        )
        options, arguments = {}, []
        order = []
        for param in command.get_params(ctx):
            if param.param_type_name == "argument":
                arguments.append((param.name, param.nargs, _value_kind(param)))
                continue
            if param.param_type_name != "option" or param.hidden:
                continue
            takes_value = not (param.is_flag or param.count)
            kind = _value_kind(param) if takes_value else None
            names = [*param.opts, *param.secondary_opts]
            if param.name == "help":
                names.sort()  # click makes them from a set: another order in each process
            order.append((param.name, names, help_forms(param.help), bool(param.multiple)))
            for name in names:
                options[name] = (param.name, takes_value, kind)
        commands = []
        if hasattr(command, "commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is None or sub.hidden:
                    continue
                commands.append((name, help_forms(sub.get_short_help_str())))
        table[path] = {
            "options": options,
            "order": order,
            "arguments": arguments,
            "commands": commands if hasattr(command, "commands") else None,
        }
        if hasattr(command, "commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None:
                    visit(sub, f"{path} {name}".strip(), ctx)

    visit(typer.main.get_command(app), "", None)
    lines = [
        '"""Shell completion\'s table for ``phi4cli.client.completion``, generated by',
        '``python -m phi4cli.docs`` from the Typer app; a test fails when it is stale."""',
        "",
        "# command path -> options (name -> (parameter, takes a value, value kind)), their",
        "# order (parameter, names, (zsh help, fish help), multiple), arguments (name, nargs,",
        "# value kind) and subcommands ((name, help forms), or None for a command)",
        "TABLE = {",
        *(f"    {path!r}: {entry!r}," for path, entry in table.items()),
        "}",
    ]
    return "\n".join(lines) + "\n"


def expected_files() -> dict[Path, str]:
    from phi4cli.core.options import generated_records

    files = {ROOT / "phi4cli" / "core" / "_settings.py": generated_records()}
    files |= {ROOT / "completions" / f"phi4.{shell}": completion_script(shell) for shell in SHELLS}
    files[ROOT / "man" / "phi4.1"] = man_page()
    files[ROOT / "phi4cli" / "client" / "_solve_options.py"] = solve_option_table()
    files[ROOT / "phi4cli" / "client" / "_completion_table.py"] = completion_table()
    return files


def main() -> None:
    for path, text in expected_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path.relative_to(ROOT), file=sys.stderr)


if __name__ == "__main__":
    main()
