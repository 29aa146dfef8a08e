"""Shell completion offers values: setting names, a setting's fixed values, model aliases and
``.gguf`` files, through the real ``phi4`` command as each shell's script calls it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import PHI4, run_phi4


def bash_complete(line: str, cwd: Path | None = None) -> list[str]:
    """What ``phi4`` answers bash for the command line ``line`` (the cursor at its end)."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    env = {"_PHI4_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(cword)}
    result = subprocess.run(
        [PHI4],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.daemon
def test_config_set_completes_the_setting_names():
    keys = bash_complete("phi4 config set ")
    assert {"model", "kv_layout", "kv_cache_type", "temperature", "instruction"} <= set(keys)
    assert bash_complete("phi4 config set kv_l") == ["kv_layout"]


@pytest.mark.parametrize(
    ("key", "values"),
    [
        ("kv_layout", ["auto", "shared", "streams"]),
        ("kv_cache_type", ["f16", "q8_0", "q4_0"]),
        ("ramdisk", ["auto", "on", "off"]),
        ("mlock", ["true", "false"]),
        ("temperature", []),
        ("deterministic", ["true", "false"]),
        ("loop", ["answer", "stop", "off"]),
    ],
)
@pytest.mark.daemon
def test_config_set_completes_a_fixed_set_of_values(key: str, values: list[str]):
    assert bash_complete(f"phi4 config set {key} ") == values


@pytest.mark.daemon
def test_the_values_offered_are_the_values_config_set_takes():
    from phi4cli.client.completion import setting_values

    for key in ("kv_layout", "kv_cache_type", "ramdisk", "mlock", "deterministic", "loop"):
        for value in setting_values(key, ""):
            assert run_phi4("config", "set", key, value).returncode == 0, (key, value)


@pytest.mark.daemon
def test_model_options_complete_aliases_and_gguf_files(tmp_path: Path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    offered = bash_complete("phi4 solve -m ", cwd=tmp_path)
    assert {"phi4-mini-reasoning", "smollm2-135m", "models/"} <= set(offered)
    assert "notes.txt" not in offered
    assert bash_complete("phi4 chat --model models/", cwd=tmp_path) == ["models/mine.gguf"]
    assert bash_complete("phi4 solve -m smo", cwd=tmp_path) == ["smollm2-135m"]
    assert bash_complete("phi4 pull ", cwd=tmp_path) == ["phi4-mini-reasoning", "smollm2-135m"]


def typer_answer(
    environ: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[str | None, int]:
    """What Typer itself answers the completion request ``environ`` (printed text, status)."""
    import typer

    from phi4cli.client.cli import app

    for name in ("COMP_WORDS", "COMP_CWORD", "_TYPER_COMPLETE_ARGS", "_TYPER_COMPLETE_FISH_ACTION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TERMINAL_WIDTH", "100000")  # Typer would wrap a long help otherwise
    capsys.readouterr()
    try:
        typer.main.get_command(app).main(args=[], prog_name="phi4", standalone_mode=False)
        status = 0
    except SystemExit as exc:
        status = int(exc.code or 0)
    printed = capsys.readouterr().out
    return (printed[:-1] if printed.endswith("\n") else None if printed == "" else printed), status


LINES = [
    "phi4 ",
    "phi4 so",
    "phi4 -",
    "phi4 --",
    "phi4 solve ",
    "phi4 solve -",
    "phi4 solve --m",
    "phi4 solve -m ",
    "phi4 solve -m sm",
    "phi4 solve --model=",
    "phi4 solve --model=sm",
    "phi4 solve -a --",
    "phi4 solve -a -",
    "phi4 solve what is 2+2 -",
    "phi4 solve -- -",
    "phi4 solve -n 4 --max",
    "phi4 solve -n4 -",
    "phi4 config ",
    "phi4 config s",
    "phi4 config set ",
    "phi4 config set kv",
    "phi4 config set kv_layout ",
    "phi4 config set kv_layout s",
    "phi4 config set mlock ",
    "phi4 config set temperature ",
    "phi4 config set kv_layout auto ",
    "phi4 daemon ",
    "phi4 daemon start --",
    "phi4 pull ",
    "phi4 pull p",
    "phi4 chat --resume ",
    "phi4 eval ",
    "phi4 eval x.jsonl -o ",
    "phi4 warm -m ",
    "phi4 cache ",
    "phi4 stop -",
    "phi4 models --",
    "phi4 serve --",
    "phi4 status --json -",
    "phi4 warm --kv-cache-type ",
    "phi4 warm --gpu-layers a",
    "phi4 solve --loop ",
    "phi4 eval x.jsonl --vote c",
    "phi4 daemon start --kv-layout s",
    "phi4 config set deterministic ",
]


def requests(line: str) -> list[dict[str, str]]:
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    return [
        {"_PHI4_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(cword)},
        {"_PHI4_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": line},
        {
            "_PHI4_COMPLETE": "complete_fish",
            "_TYPER_COMPLETE_ARGS": line,
            "_TYPER_COMPLETE_FISH_ACTION": "get-args",
        },
        {
            "_PHI4_COMPLETE": "complete_fish",
            "_TYPER_COMPLETE_ARGS": line,
            "_TYPER_COMPLETE_FISH_ACTION": "is-args",
        },
    ]


def normalised(answered: tuple[str | None, int]) -> tuple[list[str] | None, int]:
    """The candidates as a sorted list: every shell sorts them, and click lists the names of
    the help option (-h, --help) in an order that changes from run to run (a set's)."""
    text, status = answered
    if text is None:
        return None, status
    if text.startswith("_arguments '*: :((") and text.endswith("))'"):
        text = text[len("_arguments '*: :((") : -len("))'")]
    return sorted(text.split("\n")), status


@pytest.mark.parametrize("line", LINES)
def test_the_fast_completer_answers_as_typer_does(line: str, monkeypatch, capsys):
    from phi4cli.client.completion import answer

    for environ in requests(line):
        fast = answer(environ)
        if fast is not None:  # None: handed to Typer, which answers as always
            typer_says = typer_answer(environ, monkeypatch, capsys)
            assert normalised(fast) == normalised(typer_says), environ


WORDS = [
    "solve",
    "config",
    "set",
    "daemon",
    "start",
    "pull",
    "chat",
    "kv_layout",
    "mlock",
    "-m",
    "--model",
    "-n",
    "4",
    "-n4",
    "-a",
    "-ar",
    "--json",
    "--json=1",
    "--",
    "-",
    "x",
    "--nope",
    "--model=sm",
    "-h",
    "--kv-layout",
    "=",
    "'a b",
    '"q',
]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(st.sampled_from(WORDS), max_size=5),
    incomplete=st.sampled_from(["", "-", "--m", "s", "k", "=", "--model=", "--model=s", "-m"]),
)
def test_the_fast_completer_agrees_with_typer_on_any_words(words, incomplete, monkeypatch, capsys):
    from phi4cli.client.completion import answer

    line = " ".join(["phi4", *words, incomplete])
    for environ in requests(line if incomplete else line + " "):
        fast = answer(environ)
        if fast is not None:
            typer_says = typer_answer(environ, monkeypatch, capsys)
            assert normalised(fast) == normalised(typer_says), environ


@pytest.mark.parametrize(
    ("line", "offered"),
    [
        ("phi4 warm --kv-cache-type ", ["f16", "q8_0", "q4_0"]),
        ("phi4 solve --loop s", ["stop"]),
        ("phi4 daemon start --gpu-layers ", ["auto", "all", "0"]),
        ("phi4 eval x --vote ", ["count", "confidence"]),
        ("phi4 chat --resume ", ["algebra", "geometry"]),
        ("phi4 chat --resume g", ["geometry"]),
    ],
)
@pytest.mark.daemon
def test_option_values_are_offered_where_they_are_a_few_words(line: str, offered: list[str]):
    # Before: `config set kv_cache_type <Tab>` offered the values, `warm --kv-cache-type <Tab>`
    # nothing; nor `chat --resume <Tab>` the saved conversations.
    from phi4cli.core.paths import get_paths

    chats = get_paths().data_dir / "chats"
    chats.mkdir(parents=True, exist_ok=True)
    for name in ("algebra", "geometry"):
        (chats / f"{name}.json").write_text("{}")
    assert bash_complete(line) == offered
