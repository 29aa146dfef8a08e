"""The committed completion scripts and man page match the app; both work."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from phi4cli.docs import expected_files
from tests.conftest import run_phi4


def test_completions_and_man_page_are_up_to_date():
    stale = [str(path) for path, text in expected_files().items()
             if not path.is_file() or path.read_text() != text]  # fmt: skip
    assert not stale, f"regenerate with `python -m phi4cli.docs`: {stale}"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_renders_without_warnings():
    page = next(p for p in expected_files() if p.name == "phi4.1")
    checked = subprocess.run(["groff", "-man", "-ww", "-z", str(page)], capture_output=True,
                             text=True, check=False)  # fmt: skip
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr
    rendered = subprocess.run(["groff", "-man", "-Tutf8", str(page)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    rendered = re.sub(".\x08", "", rendered)  # drop the overstrike that makes text bold
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "OPTIONS", "ENVIRONMENT",
                    "FILES", "EXIT STATUS", "EXAMPLES"):  # fmt: skip
        assert section in rendered
    assert "phi4 solve [OPTIONS] [PROMPT]" in rendered
    assert "--think-budget" in rendered


@pytest.mark.parametrize(
    ("words", "cword", "expected"),
    [("phi4 so", "1", "solve"), ("phi4 daemon st", "2", "start"), ("phi4 solve --answ", "2",
      "--answer-only")],
)  # fmt: skip
def test_bash_completion_answers(words: str, cword: str, expected: str):
    result = run_phi4(env={"_PHI4_COMPLETE": "complete_bash", "COMP_WORDS": words,
                           "COMP_CWORD": cword})  # fmt: skip
    assert expected in result.stdout.split()


def test_help_offers_completion_install():
    assert "--install-completion" in run_phi4("--help").stdout


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_examples_can_be_typed_as_shown_and_every_variable_is_listed():
    page = next(p for p in expected_files() if p.name == "phi4.1")
    rendered = subprocess.run(["groff", "-man", "-Tutf8", str(page)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    rendered = re.sub(".\x08", "", rendered)
    assert 'phi4 solve "Solve 3x^2+4x+5=1"' in rendered, "the quotes survive roff"
    environment = rendered[rendered.index("ENVIRONMENT") : rendered.index("\nFILES")]
    # Every PHI4_ variable the code names (a setting's, or read directly) has an entry.
    from phi4cli.docs import ROOT

    named = set()
    for source in (ROOT / "phi4cli").rglob("*.py"):
        named |= set(re.findall(r"\bPHI4_[A-Z][A-Z_]*[A-Z]\b", source.read_text()))
    named -= {"PHI4_COMPLETE"}  # Typer's completion protocol (_PHI4_COMPLETE), not a setting
    missing = sorted(name for name in named if name not in environment)
    assert not missing, missing
    for name in ("PHI4_KV_CACHE_TYPE", "PHI4_KV_LAYOUT", "PHI4_GPU_LAYERS", "PHI4_INSTRUCTION",
                 "PHI4_MLOCK", "PHI4_BACKEND_TIMEOUT"):  # fmt: skip
        assert name in environment


def test_the_man_pages_exit_status_is_the_readmes_table_for_every_code():
    from phi4cli.docs import exit_meanings
    from phi4cli.errors import ExitStatus

    rows = dict(exit_meanings())
    assert set(rows) == {str(int(status)) for status in ExitStatus}
    assert "the thinking ran out of tokens" in rows["1"] and "empty question" in rows["2"]
    assert "`" not in "".join(rows.values())
