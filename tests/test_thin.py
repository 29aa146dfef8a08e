"""The thin client (``phi4cli/thin.py``, the ``phi4`` script's first stop): a warm ``phi4 solve``
run inside the daemon (``op: run``, ``client/served.py``) must write what the full client writes
and end with the same status, and anything the daemon declines must run in the full client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phi4cli import thin
from phi4cli.core import protocol
from phi4cli.core.config import VARIABLES, Settings, env_name
from phi4cli.core.errors import ExitStatus
from phi4cli.core.paths import get_paths
from phi4cli.core.rendezvous import NOT_READ_BY_A_SOLVE, read_by_a_command, runtime_dir
from tests.conftest import PHI4, run_phi4

# The full client, as the `phi4` script was before the thin client: the same process start.
FULL = [sys.executable, "-c", "import sys; from phi4cli.entry import main; sys.argv[0] = "
        "'phi4'; main()"]  # fmt: skip


# --- without a daemon ---------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(_json_values)
@settings(max_examples=300)
def test_what_the_thin_client_sends_reads_back_as_json_does(value: Any):
    assert json.loads(thin.encode(value)) == value


@given(st.dictionaries(st.text(), _json_values, max_size=5))
@settings(max_examples=300)
def test_what_the_thin_client_reads_is_what_json_reads(value: dict[str, Any]):
    line = protocol.encode(value)  # as the daemon sends it (lone surrogates become U+FFFD)
    assert thin.decoder()(line) == json.loads(line)


def test_the_thin_client_refuses_garbage_as_json_does():
    decode = thin.decoder()
    for line in (b"{", b'{"a": 1} x\n', b"", b"nope\n"):
        with pytest.raises((ValueError, StopIteration)):
            decode(line)


def test_the_installed_phi4_is_bin_phi4_and_imports_nothing_first():
    # As pip installs a script file: bin/phi4 with this environment's python on its first line,
    # not a script generated for an entry point (which would import re first).
    installed = Path(PHI4).read_text().splitlines()
    source = (Path(__file__).resolve().parent.parent / "bin" / "phi4").read_text().splitlines()
    assert installed[0].startswith("#!") and source[0] == "#!python"
    assert installed[1:] == source[1:]
    statements = [line for line in source if line.startswith(("import", "from"))]
    assert statements == ["import sys", "from phi4cli.thin import main"], statements


def test_the_thin_clients_constants_are_the_protocols():
    assert thin.PROTOCOL_VERSION == protocol.PROTOCOL_VERSION
    assert thin.INTERRUPTED == ExitStatus.INTERRUPTED
    assert thin.UNAVAILABLE == ExitStatus.DAEMON_UNAVAILABLE


def test_every_variable_phi4_reads_is_compared_before_the_daemon_runs_a_command():
    names = {name for variable in VARIABLES for name in variable.names} - NOT_READ_BY_A_SOLVE
    names |= {env_name(key) for key in Settings._fields}
    names |= {
        "HOME",
        "XDG_CONFIG_HOME",
        "XDG_DATA_HOME",
        "XDG_STATE_HOME",
        "XDG_CACHE_HOME",
        "XDG_RUNTIME_DIR",
        "NO_COLOR",
        "TMPDIR",
    }  # platformdirs', tempfile's, the view's
    assert {name for name in names if not read_by_a_command(name)} == set()
    # A login's own: two terminals of one user differ in these, and share one daemon.
    for name in (
        "PWD",
        "SHLVL",
        "XDG_SESSION_ID",
        "XDG_VTNR",
        "TERM",
        "LANG",
        "COLUMNS",
        "EDITOR",
        "https_proxy",
    ):
        assert not read_by_a_command(name), name


def test_the_thin_client_finds_the_runtime_dir_the_full_client_uses(monkeypatch, tmp_path: Path):
    def thin_dir() -> str | None:
        return runtime_dir(os.environ, thin._tempdir)

    monkeypatch.chdir(tmp_path)
    for home in (str(tmp_path / "home"), "relative/home", "~/somewhere"):
        monkeypatch.setenv("PHI4_HOME", home)
        assert Path(thin_dir() or "") == get_paths().runtime_dir
    monkeypatch.delenv("PHI4_HOME")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert Path(thin_dir() or "") == get_paths().runtime_dir == tmp_path / "phi4"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    for name in ("TMPDIR", "TEMP", "TMP"):
        monkeypatch.delenv(name, raising=False)
    assert Path(thin_dir() or "") == get_paths().runtime_dir
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert thin_dir() is None  # the full client decides


def test_what_a_daemon_says_decides_who_runs_the_command(capsys):
    # A daemon from before `run` answers bad_request; one that declines says why: nothing was
    # written, so the full client runs the command.
    for event in (
        {"event": "error", "code": "bad_request", "message": "unknown op 'run'"},
        {"event": "done", "result": {"declined": "another environment (PHI4_X)"}},
    ):
        with pytest.raises(thin.Declined):
            thin._Command().see(event)
    # Notices on stderr alone leave it to the full client too (which says them again).
    command = thin._Command()
    command.see({"event": "accepted"})
    command.see({"event": "output", "stream": "err", "text": "phi4: a notice\n"})
    with pytest.raises(thin.Declined):
        command.gone("the daemon went away while running the command; run it again")
    # Once an answer is out, the command is lost with its daemon: said, exit 3, below the
    # answer's line, ended.
    command.see({"event": "output", "stream": "out", "text": "The answer"})
    assert command.see({"event": "error", "code": "internal", "message": "boom"}) == 3
    out, err = capsys.readouterr()
    assert out == "The answer\n"
    assert err == ("phi4: a notice\nphi4: error: the daemon could not run the command: boom; "
                   "run it again\n")  # fmt: skip
    assert thin._Command().see({"event": "done", "result": {"status": 130}}) == 130


# --- with a daemon ------------------------------------------------------------------------------


def _status() -> dict[str, Any]:
    result = run_phi4("status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def _commands() -> dict[str, int]:
    return _status()["commands"]  # type: ignore[no-any-return]


def _run(command: list[str], *args: str, input: str | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([*command, *args], input=input, capture_output=True, text=True,
                          stdin=None if input is not None else subprocess.DEVNULL, timeout=120,
                          env={**os.environ, **(env or {})}, check=False)  # fmt: skip


@pytest.fixture
def warm(tiny_model: Path) -> Path:
    """A running daemon with the tiny model loaded (started by the full client)."""
    result = run_phi4("warm", "-m", str(tiny_model))
    assert result.returncode == 0, result.stderr
    return tiny_model


SAME = [
    ["What is 2+2?", "-n", "12", "-t", "0"],
    ["What is 2+2?", "-n", "12", "-t", "0", "--json"],
    ["What is 2+2?", "-n", "12", "-t", "0", "-a"],
    ["What is 2+2?", "-n", "12", "-t", "0", "-r", "--raw-output"],
    ["What is 2+2?", "-m", "no-such-model"],  # an error, said by the same code
    [""],  # the question is empty: a usage error
    [
        "What is 2+2?",
        "-n",
        "12",
        "-t",
        "0",
        "--n-ctx",
        "1024",
    ],  # the daemon keeps its own: said once
]


@pytest.mark.daemon
@pytest.mark.parametrize("args", SAME, ids=[" ".join(a) or "empty" for a in SAME])
def test_a_command_the_daemon_runs_writes_what_the_full_client_writes(warm: Path,
                                                                      args: list[str]):  # fmt: skip
    model = [] if "-m" in args else ["-m", str(warm)]
    before = _commands()
    thin_run = _run([PHI4], "solve", *args, *model)
    assert _commands()["served"] == before["served"] + 1, thin_run.stderr
    full_run = _run(FULL, "solve", *args, *model)
    assert _commands()["served"] == before["served"] + 1  # (the full client ran that one)
    assert (thin_run.returncode, _steady(thin_run.stdout), thin_run.stderr) == \
        (full_run.returncode, _steady(full_run.stdout), full_run.stderr)  # fmt: skip


def _steady(stdout: str) -> Any:
    """Output, less what differs from one run to the next (--json's timings and drawn seed)."""
    try:
        record = json.loads(stdout)
    except ValueError:
        return stdout
    return {key: value for key, value in record.items() if key not in ("stats", "seed")}


@pytest.mark.daemon
def test_a_daemon_started_in_one_terminal_runs_the_commands_of_another(warm: Path):
    # Another login: its own session, terminal type and locale; the same phi4 settings.
    other = {"XDG_SESSION_ID": "77", "TERM": "dumb", "LANG": "C.UTF-8", "SHLVL": "3"}
    before = _commands()
    args = ["solve", "What is 2+2?", "-n", "12", "-t", "0", "-m", str(warm)]
    thin_run = _run([PHI4], *args, env=other)
    assert _commands()["served"] == before["served"] + 1, thin_run.stderr
    full_run = _run(FULL, *args, env=other)
    assert (thin_run.returncode, thin_run.stdout, thin_run.stderr) == \
        (full_run.returncode, full_run.stdout, full_run.stderr)  # fmt: skip


DECLINED = [
    (["-f", "-", "-n", "4", "-t", "0"], "What is 2+2?\n3+3?\n", {}),  # problems on stdin
    (["What is 2+2?", "-n", "4"], None, {"PHI4_TEMPERATURE": "0"}),  # another environment
    (["What is 2+2?", "-n", "4", "--help"], None, {}),  # Typer's to answer
    (["What is 2+2?", "-n", "12", "-k", "3", "--seed", "7", "--all"], None, {}),  # a vote
    (["What is 2+2?", "-n", "x"], None, {}),  # Typer's to refuse
]


@pytest.mark.daemon
@pytest.mark.parametrize(
    ("args", "stdin", "env"), DECLINED, ids=["file", "env", "help", "vote", "bad"]
)
def test_what_the_daemon_declines_runs_in_the_full_client(warm: Path, args: list[str],
                                                          stdin: str | None,
                                                          env: dict[str, str]):  # fmt: skip
    before = _commands()
    thin_run = _run([PHI4], "solve", *args, "-m", str(warm), input=stdin, env=env)
    after = _commands()
    assert after["served"] == before["served"]
    full_run = _run(FULL, "solve", *args, "-m", str(warm), input=stdin, env=env)
    assert (thin_run.returncode, thin_run.stdout, thin_run.stderr) == \
        (full_run.returncode, full_run.stdout, full_run.stderr)  # fmt: skip


STDIN = [
    (["-", "-n", "12", "-t", "0", "--jsonl"], b""),  # said before stdin is read
    (["-", "-n", "12", "-t", "0"], b"What is 2+2?\n"),
    (["-n", "12", "-t", "0", "-a"], b"What is 2+2?"),  # no question given: stdin, a pipe
    (["-", "-n", "12", "-t", "0"], b""),  # the question is empty
    (["-", "-n", "12", "-t", "0"], b"What is \xff?\n"),  # not UTF-8
    (["-", "-n", "12", "-t", "0", "--json"], "Was ist 2·2? ∑ \U0001d465".encode()),
]


@pytest.mark.daemon
@pytest.mark.parametrize(
    ("args", "stdin"), STDIN, ids=["usage", "dash", "none", "empty", "bad", "utf8"]
)
def test_a_question_on_stdin_is_read_by_the_thin_client_for_the_daemon(warm: Path,
                                                                      args: list[str],
                                                                      stdin: bytes):  # fmt: skip
    before = _commands()
    runs = [subprocess.run([*command, "solve", *args, "-m", str(warm)], input=stdin,
                           capture_output=True, timeout=120, check=False)
            for command in ([PHI4], FULL)]  # fmt: skip
    after = _commands()
    assert (after["served"], after["declined"]) == (before["served"] + 1, before["declined"])
    thin_run, full_run = runs
    assert (thin_run.returncode, _steady(thin_run.stdout.decode()), thin_run.stderr) == \
        (full_run.returncode, _steady(full_run.stdout.decode()), full_run.stderr)  # fmt: skip


@pytest.mark.daemon
def test_options_that_do_not_go_together_are_refused_before_stdin_is_read(warm: Path):
    # `sleep 100 | phi4 solve --jsonl`: refused at once, as by the full client.
    process = subprocess.Popen([PHI4, "solve", "--jsonl", "-m", str(warm)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        process.wait(timeout=30)  # with its stdin open all along
    finally:
        process.kill()
    assert process.stderr is not None
    assert process.returncode == ExitStatus.USAGE
    assert b"--jsonl goes with --file or --each-line" in process.stderr.read()


@pytest.mark.daemon
def test_a_question_too_long_for_the_daemon_reaches_the_full_client_whole(warm: Path):
    # Read for the daemon, then too long for one request: the full client gets all of it.
    question = b"x" * (1 << 20)
    before = _commands()
    thin_run, full_run = [subprocess.run([*command, "solve", "-", "-m", str(warm), "-n", "4"],
                                         input=question, capture_output=True, timeout=120,
                                         check=False) for command in ([PHI4], FULL)]  # fmt: skip
    assert _commands()["served"] == before["served"]
    assert full_run.returncode != 0 and full_run.stderr  # too long: said, not sent
    assert (thin_run.returncode, thin_run.stdout, thin_run.stderr) == \
        (full_run.returncode, full_run.stdout, full_run.stderr)  # fmt: skip


def test_a_daemon_is_not_idle_while_a_command_runs():
    from types import SimpleNamespace

    from phi4cli.daemon.server import DaemonServer

    server: Any = SimpleNamespace(keep_alive=0.0, scheduler=SimpleNamespace(busy=False),
                                  state="ready", _served={object()},
                                  last_activity=time.monotonic() - 10)  # fmt: skip
    # Its requests have ended, but it still writes what they answered (--json, --answer-only).
    assert not DaemonServer._idle_expired(server)
    server._served = set()
    assert DaemonServer._idle_expired(server)


@pytest.mark.daemon
def test_keep_alive_0_answers_through_the_daemon(warm: Path):
    # The daemon leaves after each answer; the command finishes first (no second daemon is
    # started for it, which would say so on stderr).
    for _ in range(3):
        result = _run([PHI4], "solve", "What?", "-m", str(warm), "-n", "12", "-t", "0", "--json",
                      "--keep-alive", "0")  # fmt: skip
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        assert json.loads(result.stdout)["solution"]
        deadline = time.monotonic() + 30
        while run_phi4("status").returncode != 3:  # it leaves, as keep_alive 0 asks
            assert time.monotonic() < deadline, "the daemon stayed"
            time.sleep(0.1)
        assert run_phi4("warm", "-m", str(warm)).returncode == 0


@pytest.mark.daemon
def test_a_model_named_relative_to_another_directory_is_found_there(warm: Path, tmp_path: Path):
    os.symlink(warm, tmp_path / "here.gguf")
    before = _commands()
    result = subprocess.run([PHI4, "solve", "What?", "-m", "here.gguf", "-n", "4", "-t", "0"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _commands()["declined"] == before["declined"] + 1


@pytest.mark.daemon
def test_the_thin_client_imports_no_re_enum_json_socket_or_pathlib(warm: Path):
    # Without site (-S): an editable install's import hook would import re and pathlib for
    # every interpreter; the checkout is reached through PYTHONPATH instead.
    root = str(Path(__file__).resolve().parent.parent)
    before = _commands()
    result = _run([sys.executable, "-S", "-X", "importtime", PHI4], "solve", "What?", "-m",
                  str(warm), "-n", "4", "-t", "0", env={"PYTHONPATH": root})  # fmt: skip
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}  # fmt: skip
    assert "phi4cli.thin" in imported
    assert _commands()["served"] == before["served"] + 1, "the daemon ran it"
    heavy = {"re", "enum", "json", "socket", "pathlib", "typing", "contextlib", "phi4cli.entry"}
    assert imported & heavy == set()


def _streaming(model: Path, on_stdin: bool = False) -> subprocess.Popen[bytes]:
    """A long answer from the thin client, piped, once its first bytes are out (the question
    given, or on stdin)."""
    question = "-" if on_stdin else "Count."
    process = subprocess.Popen([PHI4, "solve", question, "-m", str(model), "-n", "6000",
                                "-t", "1", "--seed", "3"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(b"Count.\n" if on_stdin else b"")
    process.stdin.close()
    process.stdin = None  # (given: communicate has nothing more to send)
    assert process.stdout.read(1), "nothing was written"
    return process


@pytest.mark.daemon
@pytest.mark.parametrize("on_stdin", [False, True], ids=["argument", "stdin"])
def test_ctrl_c_stops_a_command_the_daemon_runs_as_it_stops_the_full_client(
    warm: Path, on_stdin: bool
):
    before = _commands()
    process = _streaming(warm, on_stdin)
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == ExitStatus.INTERRUPTED
    assert err.decode().endswith("phi4: stopped (Ctrl-C): the answer above is unfinished\n\n")
    assert _commands()["served"] == before["served"] + 1
    _settles()


def _settles() -> None:
    """The daemon is left with no request and no command running (within a few decode steps)."""
    deadline = time.monotonic() + 30
    while (status := _status())["requests_active"] or status["commands"]["active"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


@pytest.mark.daemon
def test_a_client_that_goes_away_stops_what_the_daemon_runs_for_it(warm: Path):
    process = _streaming(warm)
    process.kill()
    process.wait()
    _settles()
    # And the daemon goes on serving.
    result = _run([PHI4], "solve", "What?", "-m", str(warm), "-n", "4", "-t", "0")
    assert result.returncode == 0, result.stderr


@pytest.mark.daemon
@pytest.mark.parametrize("quiet", [[], ["--json"], ["-a"]], ids=["streamed", "json", "answer"])
def test_a_daemon_stopped_mid_answer_ends_its_command_as_the_full_clients(
    warm: Path, quiet: list[str]
):
    # As the full client: the partial answer's line ended, the error said, exit 3, and no
    # daemon started again behind the `phi4 stop` (a --json answer had written nothing yet).
    process = subprocess.Popen([PHI4, "solve", "Count.", "-m", str(warm), "-n", "6000", "-t", "1",
                                "--seed", "3", *quiet], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 30
    while not _status()["requests_active"]:
        assert time.monotonic() < deadline, "it never ran"
        time.sleep(0.02)
    assert run_phi4("stop").returncode == 0
    out, err = process.communicate(timeout=60)
    assert process.returncode == ExitStatus.DAEMON_UNAVAILABLE, err
    assert err.decode().endswith("phi4: error: the daemon is shutting down; the answer was cut "
                                 "short\n"), err  # fmt: skip
    assert out.endswith(b"\n") if not quiet else out == b""
    assert run_phi4("status").returncode == 3, "a daemon was started again"


@pytest.mark.daemon
def test_a_daemon_killed_mid_answer_ends_the_answers_line_and_says_it_is_cut(warm: Path):
    # Before: the error line came straight after the answer's last character, on its line
    # where stdout and stderr meet (2>&1), and did not say the answer was cut.
    process = _streaming(warm)  # (its message below is the thin client's own)
    os.kill(_status()["pid"], signal.SIGKILL)
    out, err = process.communicate(timeout=60)
    assert process.returncode == ExitStatus.DAEMON_UNAVAILABLE, err
    assert out.endswith(b"\n")
    assert err.decode() == ("phi4: error: the daemon went away mid-answer; the answer above is "
                            "unfinished (run the command again)\n")  # fmt: skip


@pytest.mark.daemon
def test_a_reader_that_goes_away_ends_the_command_quietly(warm: Path):
    process = _streaming(warm)
    assert process.stdout is not None
    process.stdout.close()
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 0
    assert err == b""


@pytest.mark.parametrize("name", ["PHI4_HOME", "HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR",
                                  "TMPDIR"])  # fmt: skip
def test_a_relative_directory_from_another_working_directory_is_left_to_the_client(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    # The same relative value names another directory from the client's working directory than
    # from the daemon's: the command is the full client's, which reads it where the user is.
    from phi4cli import __version__
    from phi4cli.client import served
    from phi4cli.core.paths import install_id
    from phi4cli.core.rendezvous import environment

    monkeypatch.setenv(name, "relative/dir")
    socket = tmp_path / "daemon.sock"
    socket.touch()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    params = {"argv": ["solve", "What?"], "env": environment(os.environ), "socket": str(socket),
              "version": __version__, "install": install_id()}  # fmt: skip
    assert served.why_declined({**params, "cwd": str(elsewhere)}, str(socket)) == (
        f"a relative {name}"
    )
    here = served.why_declined({**params, "cwd": os.getcwd()}, str(socket))
    assert here != f"a relative {name}", "from the daemon's own directory it is the same one"
