"""The suite cleans up after itself (issue 36): a test that times out takes its client and daemon
with it, the suite's last step fails the run if anything it started is still running, a killed
suite's leftovers are killed by the next, a test that starts a daemon is marked ``daemon`` (so
``pytest -m "not daemon"`` is the quick loop), and the Ctrl-C tests work when the suite itself
was started with SIGINT ignored. Each runs a small suite of its own in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import _processes_with

ROOT = Path(__file__).resolve().parent.parent
HEADER = """\
import os, subprocess, sys, time
from pathlib import Path
import pytest
from tests.conftest import PHI4, run_phi4

def note(text):
    with open(os.environ["HYGIENE_NOTES"], "a") as notes:
        notes.write(text + "\\n")
"""


def run_suite(tmp_path: Path, body: str, ignore_sigint: bool = False) -> tuple[int, str, list[str]]:
    """Run ``body`` (tests) as a suite of its own with this suite's conftest; return its exit
    status, its output and the lines its tests noted."""
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(HEADER + textwrap.dedent(body))
    notes = tmp_path / "notes.txt"
    notes.touch()

    def ignored() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            str(test_file),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HYGIENE_NOTES": str(notes)},
        preexec_fn=ignored if ignore_sigint else None,
    )
    return done.returncode, done.stdout + done.stderr, notes.read_text().splitlines()


@pytest.mark.daemon
def test_a_test_that_times_out_takes_its_client_and_daemon_with_it(
    tmp_path: Path, tiny_model: Path
):
    status, output, notes = run_suite(
        tmp_path,
        f"""
        @pytest.mark.daemon
        @pytest.mark.timeout(10)
        def test_hangs():
            note(os.environ["PHI4_HOME"])
            assert run_phi4("daemon", "start", "-m", "{tiny_model}").returncode == 0
            # A client that waits for stdin that never ends.
            subprocess.Popen([PHI4, "solve", "-f", "-", "-m", "{tiny_model}"],
                             stdin=subprocess.PIPE)
            time.sleep(120)
    """,
    )
    assert status == 1 and "Timeout" in output, output
    (home,) = notes
    assert _processes_with(f"PHI4_HOME={home}".encode()) == []
    assert "left" not in output, "the test's own teardown killed them, not the suite's last step"


@pytest.mark.daemon
def test_the_suite_fails_when_something_it_started_is_left_running(
    tmp_path: Path, tiny_model: Path
):
    elsewhere = tmp_path / "elsewhere"
    status, output, _notes = run_suite(
        tmp_path,
        f"""
        @pytest.mark.daemon
        def test_escapes_its_home():
            done = run_phi4("daemon", "start", "-m", "{tiny_model}",
                            env={{"PHI4_HOME": "{elsewhere}"}})
            assert done.returncode == 0, done.stderr
    """,
    )
    assert status == 1, output
    assert "1 passed" in output
    assert "the suite left 1 process(es) running (killed now)" in output
    assert "phi4cli daemon run" in output
    assert _processes_with(f"PHI4_HOME={elsewhere}".encode()) == []


@pytest.mark.daemon
def test_a_test_that_starts_a_daemon_unmarked_is_an_error(tmp_path: Path, tiny_model: Path):
    status, output, _notes = run_suite(
        tmp_path,
        f"""
        def test_unmarked():
            assert run_phi4("daemon", "start", "-m", "{tiny_model}").returncode == 0
    """,
    )
    assert status == 1, output
    assert "started a daemon but is not marked daemon" in output
    assert "1 passed, 1 error" in output


def test_a_killed_suites_leftovers_are_killed_by_the_next(tmp_path: Path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a suite's pid that is no longer running
    orphan = subprocess.Popen(
        ["sleep", "120"], env={**os.environ, "PHI4_TEST_SUITE": str(gone.pid)}
    )
    try:
        status, output, _notes = run_suite(tmp_path, "def test_nothing():\n    pass\n")
        assert status == 0, output
        assert "killed 1 process(es) left by an earlier test run that was killed" in output
        assert orphan.wait(timeout=10) == -signal.SIGKILL
    finally:
        orphan.kill()
        orphan.wait()


def test_children_can_be_interrupted_when_the_suite_ignores_sigint(tmp_path: Path):
    # `pytest &` in a script starts it with SIGINT ignored, and SIG_IGN is inherited: a phi4
    # that a Ctrl-C test interrupts would never see the signal.
    status, output, notes = run_suite(
        tmp_path,
        """
        import signal
        def test_child():
            child = subprocess.run([sys.executable, "-c", "import signal; print(signal"
                                    ".getsignal(signal.SIGINT) is signal.default_int_handler)"],
                                   capture_output=True, text=True, check=True)
            note(child.stdout.strip())
            note(str(signal.getsignal(signal.SIGINT) is signal.SIG_IGN))
    """,
        ignore_sigint=True,
    )
    assert status == 0, output
    assert notes == ["True", "False"]
