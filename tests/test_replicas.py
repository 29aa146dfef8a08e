"""Many problems over remote engines: requests at once, several replicas, and failures that lose
no problem. Scripted servers (tests/scripted_server.py) for each failure, and two real engines
(llama-cpp-python's `llama_cpp.server` on the tiny model), one killed mid-run."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    LLAMA_SERVER,
    PHI4,
    run_phi4,
    start_llama_cpp_server,
    start_llama_server,
)
from tests.scripted_server import Head, Step, chunk, data, never_accepting, scripted_server


def question_of(body: dict[str, Any]) -> str:
    return str(body["messages"][-1]["content"]).split("\n\n")[0]


def doubled(body: dict[str, Any]) -> str:
    """Problem "What is i+i?" has the answer 2i: each line's answer says which line it is."""
    i = int(question_of(body).removeprefix("What is ").split("+")[0])
    return str(2 * i)


def answer_lines(body: dict[str, Any], pieces: int = 3) -> list[str | Step]:
    lines: list[str | Step] = [chunk({"role": "assistant", "content": ""})]
    lines += [chunk({"reasoning_content": f"step {k}. "}) for k in range(pieces)]
    lines += [
        chunk({"content": f"So $\\boxed{{{doubled(body)}}}$."}),
        chunk({}, "stop"),
        data("[DONE]"),
    ]
    return lines


def problems_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "problems.txt"
    path.write_text("".join(f"What is {i}+{i}?\n" for i in range(1, n + 1)))
    return path


def solve_file(urls: list[str], path: Path, *extra: str, **kwargs: Any) -> Any:
    backends = [arg for url in urls for arg in ("--backend", url)]
    return run_phi4(
        "solve",
        "-f",
        str(path),
        *backends,
        "-m",
        "phi4-mini-reasoning",
        "--no-instruction",
        *extra,
        **kwargs,
    )


class Gate:
    """Holds each request until ``size`` are in at once (or ``patience`` passes), and counts
    the most that were: a client that sends one after another never gets past one."""

    def __init__(self, size: int, patience: float = 30.0) -> None:
        self.size, self.patience = size, patience
        self.inside = self.peak = 0
        self.lock = threading.Condition()

    def hold(self) -> None:
        with self.lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
            self.lock.notify_all()
            self.lock.wait_for(lambda: self.peak >= self.size, timeout=self.patience)

    def leave(self) -> None:
        with self.lock:
            self.inside -= 1


def gated(gate: Gate) -> Any:
    def script(body: dict[str, Any]) -> Iterator[str | Step]:
        gate.hold()
        try:
            yield from answer_lines(body)
        finally:
            gate.leave()

    return script


@pytest.mark.daemon
def test_sixteen_problems_are_asked_at_once_and_printed_in_order(tmp_path: Path):
    # Before: sent one after another, so the server never saw two at once. Patient: on a CI
    # machine also running llama.cpp on both cores, 13 were in by the default 30 s.
    gate = Gate(16, patience=300)
    with scripted_server(gated(gate)) as server:
        result = solve_file([server.url], problems_file(tmp_path, 16), "--answer-only")
    assert result.returncode == 0, result.stderr
    assert gate.peak == 16
    assert result.stdout.splitlines() == [str(2 * i) for i in range(1, 17)]


@pytest.mark.daemon
def test_backend_concurrency_bounds_the_requests_at_once(tmp_path: Path):
    gate = Gate(3)
    with scripted_server(gated(gate)) as server:
        result = solve_file(
            [server.url], problems_file(tmp_path, 9), "--answer-only", "--backend-concurrency", "3"
        )
    assert result.returncode == 0, result.stderr
    assert gate.peak == 3
    assert result.stdout.splitlines() == [str(2 * i) for i in range(1, 10)]


@pytest.mark.daemon
def test_backend_concurrency_from_the_environment_and_its_bad_value(tmp_path: Path):
    gate = Gate(2)
    path = problems_file(tmp_path, 4)
    with scripted_server(gated(gate)) as server:
        env = {**os.environ, "PHI4_BACKEND_CONCURRENCY": "2"}
        result = solve_file([server.url], path, "--answer-only", env=env)
        assert result.returncode == 0, result.stderr
        assert gate.peak == 2
        bad = solve_file([server.url], path, env={**os.environ, "PHI4_BACKEND_CONCURRENCY": "0"})
    assert bad.returncode == 2
    assert "PHI4_BACKEND_CONCURRENCY" in bad.stderr and "positive integer" in bad.stderr


@pytest.mark.daemon
def test_two_replicas_share_the_work_and_the_summary_says_how(tmp_path: Path):
    gates = [Gate(4), Gate(4)]
    with scripted_server(gated(gates[0])) as a, scripted_server(gated(gates[1])) as b:
        result = solve_file(
            [a.url, b.url],
            problems_file(tmp_path, 16),
            "--answer-only",
            "--backend-concurrency",
            "4",
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [str(2 * i) for i in range(1, 17)]
        assert len(a.bodies) + len(b.bodies) == 16, "each problem asked once"
        assert a.bodies and b.bodies
    assert gates[0].peak == 4 and gates[1].peak == 4
    assert f"replicas: {a.url} answered {len(a.bodies)}" in result.stderr
    assert f"{b.url} answered {len(b.bodies)}" in result.stderr


@pytest.mark.daemon
def test_replicas_from_the_config_file(tmp_path: Path, phi4_home: Path):
    with scripted_server(answer_lines) as a, scripted_server(answer_lines) as b:
        config = phi4_home / "config" / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(f'backends = ["{a.url}", "{b.url}"]\nbackend_concurrency = 2\n')
        result = run_phi4(
            "solve", "-f", str(problems_file(tmp_path, 8)), "-a", "-m", "phi4-mini-reasoning"
        )
        assert result.returncode == 0, result.stderr
        assert len(a.bodies) + len(b.bodies) == 8 and a.bodies and b.bodies


@pytest.mark.daemon
def test_a_replica_that_refuses_connections_costs_nothing(tmp_path: Path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"  # nothing listens there
    with scripted_server(answer_lines) as good:
        result = solve_file([dead, good.url], problems_file(tmp_path, 10), "--jsonl")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == list(range(1, 11))
    assert [r["answer"] for r in records] == [str(2 * i) for i in range(1, 11)]
    assert len(good.bodies) == 10
    assert f"{dead} answered 0" in result.stderr and "(dead)" in result.stderr


@pytest.mark.daemon
def test_a_replica_that_never_takes_the_connection_costs_its_timeout_once(tmp_path: Path):
    with never_accepting(backlog_full=True) as stuck, scripted_server(answer_lines) as good:
        env = {**os.environ, "PHI4_BACKEND_TIMEOUT": "2s"}
        result = solve_file([stuck, good.url], problems_file(tmp_path, 6), "--answer-only", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(2 * i) for i in range(1, 7)]


@pytest.mark.daemon
def test_every_replica_unreachable_is_one_line_and_exit_3(tmp_path: Path):
    ports = []
    for _ in range(2):
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            ports.append(closed.getsockname()[1])
    urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
    result = solve_file(urls, problems_file(tmp_path, 5), "--answer-only")
    assert result.returncode == 3
    assert result.stderr.count("cannot reach the backend") == 1, result.stderr
    assert result.stdout == ""


@pytest.mark.daemon
def test_a_stream_cut_mid_answer_is_asked_again_and_printed_once(tmp_path: Path):
    cut = {"done": False}
    lock = threading.Lock()

    def first_one_cut(body: dict[str, Any]) -> Iterator[str | Step]:
        with lock:
            cut_this = doubled(body) == "6" and not cut["done"]
            cut["done"] = cut["done"] or cut_this
        lines = answer_lines(body)
        if cut_this:
            yield from lines[:3]
            yield Step(drop=True)
            return
        yield from lines

    with scripted_server(first_one_cut) as a, scripted_server(first_one_cut) as b:
        result = solve_file([a.url, b.url], problems_file(tmp_path, 6), "--jsonl")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["answer"] for r in records] == [str(2 * i) for i in range(1, 7)]
    third = records[2]
    assert third["reasoning"].count("step 0.") == 1, "the cut attempt's text is gone"
    assert len(a.bodies) + len(b.bodies) == 7, "one problem asked twice, the rest once"


@pytest.mark.daemon
def test_a_stream_cut_mid_answer_of_one_question_is_not_shown_twice():
    # One question streams to the screen: what it showed cannot be taken back, so a cut is
    # its error, as before (exit 5), not a second answer after the first half.
    def cut(body: dict[str, Any]) -> Iterator[str | Step]:
        yield from [chunk({"content": "So far"}), Step(drop=True)]

    with scripted_server(cut) as a, scripted_server(answer_lines) as b:
        result = run_phi4(
            "solve", "What is 1+1?", "--backend", a.url, "--backend", b.url, "-m", "phi4-mini"
        )
    assert result.returncode == 5
    assert "the backend closed the stream before the answer was complete" in result.stderr
    assert result.stdout.count("So far") <= 1 and "\\boxed" not in result.stdout


@pytest.mark.daemon
def test_429_and_503_slow_the_client_and_every_problem_is_answered(tmp_path: Path):
    refused = {"429": 0, "503": 0}
    lock = threading.Lock()

    def busy_at_first(body: dict[str, Any]) -> list[str | Step | Head]:
        with lock:
            total = sum(refused.values())
            kind = "429" if total < 3 else "503" if total < 5 else None
            if kind:
                refused[kind] += 1
        if kind == "429":
            return [Head(429, {"Retry-After": "0"}), '{"error": {"message": "slow down"}}']
        if kind == "503":
            return [Head(503), '{"error": {"message": "overloaded"}}']
        return list(answer_lines(body))

    with scripted_server(busy_at_first) as server:
        result = solve_file(
            [server.url], problems_file(tmp_path, 8), "--answer-only", "--backend-concurrency", "4"
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(2 * i) for i in range(1, 9)]
    assert refused == {"429": 3, "503": 2}
    # Said once per command: for whichever refusal the client met first (4 in flight at once,
    # so a 503 can come back before the 429s, as it did on a busy CI machine).
    assert re.search(r"is busy \((429|503)\); asking again", result.stderr), result.stderr


@pytest.mark.daemon
def test_a_replica_busy_for_good_hands_its_problems_to_the_other(tmp_path: Path):
    def always_busy(_body: dict[str, Any]) -> list[str | Head]:
        return [Head(429, {"Retry-After": "0"}), '{"error": {"message": "full"}}']

    with scripted_server(always_busy) as full, scripted_server(answer_lines) as good:
        result = solve_file([full.url, good.url], problems_file(tmp_path, 6), "--answer-only")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(2 * i) for i in range(1, 7)]
    assert len(good.bodies) == 6


@pytest.mark.daemon
def test_what_still_fails_is_that_problems_error_record_and_the_rest_complete(tmp_path: Path):
    def one_is_refused(body: dict[str, Any]) -> list[str | Step | Head]:
        if doubled(body) == "4":
            return [Head(400), '{"error": {"message": "this one is not allowed"}}']
        return list(answer_lines(body))

    with scripted_server(one_is_refused) as server:
        result = solve_file([server.url], problems_file(tmp_path, 4), "--jsonl")
    assert result.returncode == 1
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert records[1]["error"]["message"].endswith("this one is not allowed")
    assert [r["answer"] for r in records if "error" not in r] == ["2", "6", "8"]


@pytest.mark.daemon
def test_status_probes_each_replica(tmp_path: Path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    with scripted_server(answer_lines, models=["served-q4.gguf"]) as good:
        result = run_phi4("status", "--backend", good.url, "--backend", dead, "--json")
        shown = run_phi4("status", "--backend", good.url, "--backend", dead)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    replicas = found["replicas"]
    assert [(r["replica"], r["state"]) for r in replicas] == [(good.url, "up"), (dead, "down")]
    assert "cannot reach it" in replicas[1]["reason"]
    # The model the servers serve, not the default name phi4 would ask for.
    assert replicas[0]["models"] == ["served-q4.gguf"]
    assert found["model"] == "served-q4.gguf" and found["model_asked"] != "served-q4.gguf"
    assert f"{good.url}  up  serving served-q4.gguf  answered in" in shown.stdout
    alone = run_phi4("status", "--backend", dead)
    assert alone.returncode == 3


@pytest.mark.daemon
def test_status_shows_each_replicas_load_from_its_metrics():
    # llama-server's names (with --metrics): 3 in flight, 40 more tokens at each scrape; vLLM's
    # count finished requests by reason, summed.
    scrapes = itertools.count()

    def llama_server() -> str:
        return (
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\n"
            "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 1\n"
            "# TYPE llamacpp:tokens_predicted_total counter\n"
            f"llamacpp:tokens_predicted_total {1000 + 40 * next(scrapes)}\n"
        )

    def vllm() -> str:
        return (
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{m="a"} 0\n'
            "# TYPE vllm:request_success counter\n"
            'vllm:request_success_total{finished_reason="stop"} 5\n'
            'vllm:request_success_total{finished_reason="length"} 2\n'
        )

    with (
        scripted_server(answer_lines, metrics=llama_server) as a,
        scripted_server(answer_lines, metrics=vllm) as b,
        scripted_server(answer_lines) as bare,
    ):
        result = run_phi4(
            "status", "--backend", a.url, "--backend", b.url, "--backend", bare.url, "--json"
        )
        shown = run_phi4("status", "--backend", a.url, "--backend", b.url, "--backend", bare.url)
    assert result.returncode == 0, result.stderr
    first, second, third = json.loads(result.stdout)["replicas"]
    assert (first["in_flight"], first["waiting"], first["answered"]) == (3, 1, None)
    assert first["tokens_per_s"] == 40  # one scrape a second apart
    assert (second["in_flight"], second["answered"], second["tokens_per_s"]) == (0, 7, None)
    assert third["in_flight"] is None and third["tokens_per_s"] is None
    lines = shown.stdout.splitlines()
    assert lines[0].endswith("in flight 3, waiting 1, 40 tokens/s"), lines
    assert lines[1].endswith("in flight 0, answered 7"), lines
    assert lines[2].endswith("(it publishes no load metrics)"), lines


# --- two real engines, one killed mid-run ------------------------------------------------------


def start_engine(model: Path) -> tuple[subprocess.Popen[bytes], str]:
    # Its default ends the request being answered when another comes in: a server that takes
    # requests at once must not.
    return start_llama_cpp_server(model, "--n_threads", "1", "--interrupt_requests", "False")


@pytest.fixture(params=["llama_cpp.server", "llama-server"])
def two_engines(
    request: pytest.FixtureRequest, tiny_model: Path
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    if request.param == "llama-server":
        if not LLAMA_SERVER:
            pytest.skip("PHI4_TEST_LLAMA_SERVER names no llama-server binary")
        engines = [start_llama_server(tiny_model, "-np", "4", "-t", "1") for _ in range(2)]
    else:
        engines = [start_engine(tiny_model) for _ in range(2)]
    try:
        yield engines
    finally:
        for proc, _url in engines:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.mark.daemon
def test_killing_one_of_two_real_engines_mid_run_loses_no_problem(
    two_engines: list[tuple[subprocess.Popen[bytes], str]], tmp_path: Path
):
    (victim, victim_url), (_survivor, survivor_url) = two_engines
    path = tmp_path / "forty.txt"
    path.write_text("".join(f"What is {i}*13?\n" for i in range(1, 41)))
    proc = subprocess.Popen(
        [
            PHI4,
            "solve",
            "-f",
            str(path),
            "--jsonl",
            "--backend",
            victim_url,
            "--backend",
            survivor_url,
            "-m",
            "tiny",
            "-t",
            "0",
            "-n",
            "24",
            "--backend-concurrency",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()))  # type: ignore[union-attr]
    reader.start()
    first = proc.stdout.readline()  # one answered: others are in flight on both engines
    assert first, "no record came"
    victim.send_signal(signal.SIGKILL)
    rest = proc.stdout.read()  # the same buffered reader as readline: nothing lost between
    proc.wait(timeout=600)
    reader.join(timeout=60)
    err = errors[0]
    records = [json.loads(line) for line in [first, *rest.splitlines()]]
    assert [r["line"] for r in records] == list(range(1, 41)), err
    failed = [r for r in records if "error" in r]
    assert proc.returncode == (1 if failed else 0), err
    assert not failed, f"the survivor answers what the victim held: {failed[:2]}"
    empty = [r for r in records if not (r["solution"] or r["reasoning"])]
    assert not empty, empty[:1]
    assert re.search(re.escape(victim_url) + r" answered \d+[^;]*, \d+ failed \((down|dead)\)", err)


def test_backend_settings_name_replicas_one_way_or_another(tmp_path: Path):
    from phi4cli.core.config import ConfigError, load_settings

    config = tmp_path / "config.toml"
    config.write_text('backends = ["http://a:1/v1", "http://b:2/v1"]\n')
    # Parsed once, into the URLs themselves: in order, each once.
    assert load_settings(config, environ={}).backend == ("http://a:1/v1", "http://b:2/v1")
    env = {"PHI4_BACKEND": "http://a:1/v1, http://c:3/v1 http://a:1/v1"}
    assert load_settings(config, environ=env).backend == ("http://a:1/v1", "http://c:3/v1")
    flags = {"backend": ("http://d:4/v1",)}
    assert load_settings(config, flags, environ=env).backend == ("http://d:4/v1",)
    assert load_settings(config, {"backend": ()}, environ=env).backend == (
        "http://a:1/v1",
        "http://c:3/v1",
    ), "a repeatable flag not given overrides nothing"
    config.write_text('backend = "http://a:1/v1"\nbackends = ["http://b:2/v1"]\n')
    with pytest.raises(ConfigError, match="give backend or backends, not both"):
        load_settings(config, environ={})
    config.write_text('backends = ["http://a:1/v1", "ftp://b/v1"]\n')
    with pytest.raises(ConfigError, match="invalid backend"):
        load_settings(config, environ={})


@pytest.mark.daemon
def test_status_of_an_empty_backend_is_a_usage_error():
    # Before: an IndexError, reported as an internal error.
    empty = run_phi4("status", "--backend", "")
    assert empty.returncode == 2
    assert "--backend needs the URL of an OpenAI-compatible server" in empty.stderr


@pytest.mark.daemon
def test_phi4_serve_as_a_replica_decodes_concurrent_requests_together(
    tiny_model: Path, tmp_path: Path
):
    from tests.test_http_api import start_server

    assert (
        run_phi4(
            "daemon", "start", "-m", str(tiny_model), "--parallel", "4", "--n-ctx", "8192"
        ).returncode
        == 0
    )
    proc, url = start_server(tiny_model)
    try:
        path = tmp_path / "eight.txt"
        path.write_text("".join(f"What is {i}*13?\n" for i in range(1, 9)))
        # Its output goes to files: a pipe nobody reads while the loop below runs fills at
        # 64 KiB (eight 1,500-token records), and the run would wait on it for ever.
        with open(tmp_path / "out", "w") as out_file, open(tmp_path / "err", "w") as err_file:
            run = subprocess.Popen(
                [
                    PHI4,
                    "solve",
                    "-f",
                    str(path),
                    "--jsonl",
                    "--backend",
                    f"{url}/v1",
                    "-m",
                    "tiny-phi3",
                    "-t",
                    "0",
                    "-n",
                    "1500",
                ],
                stdout=out_file,
                stderr=err_file,
            )
        most = 0
        while run.poll() is None:
            status = json.loads(run_phi4("status", "--json").stdout or "{}")
            most = max(most, status.get("memory", {}).get("running") or 0)
            time.sleep(0.05)
        out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
        load = json.loads(run_phi4("status", "--backend", f"{url}/v1", "--json").stdout)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert run.returncode == 0, err
    # phi4 serve's /metrics, as `status --backend` reads it: this run's eight answered.
    (replica,) = load["replicas"]
    assert replica["answered"] >= 8 and replica["in_flight"] == 0, replica
    assert load["model"] == replica["models"][0] == "tiny-phi3", load
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["line"] for r in records] == list(range(1, 9))
    assert all(r["stats"]["completion_tokens"] > 0 for r in records)
    assert most >= 2, "the daemon behind `phi4 serve` had requests of this run at once"


@pytest.mark.daemon
def test_a_client_that_hangs_up_on_phi4_serve_cancels_its_request(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    # The daemon's own count says so: the request ended cancelled, not answered to its end.
    from tests.test_http_api import start_server

    monkeypatch.setenv("PHI4_LOOP", "off")  # the tiny model's greedy text loops: let it run

    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "8192").returncode == 0
    proc, url = start_server(tiny_model)
    body = {
        "model": "default",
        "max_tokens": 8000,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count to a million."}],
    }

    def errors() -> dict[str, int]:
        status = json.loads(run_phi4("status", "--json").stdout or "{}")
        return dict(status.get("metrics", {}).get("errors") or {})

    def cancelled_soon(before: int) -> int:
        deadline = time.monotonic() + 120  # a bound on a stuck daemon, not a speed check
        while time.monotonic() < deadline and errors().get("cancelled", 0) <= before:
            time.sleep(0.1)
        return errors().get("cancelled", 0)

    try:
        import httpx2 as httpx

        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}
            ) as response,
        ):
            assert response.status_code == 200
            next(response.iter_lines())  # the answer has begun; now hang up
        streamed = cancelled_soon(0)
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:
            payload = json.dumps(body).encode()
            raw.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            time.sleep(0.5)  # the request is in; hang up before the whole answer comes
        whole = cancelled_soon(streamed)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert streamed == 1, "a stream the client left was cancelled"
    assert whole == 2, "a whole answer the client left was cancelled too"


@pytest.mark.daemon
def test_a_metrics_page_too_big_to_be_one_is_not_read_to_its_end():
    # A server's answer is bounded here, this page too: beyond 4 MiB it is no load reading.
    page = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\n"
    with scripted_server(answer_lines, metrics=lambda: page + "#" * (5 << 20) + "\n") as big:
        result = run_phi4("status", "--backend", big.url, "--json")
    assert result.returncode == 0, result.stderr
    (replica,) = json.loads(result.stdout)["replicas"]
    assert replica["state"] == "up" and replica["in_flight"] is None


def _broken(kind: str) -> Any:
    """A replica that is up but broken: it answers 500, or a stream that cannot be read."""

    def script(_body: dict[str, Any]) -> list[str | Step | Head]:
        if kind == "500":
            return [Head(500), '{"error": {"message": "internal server error"}}']
        return [chunk({"role": "assistant", "content": ""}), "data: {not json\n\n", data("[DONE]")]

    return script


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["500", "garbage"])
@pytest.mark.daemon
def test_a_replica_up_but_broken_hands_every_problem_to_the_healthy_one(kind: str, tmp_path: Path):
    with scripted_server(_broken(kind)) as broken, scripted_server(answer_lines) as good:
        result = solve_file(
            [broken.url, good.url], problems_file(tmp_path, 20), "--jsonl", "--verbose", timeout=240
        )
        asked = [question_of(b) for b in broken.bodies]
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["answer"] for r in records] == [str(2 * i) for i in range(1, 21)]
    assert len(asked) == len(set(asked)), "each problem went to the broken replica once at most"
    assert len(asked) >= 1
    # The summary counts the broken replica's failures.
    line = next(x for x in result.stderr.splitlines() if broken.url.split("//")[1] in x)
    assert f"{len(asked)} failed" in line, result.stderr


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_lone_broken_replica_is_each_problems_error_record(tmp_path: Path):
    with scripted_server(_broken("500")) as broken:
        result = solve_file([broken.url], problems_file(tmp_path, 3), "--jsonl", timeout=100)
    assert result.returncode == 1
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["error"]["message"] for r in records] == [
        "the backend answered 500: internal server error"
    ] * 3
