"""`--backend URL`: solve and chat against a real OpenAI-compatible server from another project
(llama-cpp-python's `llama_cpp.server`, on the tiny model), with no phi4 daemon involved."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_phi4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(tiny_model), "--host",
         "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError("llama_cpp.server did not start") from None
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_solve_through_a_remote_server_without_a_daemon(backend: str):
    result = run_phi4("solve", "What is 12*13?", "--backend", backend, "-m", "tiny", "-t", "0",
                      "-n", "8")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "starting the phi4 daemon" not in result.stderr
    assert run_phi4("status").returncode == 3, "no local daemon was started"
    record = json.loads(run_phi4("solve", "2+2?", "--backend", backend, "-m", "tiny", "-n", "4",
                                 "--json").stdout)  # fmt: skip
    assert record["solution"] and record["stats"]["completion_tokens"] == 4
    assert record["stats"]["finish_reason"] == "length"


def test_backend_from_env_and_reasoning_handling(backend: str):
    # A model named as a reasoning model: its text is thinking until </think>, as locally.
    result = run_phi4("solve", "What is 12*13?", "-m", "tiny-reasoning", "-t", "0", "-n", "6",
                      "--answer-only", env={"PHI4_BACKEND": backend})  # fmt: skip
    assert result.returncode == 1
    assert "thinking did not finish" in result.stderr


def test_file_and_chat_through_a_remote_server(backend: str, tmp_path: Path):
    problems = tmp_path / "p.txt"
    problems.write_text("one\ntwo\n")
    batch = run_phi4("solve", "-f", str(problems), "--jsonl", "--backend", backend, "-m", "tiny",
                     "-n", "3")  # fmt: skip
    assert batch.returncode == 0, batch.stderr
    assert [json.loads(line)["line"] for line in batch.stdout.splitlines()] == [1, 2]
    chat = run_phi4("chat", "--backend", backend, "-m", "tiny", "-n", "3",
                    input="hello\nand again\n/save remote\n")  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert "saved as remote" in chat.stdout


def test_unreachable_backend_is_one_line_and_exit_3():
    result = run_phi4("solve", "x", "--backend", "http://127.0.0.1:9/v1", "-m", "tiny")
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("phi4: error: cannot reach the backend http://127.0.0.1:9/v1:")
