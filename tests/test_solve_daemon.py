"""End to end: the installed ``phi4`` command against a real daemon subprocess, real llama.cpp."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import PHI4, holding_daemon_lock, run_phi4

# Each test runs phi4 as a process (the command, its daemon or a server).
pytestmark = pytest.mark.daemon


def status(home: Path) -> dict[str, object]:
    result = run_phi4("status", "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def wait_for(predicate: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def solve_args(model: Path, *extra: str) -> list[str]:
    return ["solve", "What is 12*13?", "--model", str(model), "--temperature", "0", *extra]


def test_cold_solve_starts_daemon_then_warm_solve_reuses_it(tiny_model: Path, phi4_home: Path):
    cold = run_phi4(*solve_args(tiny_model, "--max-tokens", "16", "--verbose"))
    assert cold.returncode == 0, cold.stderr
    assert "starting the phi4 daemon" in cold.stderr
    assert cold.stdout.strip(), "the answer streams to stdout"
    first = status(phi4_home)
    assert first["state"] == "ready"
    assert first["model"] == str(tiny_model)

    warm = run_phi4(*solve_args(tiny_model, "--max-tokens", "16", "--verbose"))
    assert warm.returncode == 0, warm.stderr
    assert "starting" not in warm.stderr
    assert "loading" not in warm.stderr
    # Greedy decoding of the same question gives the same answer from the cached prefix.
    assert warm.stdout == cold.stdout
    second = status(phi4_home)
    assert second["pid"] == first["pid"]
    assert second["requests_served"] == 2


def test_second_solve_reports_cached_system_prompt_tokens(tiny_model: Path):
    first = run_phi4(*solve_args(tiny_model, "-n", "4", "-v"))
    second = run_phi4("solve", "Another question entirely", "-m", str(tiny_model), "-n", "4", "-v")
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    cached = [
        int(line.split("(")[1].split()[0])
        for line in second.stderr.splitlines()
        if line.startswith("prompt tokens:")
    ]
    # The system prompt (and `<|user|>`) came from the KV cache, not from a new evaluation.
    assert cached and cached[0] > 10, second.stderr


def test_status_reports_state_model_pid_memory_and_idle(tiny_model: Path):
    assert run_phi4(*solve_args(tiny_model, "-n", "2", "--keep-alive", "10m")).returncode == 0
    text = run_phi4("status")
    assert text.returncode == 0
    for label in ("state", "model", "pid", "uptime", "memory", "requests", "idle"):
        assert any(line.startswith(label) for line in text.stdout.splitlines()), text.stdout
    data = json.loads(run_phi4("daemon", "status", "--json").stdout)
    assert data["state"] == "ready"
    assert data["rss_bytes"] > 0
    assert data["keep_alive_s"] == 600
    assert 0 < data["keep_alive_left_s"] <= 600


def test_status_without_daemon_exits_3():
    result = run_phi4("status")
    assert result.returncode == 3
    assert "no daemon is running" in result.stderr


def test_daemon_start_stop_and_stop_shortcut(tiny_model: Path, phi4_home: Path):
    started = run_phi4("daemon", "start", "--model", str(tiny_model))
    assert started.returncode == 0, started.stderr
    assert "daemon ready" in started.stdout
    pid = int(status(phi4_home)["pid"])  # type: ignore[call-overload]
    stopped = run_phi4("stop")
    assert stopped.returncode == 0
    assert f"pid {pid}" in stopped.stdout
    assert not pid_alive(pid)
    assert not (phi4_home / "run" / "daemon.sock").exists()
    assert not (phi4_home / "run" / "daemon.json").exists()
    again = run_phi4("daemon", "stop")
    assert again.returncode == 0 and "no daemon" in again.stdout


def test_keep_alive_expiry_exits_and_removes_socket(tiny_model: Path, phi4_home: Path):
    assert run_phi4(*solve_args(tiny_model, "-n", "2", "--keep-alive", "1s")).returncode == 0
    sock = phi4_home / "run" / "daemon.sock"
    assert sock.exists()
    wait_for(lambda: not sock.exists(), timeout=15)
    assert not (phi4_home / "run" / "daemon.json").exists()
    assert run_phi4("status").returncode == 3


def test_stale_socket_after_sigkill_is_cleaned_and_replaced(tiny_model: Path, phi4_home: Path):
    assert run_phi4(*solve_args(tiny_model, "-n", "2")).returncode == 0
    old_pid = int(status(phi4_home)["pid"])  # type: ignore[call-overload]
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(old_pid))
    assert (phi4_home / "run" / "daemon.sock").exists(), "SIGKILL leaves the socket behind"
    result = run_phi4(*solve_args(tiny_model, "-n", "2"))
    assert result.returncode == 0, result.stderr
    assert "no longer running" in result.stderr
    assert int(status(phi4_home)["pid"]) != old_pid  # type: ignore[call-overload]


def test_two_concurrent_first_calls_start_one_daemon(tiny_model: Path, phi4_home: Path):
    procs = [
        subprocess.Popen(
            [PHI4, *solve_args(tiny_model, "-n", "4")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    log = (phi4_home / "state" / "daemon.log").read_text()
    assert log.count("listening on") == 1, log
    assert status(phi4_home)["requests_served"] == 2


def _start_long_solve(model: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [PHI4, "solve", "Count forever", "-m", str(model), "-n", "90000", "--n-ctx", "100000"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.read(1), "the answer starts streaming"
    return proc


def test_sigterm_mid_generation_stops_cleanly(tiny_model: Path, phi4_home: Path):
    proc = _start_long_solve(tiny_model)
    pid = int(status(phi4_home)["pid"])  # type: ignore[call-overload]
    os.kill(pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3
    assert b"shutting down" in err
    wait_for(lambda: not pid_alive(pid))
    assert not (phi4_home / "run" / "daemon.sock").exists()
    assert not (phi4_home / "run" / "daemon.json").exists()


def test_stop_command_mid_generation(tiny_model: Path, phi4_home: Path):
    proc = _start_long_solve(tiny_model)
    stopped = run_phi4("stop")
    assert stopped.returncode == 0, stopped.stderr
    proc.communicate(timeout=30)
    assert proc.returncode == 3
    assert not (phi4_home / "run" / "daemon.sock").exists()


def test_ctrl_c_exits_130_and_cancels_the_generation(tiny_model: Path, phi4_home: Path):
    proc = _start_long_solve(tiny_model)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert b"Traceback" not in err
    # The daemon noticed the hang-up and freed the engine for the next client.
    wait_for(lambda: status(phi4_home)["requests_active"] == 0, timeout=5)
    follow_up = run_phi4(*solve_args(tiny_model, "-n", "2"), timeout=30)
    assert follow_up.returncode == 0


def test_closed_stdout_pipe_is_not_a_traceback(tiny_model: Path, phi4_home: Path):
    pipeline = subprocess.run(
        [
            "bash",
            "-c",
            f'"{PHI4}" solve "Count forever" -m "{tiny_model}" -n 90000 --n-ctx 100000 '
            '</dev/null | head -c 5; echo "rc=${PIPESTATUS[0]}" >&2',
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert len(pipeline.stdout) == 5
    assert "Traceback" not in pipeline.stderr
    assert "rc=0" in pipeline.stderr
    wait_for(lambda: status(phi4_home)["requests_active"] == 0, timeout=5)


def test_client_path_never_imports_llama_cpp_numpy_or_hub(tiny_model: Path):
    code = (
        "import sys\n"
        "from phi4cli.client.cli import main\n"
        "try:\n"
        f"    main(['solve', 'What is 1+1?', '-m', {str(tiny_model)!r}, '-n', '2'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "heavy = ('llama_cpp', 'numpy', 'huggingface_hub', 'gguf')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run(
        [os.path.join(os.path.dirname(PHI4), "python"), "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr


def test_smollm2_greedy_answers_two_plus_two(smollm2_model: Path):
    # Sized to what the model writes: without the step-by-step instruction SmolLM2's greedy
    # answer is one sentence ("The answer to this classic math problem is 4.", 12 tokens); with
    # it, 48 tokens were once cut before the 4.
    result = run_phi4(
        "solve",
        "What is 2+2?",
        "-m",
        "smollm2-135m",
        "-t",
        "0",
        "-n",
        "64",
        "--no-instruction",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["stats"]["finish_reason"] == "stop", "the answer ended by itself, not cut"
    assert "4" in record["solution"]


def test_model_switch_between_requests(tiny_model: Path, smollm2_model: Path, phi4_home: Path):
    assert run_phi4(*solve_args(tiny_model, "-n", "2")).returncode == 0
    switched = run_phi4("solve", "Hi", "-m", str(smollm2_model), "-n", "2")
    assert switched.returncode == 0
    assert "loading" in switched.stderr
    assert status(phi4_home)["model"] == str(smollm2_model)


@pytest.mark.parametrize("keep_alive", ["forever", "abc"])
def test_bad_keep_alive_is_a_usage_error(tiny_model: Path, keep_alive: str):
    result = run_phi4(*solve_args(tiny_model, "--keep-alive", keep_alive))
    assert result.returncode == 2
    assert "keep_alive" in result.stderr and "30m" in result.stderr


def test_socket_and_runtime_dir_are_private(tiny_model: Path, phi4_home: Path):
    assert run_phi4(*solve_args(tiny_model, "-n", "1")).returncode == 0
    assert (phi4_home / "run").stat().st_mode & 0o777 == 0o700
    assert (phi4_home / "run" / "daemon.sock").stat().st_mode & 0o777 == 0o600


def test_empty_question_is_rejected_by_cli(tiny_model: Path):
    result = run_phi4("solve", "   ", "-m", str(tiny_model))
    assert result.returncode == 2
    assert "empty" in result.stderr


def test_question_from_stdin_only_when_asked(tiny_model: Path, tmp_path: Path):
    dash = run_phi4(
        "solve", "-", "-m", str(tiny_model), "-n", "3", "-t", "0", input="What is 12*13?"
    )
    assert dash.returncode == 0, dash.stderr
    arg = run_phi4(*solve_args(tiny_model, "-n", "3"))
    assert dash.stdout == arg.stdout
    # Before, the first run of a shell loop read the loop's stdin and added it to its question.
    questions = tmp_path / "q.txt"
    questions.write_text("What is 1+1?\nWhat is 2+2?\nWhat is 3+3?\n")
    loop = subprocess.run(
        [
            "bash",
            "-c",
            f'while read -r q; do {PHI4} solve "$q" -m {tiny_model} -n 2 --json '
            f"| {sys.executable} -c 'import json, sys; "
            f'print(json.dumps(json.load(sys.stdin)["question"]))\'; '
            f"done < {questions}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert loop.stdout.splitlines() == ['"What is 1+1?"', '"What is 2+2?"', '"What is 3+3?"']
    # Before, this waited for the end of input, though the question is an argument.
    with subprocess.Popen(
        [PHI4, *solve_args(tiny_model, "-n", "2")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as never_closed:
        assert never_closed.stdout is not None
        assert never_closed.wait(timeout=30) == 0
        assert never_closed.stdout.read()
        assert never_closed.stdin is not None
        never_closed.stdin.close()


def _connect(phi4_home: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(phi4_home / "run" / "daemon.sock"))
    sock.settimeout(30)
    return sock


def _roundtrip(phi4_home: Path, payload: bytes) -> dict[str, object]:
    with _connect(phi4_home) as sock:
        sock.sendall(payload)
        reader = sock.makefile("rb")
        line = reader.readline()
    assert line, "the daemon answers before closing"
    event: dict[str, object] = json.loads(line)
    return event


@pytest.mark.parametrize(
    ("payload", "code", "phrase"),
    [
        (b"this is not json\n", "bad_request", "malformed JSON"),
        (b'["a list"]\n', "bad_request", "JSON object"),
        (b'{"v": 1, "id": 1, "op": "explode"}\n', "bad_request", "unknown op"),
        (b'{"v": 99, "id": 1, "op": "solve"}\n', "unsupported_version", "version 99"),
        (b'{"v": 1, "op": "solve"}\n', "bad_request", "'id'"),
        (b'{"v": 1, "id": 1, "op": "solve", "params": {"prompt": "  "}}\n', "bad_request", "empty"),
        (b'{"v": 1, "id": 1, "op": "solve", "params": {}}\n', "bad_request", "'prompt'"),
        (
            b'{"v": 1, "id": 1, "op": "solve", "params": {"prompt": "x", "temperature": "hot"}}\n',
            "bad_request",
            "temperature",
        ),
        (b"x" * (1 << 20) + b"x\n", "bad_request", "longer than"),
    ],
    ids=[
        "malformed",
        "not-object",
        "unknown-op",
        "wrong-version",
        "no-id",
        "empty-question",
        "no-prompt",
        "bad-temperature",
        "over-long",
    ],
)
def test_bad_requests_get_an_error_and_the_daemon_serves_the_next_client(
    tiny_model: Path, phi4_home: Path, payload: bytes, code: str, phrase: str
):
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    event = _roundtrip(phi4_home, payload)
    assert event["event"] == "error"
    assert event["code"] == code
    assert phrase in str(event["message"])
    assert event["retryable"] is False
    after = run_phi4(*solve_args(tiny_model, "-n", "2"))
    assert after.returncode == 0, after.stderr


def test_pipelined_requests_on_one_connection_each_end_once(tiny_model: Path, phi4_home: Path):
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    requests = b"".join(
        json.dumps({"v": 1, "id": i, "op": op, "params": params}).encode() + b"\n"
        for i, op, params in [
            (1, "ping", {}),
            (2, "solve", {"prompt": "2+2?", "max_tokens": 3, "temperature": 0}),
            (3, "status", {}),
        ]
    )
    terminal: dict[int, list[str]] = {1: [], 2: [], 3: []}
    with _connect(phi4_home) as sock:
        sock.sendall(requests)
        reader = sock.makefile("rb")
        while any(not events for events in terminal.values()):
            event = json.loads(reader.readline())
            if event["event"] in ("done", "error"):
                terminal[event["id"]].append(event["event"])
    assert terminal == {1: ["done"], 2: ["done"], 3: ["done"]}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_another_uid_is_refused_even_if_the_socket_is_reachable(tiny_model: Path, phi4_home: Path):
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    # Loosen the filesystem guard on purpose, so only the SO_PEERCRED check stands in the way.
    os.chmod(phi4_home, 0o755)
    os.chmod(phi4_home / "run", 0o755)
    os.chmod(phi4_home / "run" / "daemon.sock", 0o666)
    # A fresh interpreter any user may run (the venv's may live under /root), as uid 65534.
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    client = (
        "import socket, sys\n"
        "sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "sock.connect(sys.argv[1])\n"
        "try:\n"
        '    sock.sendall(b\'{"v": 1, "id": 1, "op": "status"}\\n\')\n'
        "except BrokenPipeError:\n"  # the daemon may refuse and hang up before we write
        "    pass\n"
        "sys.stdout.write(sock.makefile('rb').readline().decode())\n"
    )
    connected = subprocess.run(
        [python, "-c", client, str(phi4_home / "run" / "daemon.sock")],
        user=65534,
        group=65534,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert connected.stdout, connected.stderr
    event = json.loads(connected.stdout)
    assert event["event"] == "error" and event["code"] == "forbidden", event
    assert run_phi4("status").returncode == 0, "the daemon keeps serving its owner"


FAKE_OLD_DAEMON = r"""
import fcntl, json, os, socket, sys
run = sys.argv[-1]
lock = os.open(os.path.join(run, "daemon.lock"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(lock, fcntl.LOCK_EX)
path = os.path.join(run, "daemon.sock")
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen()
with open(os.path.join(run, "daemon.json"), "w") as f:
    json.dump({"pid": os.getpid(), "socket": path, "protocol": 0, "state": "ready",
               "model": None, "started_at": 0}, f)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    line = conn.makefile("rb").readline()
    request_id = json.loads(line).get("id") if line.strip() else None
    conn.sendall(json.dumps({"v": 0, "id": request_id, "event": "error",
        "code": "unsupported_version", "message": "this daemon speaks protocol 0",
        "retryable": False}).encode() + b"\n")
    conn.close()
"""


def test_daemon_of_another_protocol_version_is_restarted_once(tiny_model: Path, phi4_home: Path):
    run_dir = phi4_home / "run"
    run_dir.mkdir(mode=0o700)
    old = subprocess.Popen(
        # Named as a daemon is ("python -m phi4cli daemon run"), as /proc shows it to `phi4 stop`.
        [sys.executable, "-c", FAKE_OLD_DAEMON, "phi4cli", "daemon", "run", str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert old.stdout is not None and old.stdout.readline().strip() == "ready"
    result = run_phi4(*solve_args(tiny_model, "-n", "2"))
    assert result.returncode == 0, result.stderr
    assert "another protocol version; restarting" in result.stderr
    assert old.wait(timeout=10) == -signal.SIGTERM
    assert status(phi4_home)["protocol"] == 1


def test_daemon_from_another_install_is_replaced_like_dmypy(
    tiny_model: Path, phi4_home: Path, tmp_path: Path
):
    # Before: a daemon left running from another install was used as long as the protocol
    # number matched. A copy of the package elsewhere on PYTHONPATH is another install.
    import phi4cli

    other = tmp_path / "other-install"
    shutil.copytree(Path(phi4cli.__file__).parent, other / "phi4cli")
    env = {"PYTHONPATH": str(other)}
    started = run_phi4("daemon", "start", "-m", str(tiny_model), env=env)
    assert started.returncode == 0, started.stderr
    first = status(phi4_home)
    assert run_phi4("solve", "x", "-m", str(tiny_model), "-n", "1", env=env).returncode == 0
    assert status(phi4_home)["pid"] == first["pid"], "the same install keeps its daemon"
    result = run_phi4(*solve_args(tiny_model, "-n", "2"))
    assert result.returncode == 0, result.stderr
    assert f"the running daemon is from another install of phi4 ({other / 'phi4cli'})" in (
        result.stderr
    )
    assert status(phi4_home)["pid"] != first["pid"]


def test_daemon_run_in_foreground_serves_and_stops_on_ctrl_c(tiny_model: Path, phi4_home: Path):
    daemon = subprocess.Popen(
        [PHI4, "daemon", "run", "--model", str(tiny_model), "--keep-alive", "-1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (phi4_home / "run" / "daemon.sock").exists())
        result = run_phi4(*solve_args(tiny_model, "-n", "2"))
        assert result.returncode == 0, result.stderr
        assert "starting" not in result.stderr, "the client used the foreground daemon"
        shown = run_phi4("status").stdout
        assert "keep_alive forever" in shown
        daemon.send_signal(signal.SIGINT)
        output, _ = daemon.communicate(timeout=20)
    finally:
        daemon.kill()
    assert daemon.returncode == 0
    assert "listening on" in output and "stopped" in output
    assert not (phi4_home / "run" / "daemon.sock").exists()


def test_second_daemon_run_refuses_while_one_runs(tiny_model: Path):
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    second = run_phi4("daemon", "run", "-m", str(tiny_model), timeout=30)
    assert second.returncode == 3
    assert "already running" in second.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    "payload",
    [
        b'{"v": 1, "id": 1, "op": "solve", "params": {"prompt": "x", "priority": []}}\n',
        b'{"v": 1, "id": 1, "op": "cancel", "params": {"target": []}}\n',
    ],
    ids=["unhashable-priority", "unhashable-cancel-target"],
)
def test_odd_param_types_are_refused_and_the_connection_lives(
    tiny_model: Path, phi4_home: Path, payload: bytes
):
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    with _connect(phi4_home) as sock:
        sock.sendall(payload + b'{"v": 1, "id": 2, "op": "ping"}\n')
        reader = sock.makefile("rb")
        first, second = json.loads(reader.readline()), json.loads(reader.readline())
    assert first["event"] == "error" and first["code"] == "bad_request"
    assert second["id"] == 2 and second["event"] == "done"


def test_daemon_start_with_another_model_switches_the_running_daemon(
    tiny_model: Path, smollm2_model: Path, phi4_home: Path
):
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    pid = status(phi4_home)["pid"]
    switched = run_phi4("daemon", "start", "-m", str(smollm2_model), "--n-ctx", "512")
    assert switched.returncode == 0, switched.stderr
    assert "the running daemon keeps the settings it started with: n_ctx auto (yours 512)" in (
        switched.stderr
    )
    now = status(phi4_home)
    assert now["pid"] == pid and now["model"] == str(smollm2_model)


def test_a_daemon_started_with_other_settings_is_used_and_says_so(
    tiny_model: Path, phi4_home: Path
):
    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "1024").returncode == 0
    pid = status(phi4_home)["pid"]
    config = phi4_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('n_ctx = 2048\nkv_cache_type = "q8_0"\n')
    result = run_phi4(*solve_args(tiny_model, "-n", "2"))
    assert result.returncode == 0, result.stderr
    assert (
        "the running daemon keeps the settings it started with: n_ctx 1024 (yours 2048), "
        "kv_cache_type f16 (yours q8_0); `phi4 stop` first to change them"
    ) in result.stderr
    assert status(phi4_home)["pid"] == pid, "not restarted under other clients' feet"
    config.write_text("n_ctx = 1024\n")
    quiet = run_phi4(*solve_args(tiny_model, "-n", "2"))
    assert "keeps the settings" not in quiet.stderr
    # Settings left at their defaults ask for nothing: the daemon's own choice stands.
    config.unlink()
    assert run_phi4("stop").returncode == 0
    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "512").returncode == 0
    assert "keeps the settings" not in run_phi4(*solve_args(tiny_model, "-n", "2")).stderr


def test_phi4_stop_during_a_file_loses_no_problem(
    tiny_model: Path, phi4_home: Path, tmp_path: Path
):
    # Before: 4 records came out of 40, the rest got nothing, "the daemon stopped twice": the
    # retry on a fresh daemon never sent anything.
    assert (
        run_phi4(
            "daemon", "start", "-m", str(tiny_model), "--parallel", "1", "--n-ctx", "1024"
        ).returncode
        == 0
    )
    problems = tmp_path / "p.txt"
    problems.write_text("".join(f"Problem {i}: count.\n" for i in range(12)))
    proc = subprocess.Popen(
        [
            PHI4,
            "solve",
            "-f",
            str(problems),
            "--jsonl",
            "-m",
            str(tiny_model),
            "-n",
            "300",
            "-t",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # one answered: the others are running or queued
    assert run_phi4("stop").returncode == 0
    rest, err = proc.communicate(timeout=120)
    records = [json.loads(line) for line in [first, *rest.splitlines()]]
    assert [r["line"] for r in records] == list(range(1, 13)), err
    cut = [r for r in records if "error" in r]
    assert all(r["error"]["code"] == "shutting_down" for r in cut)
    assert len(cut) <= 8, "only those running when it stopped are cut short"
    assert sum(1 for r in records if r["solution"] and "error" not in r) >= 4
    assert "the daemon was shutting down; starting a fresh one" in err
    assert proc.returncode == (1 if cut else 0)
    assert "stopped twice" not in err


def test_a_queued_solve_survives_phi4_stop(tiny_model: Path, phi4_home: Path):
    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "4096").returncode == 0
    long = subprocess.Popen(
        [PHI4, "solve", "Count.", "-m", str(tiny_model), "-n", "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert long.stdout is not None
    long.stdout.read(1)  # it is answering, and its reservation leaves no room for the next
    queued = subprocess.Popen(
        [PHI4, "solve", "Wait.", "-m", str(tiny_model), "-n", "1500", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not (json.loads(run_phi4("status", "--json").stdout).get("waiting")):
        assert time.monotonic() < deadline, "the second solve never queued"
        time.sleep(0.05)
    assert run_phi4("stop").returncode == 0
    # Upper bounds for a hang only: the fresh daemon writes 1,500 tokens, minutes at load 10.
    out, err = queued.communicate(timeout=600)
    long.communicate(timeout=600)
    assert queued.returncode == 0, err
    assert json.loads(out)["stats"]["completion_tokens"] > 0


def test_a_frozen_daemon_is_reported_and_stop_kills_it(tiny_model: Path, phi4_home: Path):
    # Before: solve, status and stop all hung forever on a daemon stopped with SIGSTOP.
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    pid = int(status(phi4_home)["pid"])  # type: ignore[call-overload]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        checks = [
            subprocess.Popen(
                [PHI4, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            for args in (["status"], solve_args(tiny_model, "-n", "2"))
        ]
        for check in checks:
            _out, err = check.communicate(timeout=60)
            assert check.returncode == 3, err
            assert "not answering" in err and "`phi4 stop` ends it" in err, err
        assert time.monotonic() - started < 40
        stopped = run_phi4("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert f"the daemon (pid {pid}) did not exit; killing it" in stopped.stderr
        assert run_phi4("status").returncode == 3, "gone"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_stop_signals_no_process_named_by_a_planted_status_file(phi4_home: Path):
    # Before: with the daemon lock held and no socket answering, the pid in daemon.json got
    # SIGTERM, whatever process it named.
    victim = subprocess.Popen(["sleep", "60"])
    run = phi4_home / "run"
    try:
        with holding_daemon_lock(run):
            (run / "daemon.json").write_text(
                json.dumps(
                    {
                        "pid": victim.pid,
                        "socket": str(run / "daemon.sock"),
                        "protocol": 1,
                        "state": "ready",
                        "model": None,
                        "started_at": 0,
                    }
                )
            )
            result = run_phi4("stop")
            assert result.returncode == 3
            assert f"pid {victim.pid} in {run / 'daemon.json'} is not a phi4 daemon" in (
                result.stderr
            )
            assert victim.poll() is None, "the planted pid was signalled"
    finally:
        victim.kill()
        victim.wait()


FORGER = r"""
import json, os, socket, sys
os.setgid(65534); os.setuid(65534)  # another local user
path, log = sys.argv[1], sys.argv[2]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen()
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    line = conn.makefile("rb").readline()
    with open(log, "ab") as f:
        f.write(line)
    request_id = json.loads(line).get("id") if line.strip() else None
    for event in ({"event": "token", "text": "forged"}, {"event": "done"}):
        conn.sendall(json.dumps({"v": 1, "id": request_id, **event}).encode() + b"\n")
    conn.close()
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user")
@pytest.mark.parametrize("owner", ["attacker", "victim"])
def test_another_users_socket_gets_no_question(tiny_model: Path, tmp_path: Path, owner: str):
    # Before: with no XDG_RUNTIME_DIR the runtime dir is /tmp/phi4-<uid>; another user who made it
    # first, with a socket of theirs in it, received the prompts and returned forged answers.
    home = Path(tempfile.mkdtemp(prefix="phi4-victim-", dir="/tmp"))
    home.chmod(0o755)
    run = home / "run"
    run.mkdir()
    run.chmod(0o777)  # for the other user's socket to be made in it
    log = home / "received"
    log.touch(mode=0o666)
    log.chmod(0o666)
    if owner == "attacker":
        os.chown(run, 65534, 65534)  # the attacker made the directory
    forger = subprocess.Popen(
        [sys.executable, "-c", FORGER, str(run / "daemon.sock"), str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert forger.stdout is not None and forger.stdout.readline().strip() == "listening"
        if owner == "victim":
            run.chmod(0o700)  # ours, private: only the socket in it is the attacker's
        result = run_phi4(
            "solve", "my secret question", "-m", str(tiny_model), env={"PHI4_HOME": str(home)}
        )
        assert result.returncode == 3, result.stderr
        assert "forged" not in result.stdout
        expected = "is not a directory of yours" if owner == "attacker" else "another user's"
        assert expected in result.stderr, result.stderr
        assert log.read_bytes() == b"", "the question reached the other user"
    finally:
        forger.kill()
        forger.wait()
        shutil.rmtree(home, ignore_errors=True)


def test_eval_through_the_daemon_resumes_after_an_interruption(tiny_model: Path, tmp_path: Path):
    problems = tmp_path / "set.jsonl"
    problems.write_text(
        "".join(
            json.dumps({"problem": f"Count to {n}.", "answer": str(n)}) + "\n" for n in range(1, 7)
        )
    )
    results = tmp_path / "out.jsonl"
    args = [PHI4, "eval", str(problems), "-m", str(tiny_model), "-n", "400", "-o", str(results)]
    assert (
        run_phi4(
            "daemon", "start", "-m", str(tiny_model), "--parallel", "1", "--n-ctx", "1024"
        ).returncode
        == 0
    )
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not results.exists() or not results.read_text().strip():
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.02)
    first.send_signal(signal.SIGINT)
    _out, err = first.communicate(timeout=30)
    assert first.returncode == 130
    assert f"interrupted: what was finished is in {results}" in err
    kept = len(results.read_text().splitlines())
    assert 1 <= kept < 6
    second = run_phi4(*args[1:])
    assert second.returncode == 0, second.stderr
    assert f"resuming: {kept} of 6 problems are already in {results}" in second.stderr
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(r["line"] for r in records) == [1, 2, 3, 4, 5, 6]
    table = dict(line.split(None, 1) for line in second.stdout.splitlines())
    assert table["problems"] == "6"


@pytest.mark.smollm2
def test_eval_with_smollm2_prints_the_table(smollm2_model: Path, tmp_path: Path):
    problems = tmp_path / "quiz.jsonl"
    problems.write_text(
        '{"problem": "What is 2+2?", "answer": "4"}\n{"problem": "What is 3+5?", "answer": "8"}\n'
    )
    result = run_phi4("eval", str(problems), "-m", str(smollm2_model), "-t", "0", "-n", "64")
    assert result.returncode == 0, result.stderr
    counts = {
        label: int(count)
        for label, count in re.findall(
            r"^(problems|correct|wrong|no answer|truncated|errors) +(\d+)",
            result.stdout,
            re.MULTILINE,
        )
    }
    assert counts["problems"] == 2
    assert sum(counts[k] for k in ("correct", "wrong", "no answer", "truncated", "errors")) == 2
    records = [
        json.loads(line)
        for line in (tmp_path / "quiz.jsonl.results.jsonl").read_text().splitlines()
    ]
    assert sorted(r["line"] for r in records) == [1, 2]
    assert all(r["status"] in ("correct", "wrong", "no_answer", "truncated") for r in records)


def test_a_question_longer_than_the_context_says_shorten_it_even_with_max_tokens(
    tiny_model: Path,
):
    # Before: with -n given, a prompt over the context alone was told "lower --max-tokens",
    # which no value would have fixed.
    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "512").returncode == 0
    question = "add these numbers " + " ".join(str(i) for i in range(2000))
    for extra in ((), ("-n", "10")):
        result = run_phi4("solve", question, "-m", str(tiny_model), *extra)
        assert result.returncode == 1, result.stderr
        assert "shorten it" in result.stderr and "lower --max-tokens" not in result.stderr


@pytest.mark.daemon
def test_a_burst_of_connections_waits_in_the_backlog_and_a_full_one_is_said_without_a_path(
    tiny_model: Path, phi4_home: Path, monkeypatch: pytest.MonkeyPatch
):
    # `phi4 serve` opens a connection for each choice: eight clients asking n=16 make 128 at
    # once. asyncio's backlog of 100 turned the rest away (EAGAIN), and the 503 named the
    # daemon's socket. Held still (SIGSTOP), the daemon accepts none: all wait in its backlog.
    from phi4cli.backends import daemon_link
    from phi4cli.core.errors import DaemonUnavailableError

    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    pid = int(status(phi4_home)["pid"])  # type: ignore[call-overload]
    path = phi4_home / "run" / "daemon.sock"
    waiting: list[socket.socket] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            waiting.append(sock)
            sock.connect(str(path))  # BlockingIOError (EAGAIN) once the backlog is full
        # Past a full backlog (here, a socket of backlog 1 that never accepts), a connection is
        # tried again for a while, then refused in words that name no path.
        jammed = phi4_home / "jammed.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(jammed))
        listener.listen(0)
        for _ in range(4):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            waiting.append(sock)
            with contextlib.suppress(BlockingIOError):
                sock.connect(str(jammed))
        monkeypatch.setattr(daemon_link, "BUSY_CONNECT_S", 0.3)
        with pytest.raises(DaemonUnavailableError) as refused:
            daemon_link.DaemonConnection.open(jammed)
        assert "more connections waiting than it can take" in str(refused.value)
        assert str(phi4_home) not in str(refused.value)
        listener.close()
    finally:
        for sock in waiting:
            sock.close()
        os.kill(pid, signal.SIGCONT)
    assert run_phi4("stop").returncode == 0
