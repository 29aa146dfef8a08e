"""What a newcomer met in the first hour (issue 36), and what a fresh-clone trial of the docs
found after, each pinned: what phi4 says and shows, and that the docs' lines work as written."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PHI4, run_phi4
from tests.scripted_server import Step, chunk, data, scripted_server

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.daemon
def test_status_json_without_a_daemon_still_prints_json():
    # Before: nothing on stdout, only the error on stderr (exit 3).
    done = run_phi4("status", "--json")
    assert done.returncode == 3
    assert json.loads(done.stdout) == {
        "running": False,
        "state": "not running",
        "reason": "no daemon is running; `phi4 daemon start` starts one",
    }
    assert "no daemon is running" in done.stderr


@pytest.mark.daemon
def test_a_backend_that_is_not_a_url_is_named_as_given():
    # Before: "invalid backend ('notaurl',)", the repeated option's tuple.
    done = run_phi4("solve", "hi", "--backend", "notaurl")
    assert done.returncode == 2
    assert "invalid backend 'notaurl': expected the http(s) URL" in done.stderr


def _cut(_body: dict[str, Any]) -> list[str | Step]:
    return [chunk({"content": "Let me add them: 12 + 13 is"}), chunk({}, "length"), data("[DONE]")]


@pytest.mark.daemon
def test_an_answer_cut_at_max_tokens_says_it_was_cut():
    # Before: "no final answer stated in the solution", as if the model had chosen not to.
    with scripted_server(_cut) as server:
        done = run_phi4(
            "solve",
            "What is 12+13?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-a",
            "-n",
            "8",
            timeout=100,
        )
    assert done.returncode == 1
    assert "the answer was cut off at --max-tokens (raise it)" in done.stderr


def test_the_llama_build_script_asks_for_no_download():
    # LLAMA_USE_PREBUILT_UI defaults to ON in newer llama.cpp, and tries a download.
    script = (ROOT / "bench" / "llama_build.sh").read_text()
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in script


@pytest.mark.timeout(600)
@pytest.mark.daemon
def test_a_file_on_an_idle_default_daemon_runs_as_many_at_once_as_the_plan_says(
    tiny_model: Path, tmp_path: Path
):
    # Before: "4 at once" in the plan, but a request reserved 4,096 tokens and 4,072 were free
    # beside the system prompt's cells: the fourth problem waited.
    started = run_phi4("daemon", "start", "-m", str(tiny_model), timeout=300)
    assert started.returncode == 0, started.stderr
    plan = json.loads(run_phi4("status", "--json").stdout)["memory"]["plan"]
    assert plan["kv_layout"] == "shared" and plan["parallel"] == 4, plan
    problems = tmp_path / "four.txt"
    problems.write_text("".join(f"Count to {i}\n" for i in range(4)))
    run = subprocess.Popen(
        [PHI4, "solve", "-f", str(problems), "-m", str(tiny_model)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    most = 0
    try:
        while run.poll() is None and most < 4:
            status = json.loads(run_phi4("status", "--json").stdout)
            most = max(most, int(status["memory"]["running"]))
            time.sleep(0.2)
    finally:
        run.kill()
        run.wait()
        run_phi4("stop")
    assert most == 4


def _boxed(_body: dict[str, Any]) -> list[str | Step]:
    return [chunk({"content": "So it is \\boxed{7}."}), chunk({}, "stop"), data("[DONE]")]


@pytest.mark.daemon
def test_a_megabyte_line_in_a_file_is_not_echoed_whole(tmp_path: Path):
    # Before: the human output echoed the question above its solution, all 1,040,064 bytes of it.
    problems = tmp_path / "long.txt"
    long_line = "What is " + "1+" * 500_000 + "1?"
    problems.write_text(f"What is 3+4?\n{long_line}\n")
    with scripted_server(_boxed) as server:
        done = run_phi4(
            "solve", "-f", str(problems), "--backend", server.url, "-m", "m", timeout=100
        )
    assert "[1] What is 3+4?" in done.stdout
    assert "[2] What is 1+1+1+" in done.stdout
    assert f"… ({len(long_line):,} characters)" in done.stdout
    assert len(done.stdout) < 5000, len(done.stdout)


def _rendered(solution: str) -> list[str]:
    """The solution as the terminal shows it, line by line, without trailing spaces."""
    import io

    from rich.console import Console

    from phi4cli.client.presenters import _markdown

    console = Console(width=80, force_terminal=False, record=True, file=io.StringIO())
    console.print(_markdown(solution))
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_a_math_environment_outside_dollars_is_shown_as_display_math_row_by_row():
    # Before: "\begin{align*} x &= 1 + 2 \ y &= 3/4 \end{align*}" on one line, a \\ lost.
    shown = _rendered(
        "We get\n\\begin{align*}\nx &= 1 + 2 \\\\\ny &= \\frac{3}{4}\n\\end{align*}\nso done."
    )
    assert shown == ["We get", "", "x = 1 + 2", "y = 3/4", "", "so done."]


def test_the_rows_of_aligned_display_math_are_not_run_together():
    assert _rendered("$$\\begin{aligned} x &= 1 \\\\ y &= 2\\end{aligned}$$") == ["x = 1", "y = 2"]


def test_an_empty_box_is_shown_as_a_box():
    # Before: "The answer is within ." — nothing where the box was.
    assert _rendered("The answer is within \\boxed{}.") == ["The answer is within □."]


def _two_lines(_body: dict[str, Any]) -> list[str | Step]:
    return [chunk({"content": "First line.\nSecond line."}), chunk({}, "stop"), data("[DONE]")]


@pytest.mark.daemon
def test_piped_chat_separates_one_answer_from_the_next():
    # Before: "...Second line.First line..." — no way to tell where one answer ended.
    with scripted_server(_two_lines) as server:
        done = run_phi4(
            "chat", "--backend", server.url, "-m", "m", input="one\ntwo\nthree\n", timeout=100
        )
    assert done.returncode == 0, done.stderr
    answer = "First line.\nSecond line.\n"
    assert done.stdout == f"{answer}\n{answer}\n{answer}"


def test_the_docs_completion_and_man_page_lines_work_on_a_fresh_home(tmp_path: Path):
    # Before: the `cp` lines failed on a fresh home (no `mkdir -p`), and `man phi4` found nothing
    # without MANPATH. The block's lines are run as written, in a home with nothing in it.
    page = (ROOT / "docs" / "install-and-builds.md").read_text()
    block = page.split("## Shell completion and man page", 1)[1].split("```sh\n", 1)[1]
    lines = [line.split("#", 1)[0].strip() for line in block.split("```", 1)[0].splitlines()]
    lines = [line for line in lines if line.startswith(("mkdir", "cp"))]
    assert len(lines) == 5, lines
    home = tmp_path / "home"
    home.mkdir()
    for line in lines:
        done = subprocess.run(
            line,
            shell=True,
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0, (line, done.stderr)
    assert (home / ".local/share/bash-completion/completions/phi4").is_file()
    assert (home / ".local/share/man/man1/phi4.1").is_file()
    assert 'export MANPATH="$HOME/.local/share/man:"' in page
