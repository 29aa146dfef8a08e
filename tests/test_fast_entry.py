"""The fast entry for `phi4 solve`: it parses exactly as the Typer command does (or hands over
to Typer), and the common command reaches the daemon without importing Typer, rich or
prompt-toolkit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

from phi4cli.client._solve_options import OPTIONS
from phi4cli.client.cli import app
from phi4cli.core.inputs import join_words
from phi4cli.entry import parse_solve
from tests.conftest import run_phi4

SOLVE = typer.main.get_command(app).commands["solve"]  # type: ignore[attr-defined]


def typer_parse(args: list[str]) -> dict[str, Any] | None:
    """What Typer hands the solve command for ``args``; None when it refuses them."""
    try:
        context = SOLVE.make_context("solve", list(args), resilient_parsing=False)
    except Exception:
        return None
    params = dict(context.params)
    params["prompt"] = join_words(params["prompt"])  # as the Typer command does with the words
    return params


VALUES = st.sampled_from(["0", "1", "7", "64", "65", "-1", "0.5", "x", "", "-", "--json", "3e2"])
TOKENS = st.one_of(
    st.sampled_from(sorted(OPTIONS)),
    st.sampled_from(["--help", "-h", "--nope", "-ar", "--json=1", "--", "-", "-n4", "-t0.2"]),
    st.builds(lambda o, v: f"{o}={v}", st.sampled_from(sorted(OPTIONS)), VALUES),
    VALUES,
    st.sampled_from(["What is 2+2?", "x", "what", "is"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(TOKENS, max_size=6))
def test_the_fast_parser_agrees_with_typer_or_hands_over(args: list[str]):
    fast = parse_solve(args)
    if fast is not None:
        assert fast == typer_parse(args), args
    if typer_parse(args) is None:
        assert fast is None, f"Typer refuses {args}, so the fast path must hand over"


@pytest.mark.parametrize(
    "args",
    [
        ["What is 2+2?"],
        ["What?", "-m", "tiny", "-n", "1", "-t", "0", "--json"],
        ["-a", "--think-budget", "0", "--max-tokens=9", "q"],
        ["--file", "p.txt", "--jsonl", "-k", "1"],
        ["--", "-5 + 3?"],
        ["what", "is", "2+2", "-n", "3"],
        ["-t", "0", "--", "-5", "+", "3?"],
    ],
)
def test_common_commands_take_the_fast_path(args: list[str]):
    parsed = parse_solve(args)
    assert parsed is not None and parsed == typer_parse(args)


def _imports(
    argv: list[str], env: dict[str, str] | None = None, stdin: str = ""
) -> tuple[int, list[str], list[str]]:
    """Run phi4 with ``argv``: its exit status, the heavy top-level modules it imported, and
    all of phi4cli's modules it imported."""
    script = (
        "import atexit, sys\n"
        "heavy = ('typer', 'click', 'rich', 'prompt_toolkit', 'llama_cpp', 'numpy', 'httpx2',\n"
        "         'math_verify', 'sympy', 'huggingface_hub')\n"
        "atexit.register(lambda: print(json.dumps([sorted({m.split('.')[0] for m in sys.modules\n"
        "    if m.split('.')[0] in heavy}), sorted(m for m in sys.modules\n"
        "    if m.split('.')[0] == 'phi4cli')]), file=sys.stderr))\n"
        "import json\n"
        "from phi4cli.entry import main\n"
        f"main({argv!r})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, **(env or {})},
        check=False,
    )
    heavy, ours = json.loads(result.stderr.strip().splitlines()[-1])
    return result.returncode, heavy, ours


def _imported_by_solve(tiny_model: Path, *extra: str) -> tuple[int, list[str]]:
    code, heavy, _ours = _imports(["solve", "What?", "-m", str(tiny_model), "-n", "2", *extra])
    return code, heavy


def test_the_modules_are_ordinary_python():
    # The start-up tricks that kept typing, threading and dataclasses out of a warm solve
    # (TYPE_CHECKING = False, Protocol = object, _thread's lock, records built by hand) bought a
    # few milliseconds of a command that waits seconds for its answer: they are gone.
    root = Path(__file__).resolve().parent.parent
    tricks = []
    for path in (root / "phi4cli").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for trick in ("\nTYPE_CHECKING = False\n", "Protocol = object", "import _thread"):
            if trick in text:
                tricks.append(f"{path.relative_to(root)}: {trick.strip()}")
    assert tricks == []


@pytest.mark.daemon
def test_a_warm_solve_imports_no_typer_rich_prompt_toolkit_or_sympy(tiny_model: Path):
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    assert _imported_by_solve(tiny_model) == (0, [])
    assert _imported_by_solve(tiny_model, "--json") == (0, [])
    # Anything the fast parser is unsure of is Typer's, as before.
    code, imported = _imported_by_solve(tiny_model, "--no-such-option")
    assert code == 2 and "typer" in imported


@pytest.mark.daemon
def test_help_and_errors_are_still_typers():
    helped = run_phi4("solve", "--help")
    assert helped.returncode == 0 and "Usage: phi4 solve [OPTIONS] [prompt]..." in helped.stdout
    refused = run_phi4("solve", "x", "--samples", "65")
    assert refused.returncode == 2 and "65 is not in the range 1<=x<=64" in refused.stderr


def test_the_daemon_options_are_declared_once_for_every_command_that_starts_it():
    from phi4cli.core.options import DAEMON_OPTIONS

    group = typer.main.get_command(app)
    commands = {
        "daemon start": group.commands["daemon"].commands["start"],  # type: ignore[attr-defined]
        "daemon run": group.commands["daemon"].commands["run"],  # type: ignore[attr-defined]
        "warm": group.commands["warm"],  # type: ignore[attr-defined]
    }
    shared = set(DAEMON_OPTIONS)
    for name, command in commands.items():
        options = {p.name: p for p in command.params}
        assert shared <= set(options), name
        # The same declaration: the same flags and help everywhere.
        first = typer.main.get_command(app).commands["warm"]  # type: ignore[attr-defined]
        reference = {p.name: p for p in first.params}
        for key in shared:
            assert options[key].opts == reference[key].opts
            assert options[key].help == reference[key].help


@pytest.mark.daemon
def test_solve_runs_in_process_on_an_environment_of_its_own(tiny_model: Path):
    # Before, solve read sys.stdout and isatty itself: tests patched presenters or needed a pty.
    import io

    from phi4cli.client.environment import Environment
    from phi4cli.client.solving import SolveOptions, run_solve
    from phi4cli.core.paths import get_paths

    out, err = io.StringIO(), io.StringIO()
    env = Environment(
        io.StringIO("not read: the question is the argument"), out, err, paths=get_paths()
    )
    options = SolveOptions(
        prompt="What is 2+2?", model=str(tiny_model), max_tokens=3, temperature=0.0, as_json=True
    )
    assert run_solve(options, env) == 0
    record = json.loads(out.getvalue())
    assert record["question"] == "What is 2+2?"
    assert record["stats"]["completion_tokens"] == 3
    assert "starting the phi4 daemon" in err.getvalue()


def test_the_answer_options_are_declared_once_for_solve_and_chat():
    from phi4cli.client.cli import ANSWER_OPTIONS, CHAT_OPTIONS

    group = typer.main.get_command(app)
    solve, chat = group.commands["solve"], group.commands["chat"]  # type: ignore[attr-defined]
    in_solve = {p.name: p for p in solve.params}
    in_chat = {p.name: p for p in chat.params}
    # Chat samples each message once: the options of votes are solve's (and eval's) only.
    assert set(ANSWER_OPTIONS) - set(CHAT_OPTIONS) == {"vote", "stop_unsure"}
    assert not {"vote", "stop_unsure"} & set(in_chat)
    for key in CHAT_OPTIONS:
        assert in_solve[key].opts == in_chat[key].opts
        assert in_solve[key].help == in_chat[key].help


@pytest.mark.daemon
def test_a_question_of_unquoted_words_is_joined_and_stdin_left_alone(tiny_model: Path):
    # `ollama run m why is the sky blue` works; so does `phi4 solve what is 2+2`, on the fast
    # path and on Typer's, and the words are the question even when stdin has text waiting.
    args = ["solve", "what", "is", "2+2", "-m", str(tiny_model), "-n", "2", "-t", "0", "--json"]
    fast = run_phi4(*args, input="from stdin\n")
    assert fast.returncode == 0, fast.stderr
    assert json.loads(fast.stdout)["question"] == "what is 2+2"
    typer_path = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from phi4cli.client.cli import main; main(sys.argv[1:])",
            *args,
        ],
        input="from stdin\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert typer_path.returncode == 0, typer_path.stderr
    assert json.loads(typer_path.stdout)["question"] == "what is 2+2"
    # A lone '-' still reads the question from stdin.
    piped = run_phi4("solve", "-", "-m", str(tiny_model), "-n", "2", "--json", input="x + 1\n")
    assert piped.returncode == 0 and json.loads(piped.stdout)["question"] == "x + 1"


@pytest.mark.daemon
def test_a_question_beside_file_is_refused_not_dropped(tmp_path: Path):
    problems = tmp_path / "p.txt"
    problems.write_text("What is 1+1?\n")
    result = run_phi4("solve", "--file", str(problems), "what", "is", "2+2")
    assert result.returncode == 2 and result.stdout == ""
    assert "give a question or --file, not both: 'what is 2+2'" in result.stderr


def test_the_typer_commands_write_through_the_environment_main_is_given(tmp_path: Path):
    # One Environment per run, made by the entry and handed down: solve and eval print there.
    import io

    from phi4cli.client import cli, cli_env
    from phi4cli.client.environment import Environment
    from tests.scripted_server import scripted_server, separated

    problems = tmp_path / "set.jsonl"
    problems.write_text(json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    with scripted_server(
        lambda _body: separated("reasoning_content", ["Hm."], ["$\\boxed{4}$"])
    ) as server:
        printed = []
        try:
            for args in (["solve", "2+2?", "--answer-only"], ["eval", str(problems), "--json"]):
                out, err = io.StringIO(), io.StringIO()
                env = Environment(io.StringIO(), out, err)
                with pytest.raises(SystemExit) as exited:
                    cli.main([*args, "--backend", server.url, "-m", "m"], env)
                assert exited.value.code == 0, err.getvalue()
                printed.append(out.getvalue())
        finally:
            cli_env.use_environment(None)  # as a later command run some other way finds it
    answer, summary = printed
    assert answer == "4\n"
    assert json.loads(summary)["correct"] == 1
